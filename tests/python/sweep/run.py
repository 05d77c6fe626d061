"""The checks for one model type (pool.py runs each type in a process of its own).

check_arch(arch): build the tiny model (models.build) and for each checkpointing mode
(reentrant, non-reentrant) and batch (unpadded; left-padded where the model takes text with
an attention_mask):
  1. the baseline is reproducible: two runs without the stash give bitwise the same loss and
     gradients (else "baseline not deterministic", and that combination proves nothing);
  2. with the stash on every attention layer, loss and every gradient (of the parameters and
     of the floating inputs) are bitwise the baseline's, keeps and replays each grow by the
     number of F.scaled_dot_product_attention calls in stashed layers that the backward
     reaches (probe), and nothing is held after (also after a refusal);
  3. no attention call runs again in the backward outside the layers the installer finds: a
     checkpointed layer it does not find fails the type, as its recompute would run attention
     again unseen. Seen twice: by the probe ("missed", by module), and with the stash on, by
     stash_stats()["recomputed"] (every call of aten::scaled_dot_product_attention, whatever
     its name).
"""
import copy
import gc
import time
import traceback

import torch

import attnstash
from attnstash.install import find_layers

from . import inputs, models
from .models import SEED

MODES = ("reentrant", "non-reentrant")


def set_mode(model, mode):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    if mode == "reentrant" and getattr(model, "main_input_name", None) == "input_ids":
        try:
            model.enable_input_require_grads()
        except (NotImplementedError, AttributeError, TypeError):
            pass  # no input embeddings: the floating input itself requires grad (inputs.py)


def _copy(base, mode):
    model = copy.deepcopy(base)
    set_mode(model, mode)
    return model


class _Phase:
    name = "forward"


# Floating inputs that require grad in every run (a fresh leaf per run, its gradient compared
# with the parameters'); raw audio (input_values) does not: wav2vec2's feature encoder sets
# requires_grad on a view of it, which only a tensor that does not require grad allows.
# Under reentrant checkpointing the first checkpointed layer's input requires grad either way,
# through the trainable embedding before it; for text, enable_input_require_grads as well.
GRAD_INPUTS = ("pixel_values", "input_features", "hidden_states")


def _leaves(batch):
    return {k: v.detach().clone().requires_grad_() if k in GRAD_INPUTS else v for k, v in batch.items()}


def train_step(model, batch, phase=None):
    """One forward and backward: (loss, {parameter or input name: grad})."""
    phase = phase or _Phase()
    model.zero_grad(set_to_none=True)
    args = _leaves(batch)
    torch.manual_seed(SEED + 1)  # models that draw random numbers in training (router jitter) repeat
    phase.name = "forward"
    loss = inputs.loss(model(**args))
    phase.name = "backward"
    loss.backward()
    phase.name = "done"
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input {k}": v.grad.clone() for k, v in args.items() if torch.is_tensor(v) and v.grad is not None})
    return loss.detach().clone(), grads


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(a, b):
    """What differs bitwise between two (loss, grads) results (NaN equals NaN of the same bits)."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    out = []
    if loss_a.dtype != loss_b.dtype or not torch.equal(_bits(loss_a), _bits(loss_b)):
        out.append(f"loss {loss_a.item()!r} vs {loss_b.item()!r}")
    if grads_a.keys() != grads_b.keys():
        out.append(f"gradients of different parameters: {sorted(grads_a.keys() ^ grads_b.keys())[:4]}")
    wrong = sorted(n for n in grads_a.keys() & grads_b.keys()
                   if grads_a[n].dtype != grads_b[n].dtype or grads_a[n].shape != grads_b[n].shape
                   or not torch.equal(_bits(grads_a[n]), _bits(grads_b[n])))
    if wrong:
        worst = max(wrong, key=lambda n: (grads_a[n].double() - grads_b[n].double()).abs().nan_to_num(1e30).max().item())
        diff = (grads_a[worst].double() - grads_b[worst].double()).abs().max().item()
        out.append(f"{len(wrong)} gradients differ ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}; "
                   f"largest |diff| {diff:.3g} in {worst})")
    return out


def _short(e, limit=300):
    text = f"{type(e).__name__}: {e}" if not str(e).startswith("attnstash") else str(e)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_line(e, limit=200):
    text = str(e).strip().splitlines()[0].strip() if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _CountSdpa(torch.overrides.TorchFunctionMode):
    def __init__(self, on_sdpa):
        super().__init__()
        self.calls, self.on_sdpa = 0, on_sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.scaled_dot_product_attention:
            self.calls += 1
            self.on_sdpa(args, kwargs or {})
        return func(*args, **(kwargs or {}))


def probe(model, batch):
    """One training step without the stash, under non-reentrant checkpointing (whose first
    forward runs with grad on where a backward can reach it): (F.scaled_dot_product_attention
    calls, {attention layer index: calls in it}, {attention layer index: calls in the autograd
    graph: grad on and a query, key or value that requires grad}, {name of a module the backward
    recomputes: forward attention calls in it outside every layer attnstash finds}: checkpointed
    attention the installer did not find) for the layers attnstash finds. The forward's calls
    are seen by a function mode, which the backward does not run under; a call counts as
    recomputed where the innermost module it ran in runs again in the backward."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    set_mode(model, "non-reentrant")
    index_of = {id(module): index for index, _, module in attnstash.attention_layers(model)}
    names = {id(m): name for name, m in model.named_modules()}
    stack, ran, grad, outside, recomputed = [], {}, {}, {}, {}

    def on_sdpa(args, kwargs):
        layer = next((index_of[id(m)] for m in reversed(stack) if id(m) in index_of), None)
        if layer is None:
            if stack:  # by the innermost module it ran in
                outside[id(stack[-1])] = outside.get(id(stack[-1]), 0) + 1
            return
        ran[layer] = ran.get(layer, 0) + 1
        tensors = [t for t in list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")]
                   if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            grad[layer] = grad.get(layer, 0) + 1

    def enter(module, args):
        stack.append(module)
        if torch._C._current_graph_task_id() != -1:
            recomputed[id(module)] = True

    def leave(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    counter = _CountSdpa(on_sdpa)
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        torch.manual_seed(SEED + 1)
        with counter:
            loss = inputs.loss(model(**_leaves(batch)))
        stack.clear()
        try:
            loss.backward()
        except Exception:  # noqa: BLE001 - the combos say why; nothing is known of the recompute
            recomputed = None
        del loss
    finally:
        for h in handles:
            h.remove()
    missed = None if recomputed is None else {names.get(m, "?"): calls for m, calls in outside.items()
                                              if m in recomputed}
    return counter.calls, ran, grad, missed


def _stats():
    return attnstash.stash_stats()


def _held():
    s = _stats()
    if s["records"] or s["bytes"]:  # perhaps only garbage not yet collected holds them
        gc.collect()
        s = _stats()
    return s["records"], s["bytes"]


def new_row(arch):
    head, name = models.model_types().get(arch, (None, None))
    return dict(arch=arch, head=head, model_class=name, outcome=None, stashed=None, attention_layers=None,
                attention_layer_names=None, layers_found=None, batches=None, notes=[], combos={}, seconds=None)


def check_arch(arch, modes=MODES, kinds=inputs.KINDS):
    """Run the sweep's checks for one model type in this process; never raises. Returns the
    row: {arch, head, model_class, outcome, stashed, attention_layers (indices among the layers
    found), attention_layer_names, layers_found (how many candidate layers), batches, notes,
    combos, probe, seconds}."""
    start = time.time()
    row = new_row(arch)
    try:
        _check(arch, row, modes, kinds)
    except Exception as e:  # a bug of the sweep itself, or something none of the steps caught
        row["outcome"] = f"FAILED: unexpected {_short(e)}"
        row["notes"].append(traceback.format_exc(limit=6))
    finally:
        records, nbytes = _held()
        if records or nbytes:
            attnstash.stash_clear()
            if not row["outcome"].startswith("FAILED"):
                row["outcome"] = f"FAILED: {records} records ({nbytes} bytes) left in the stash after the arch"
    row["seconds"] = round(time.time() - start, 1)
    return row


def _build(arch, row):
    try:
        head, base = models.build(arch)
    except models.Skip as e:
        row["outcome"] = f"skipped: {e}"
        return None
    except Exception as e:
        reason = models.skip_reason(e)
        row["outcome"] = f"skipped: {reason}" if reason else f"not buildable: {_first_line(e)}"
        why = models.ARCH.get(arch, {}).get("why")
        if why:
            row["notes"].append(why)
        return None
    if not getattr(base, "supports_gradient_checkpointing", False):
        row["outcome"] = f"skipped: {type(base).__name__} does not support gradient checkpointing"
        return None
    return head, base


def _check(arch, row, modes, kinds):
    built = _build(arch, row)
    if built is None:
        return
    head, base = built
    try:
        layers_found = find_layers(base)
        found = attnstash.attention_layers(base)
    except attnstash.InstallError as e:
        row["outcome"] = f"refused at install: {_short(e, 400)}"
        return
    row["layers_found"] = len(layers_found)
    row["attention_layers"] = [i for i, _, _ in found]
    row["attention_layer_names"] = [name for _, name, _ in found]
    kinds = [k for k in kinds if k == "unpadded" or inputs.takes_mask(base, head)]
    row["batches"] = kinds
    try:
        batch_of = {kind: inputs.batch(base, head, kind) for kind in kinds}
    except Exception as e:
        row["outcome"] = f"not buildable: the sweep's inputs for it fail: {_first_line(e)}"
        return

    # The plain model must train (the combinations where it does not are not buildable).
    baselines, broken = {}, {}
    for mode in modes:
        for kind in kinds:
            try:
                first, second = (train_step(_copy(base, mode), batch_of[kind]) for _ in range(2))
            except Exception as e:
                broken[f"{mode}/{kind}"] = _first_line(e)
                continue
            baselines[mode, kind] = first, differences(first, second)
    if broken:
        causes = {}
        for combo, error in broken.items():
            causes.setdefault(error, []).append(combo)
        row["outcome"] = "not buildable: " + " | ".join(f"{'+'.join(c)} training step fails without the stash: {e}"
                                                        for e, c in causes.items())
        if not baselines:
            return

    # Install (once to see what it does; then per combination on a fresh copy).
    model = copy.deepcopy(base)
    set_mode(model, "reentrant")
    try:
        stashed = attnstash.install_attention_stash(model)
    except ValueError as e:
        if str(e).startswith("attnstash"):
            row["outcome"] = f"refused at install: {_short(e, 400)}"
        else:
            row["outcome"] = f"FAILED: install raised a ValueError that is not attnstash's: {_short(e)}"
        return
    except Exception as e:
        row["outcome"] = f"FAILED: install raised {_short(e)}"
        return
    attnstash.uninstall_attention_stash(model)
    row["stashed"] = stashed
    if stashed != row["attention_layers"]:
        row["outcome"] = f"FAILED: install(None) stashed {stashed}, not the attention layers {row['attention_layers']}"
        return
    expected = {}  # kind -> attention calls a backward reaches (kept), per forward
    missed = {}  # module name -> attention calls recomputed outside the layers found
    for kind in sorted({k for _, k in baselines}, key=kinds.index):
        sdpa_calls, ran, grad, missed_here = probe(copy.deepcopy(base), batch_of[kind])
        for name, calls in (missed_here or {}).items():
            missed[name] = max(missed.get(name, 0), calls)
        total, expected[kind] = sum(ran.values()), sum(grad.values())
        row.setdefault("probe", {})[kind] = dict(attention_layers=len(found), layers_ran=len(ran),
                                                 attention_calls=total, attention_calls_with_grad=expected[kind],
                                                 sdpa_calls=sdpa_calls, missed=missed_here)
        _probe_notes(row, kind, len(found), ran, total, expected[kind], sdpa_calls)

    failures, refusals, unverified = [], [], []
    for mode, kind in baselines:
        combo = f"{mode}/{kind}"
        reference, nondeterministic = baselines[mode, kind]
        result = _stash_combo(base, mode, batch_of[kind], reference, expected[kind])
        if nondeterministic:
            result["baseline"] = "not deterministic: " + "; ".join(nondeterministic)
            if result["status"] == "different":
                result["status"] = "unverified"
        row["combos"][combo] = result
        if result.get("note") and result["note"] not in row["notes"]:
            row["notes"].append(result["note"])
        status = result["status"]
        if status == "refused":
            refusals.append((combo, result["detail"]))
        elif status == "unverified":
            unverified.append(combo)
        elif status != "bitwise":
            failures.append((combo, result["detail"]))
    outcome = _outcome(failures, refusals, unverified, len(baselines))
    if missed:
        outcome = (f"FAILED: the backward recomputes {sum(missed.values())} attention calls outside the layers the "
                   f"installer found, in {', '.join(sorted(missed))}: checkpointed layers it did not find "
                   f"(with the stash on the layers found: {outcome})")
    if not broken or outcome.startswith("FAILED"):
        row["outcome"] = outcome
    else:  # not buildable in some combinations: what the others gave
        row["outcome"] += f" (the other combinations, {', '.join(row['combos'])}: {outcome})"


def _probe_notes(row, kind, layers, ran, total, calls, sdpa_calls):
    notes = []
    if len(ran) != layers:
        notes.append(f"{layers - len(ran)} of {layers} attention layers called no attention in the swept forward")
    if total > len(ran):
        notes.append(f"{len(ran)} attention layers called attention {total} times per forward")
    if calls < total:
        notes.append(f"{total - calls} of {total} attention calls ran outside the autograd graph "
                     "(no_grad or frozen: nothing to keep)")
    if sdpa_calls != total:
        notes.append(f"{sdpa_calls} F.scaled_dot_product_attention calls per forward, {total} of them in the "
                     "attention layers found")
    if calls == 0:
        notes.append("no attention call to keep: nothing was stashed")
    for note in notes:
        note = f"{kind}: {note}" if kind != "unpadded" else note
        if note not in row["notes"]:
            row["notes"].append(note)


def _outcome(failures, refusals, unverified, combos):
    if failures:
        causes = {}
        for combo, detail in failures:
            causes.setdefault(detail, []).append(combo)
        return "FAILED: " + " | ".join(f"{'+'.join(c)}: {d}" for d, c in causes.items())
    if refusals:
        where = "" if len(refusals) == combos else f" ({', '.join(c for c, _ in refusals)})"
        return f"refused at run{where}: " + " | ".join(sorted({d for _, d in refusals}))
    if unverified:
        return f"baseline not deterministic ({', '.join(unverified)})"
    return "supported"


def _stash_combo(base, mode, batch, reference, expected):
    """One combination with the stash on every attention layer: {status, detail, ...}."""
    result = {"status": None, "detail": ""}
    model = _copy(base, mode)
    attnstash.install_attention_stash(model)
    phase = _Phase()
    before = _stats()
    got = error = None
    try:
        got = train_step(model, batch, phase)
    except Exception as e:  # noqa: BLE001 - classified below
        error = e
    finally:
        attnstash.uninstall_attention_stash(model)
    after = _stats()
    del model
    keeps, replays = after["keeps"] - before["keeps"], after["replays"] - before["replays"]
    unused = after["released_unused"] - before["released_unused"]
    result.update(keeps=keeps, replays=replays, expected=expected, declined=after["declined"] - before["declined"],
                  misses=after["misses"] - before["misses"], released_unused=unused,
                  recomputed=after["recomputed"] - before["recomputed"])
    if error is not None:
        message = _short(error, 500)
        attn = isinstance(error, (RuntimeError, ValueError)) and str(error).startswith("attnstash")
        error = None
        records, nbytes = _held()
        if records or nbytes:
            attnstash.stash_clear()
            result.update(status="failed", detail=f"{records} records left in the stash after an error in the "
                                                  f"{phase.name}: {message}")
        elif attn and phase.name == "forward":
            result.update(status="refused", detail=message)
        elif attn and "attn_mask requires grad" in message:
            # A mask made from parameters shows it requires grad only in a reentrant
            # recompute (the first forward runs under no_grad): refused there, clearly.
            result.update(status="refused", detail=f"in the backward: {message}")
        elif attn:
            result.update(status="failed", detail=f"attnstash error in the {phase.name} (after the forward "
                                                  f"kept): {message}")
        else:
            result.update(status="failed", detail=f"{phase.name} raised {message}")
        return result
    records, nbytes = _held()
    if records or nbytes:
        attnstash.stash_clear()
        result.update(status="failed", detail=f"{records} records ({nbytes} bytes) left in the stash")
        return result
    diff = differences(got, reference)
    if diff:
        result.update(status="different", detail="not bitwise: " + "; ".join(diff))
        return result
    if (keeps != expected or replays + unused != keeps or result["misses"] or result["declined"]
            or result["recomputed"]):
        result.update(status="failed", detail=f"keeps +{keeps}, replays +{replays}, released unused +{unused}, "
                                              f"misses +{result['misses']}, declined +{result['declined']}, "
                                              f"recomputed outside the stash +{result['recomputed']} for "
                                              f"{expected} stashed attention calls per forward")
        return result
    result["status"] = "bitwise"
    if unused:  # kept by a forward whose output no backward reaches: released with its graph
        result["note"] = (f"{unused} of {keeps} kept outputs never replayed (no backward reached those layers; "
                          "released with the graph)")
    return result
