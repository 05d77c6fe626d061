"""The diffusers sweep: every model class of the installed diffusers that checkpoints its blocks,
built tiny (tiny_diffusers), trained with and without the stash on every block it finds.

    python tests/python/sweep_diffusers.py [--models Flux...,Wan...] [--out out/sweep-diffusers]

For each class and checkpointing mode (non-reentrant, diffusers' default; reentrant): the run
without the stash is reproducible bitwise (else "baseline not deterministic"); with the stash,
loss and every gradient are bitwise the same, the keeps are the attention calls of the stashed
blocks that a backward can reach, the replays those their recomputes make, nothing is held
after, and no attention call runs again in the backward outside the stashed blocks (else a
checkpointed block the installer did not find: FAILED; seen by the probe, by module, and by
stash_stats()["recomputed"] with the stash on). Outcomes: "supported" (both modes),
"supported (non-reentrant; ...)" where the model itself cannot train under reentrant
checkpointing, "refused at install: ...", "refused at run: ..." (an attnstash error), "not
run: ..." (why), "baseline not deterministic (...)", "FAILED: ...". Writes sweep.json and
sweep.md under --out.

check(name) runs one class in this process (the pytest cases use it).
"""
import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import torch

import attnstash
import tiny_diffusers as tiny

MODES = ("non-reentrant", "reentrant")


def _bitwise(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return (torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
            and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a))


def _model(name, mode):
    model, inputs = tiny.build(name)
    model.enable_gradient_checkpointing(tiny.checkpoint_function(mode == "reentrant"))
    return model, inputs


def probe(model, inputs, layers):
    """Attention calls of one step without the stash: (in the stashed layers' forwards, where a
    backward can reach them; in their recomputes; {name of a module the backward recomputes:
    attention calls in it outside every stashed layer}: checkpointed attention the installer did
    not find). F.scaled_dot_product_attention is counted at its attribute (the recompute runs in
    backward, where function modes are not active)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    stack, counts, missed = [], [0, 0], {}
    names = {id(m): name for name, m in model.named_modules()}
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(query, key, value, *args, **kwargs):
        recompute = torch._C._current_graph_task_id() != -1
        if any(id(m) in layers for m in stack):
            if recompute:
                counts[1] += 1
            elif torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
                counts[0] += 1
        elif recompute and stack:
            where = names.get(id(stack[0]), type(stack[0]).__name__)
            missed[where] = missed.get(where, 0) + 1
        return original(query, key, value, *args, **kwargs)

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        tiny.loss_and_grads(model, inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        for h in handles:
            h.remove()
    return counts[0], counts[1], missed


def _combo(name, mode, expected):
    """One checkpointing mode: {status, keeps, replays, expected, ...}; `expected`: the probe's
    counts (the same calls in either mode)."""
    base, inputs = _model(name, mode)
    try:
        reference = tiny.loss_and_grads(copy.deepcopy(base), inputs)
    except Exception as e:
        return {"status": "model fails", "error": _short(e)}
    deterministic = _bitwise(reference, tiny.loss_and_grads(copy.deepcopy(base), inputs))
    model = copy.deepcopy(base)
    try:
        stashed = attnstash.install_attention_stash(model)
    except attnstash.InstallError as e:
        return {"status": "refused at install", "error": _short(e)}
    layers = {id(m) for i, _, m in attnstash.attention_layers(model) if i in stashed}
    try:
        before = attnstash.stash_stats()
        try:
            got = tiny.loss_and_grads(model, inputs)
        except attnstash.StashError as e:
            return {"status": "refused at run", "error": _short(e)}
        after = attnstash.stash_stats()
    finally:
        attnstash.uninstall_attention_stash(model)
    counted = (after["keeps"] - before["keeps"], after["replays"] - before["replays"])
    recomputed = after["recomputed"] - before["recomputed"]
    gc.collect()
    held = attnstash.stash_stats()["records"]
    status = ("bitwise" if _bitwise(got, reference) else "different" if deterministic else "not deterministic")
    result = {"status": status, "keeps": counted[0], "replays": counted[1], "expected": list(expected or ()),
              "held": held, "stashed": len(stashed), "recomputed": recomputed}
    if status == "bitwise" and (counted != tuple(expected or ()) or held or not counted[0] or recomputed):
        result["status"] = "wrong counters"
    return result


def check(name):
    """{model, outcome, combos, seconds} for one case of tiny_diffusers.CASES; never raises."""
    start = time.perf_counter()
    row = {"model": name, "outcome": None, "combos": {}}
    try:
        base, inputs = _model(name, "non-reentrant")
        try:
            stashed = {id(m) for _, _, m in attnstash.attention_layers(base)}
            *expected, row["missed"] = probe(base, inputs, stashed)
        except (attnstash.InstallError, RuntimeError):
            expected = None  # refused, or the model does not train: the combos say which
        for mode in MODES:
            row["combos"][mode] = _combo(name, mode, expected)
    except Exception as e:  # a crash in the sweep or in attnstash
        row["outcome"] = f"FAILED: {_short(e)}"
    finally:
        attnstash.stash_clear()
    row["outcome"] = row["outcome"] or outcome(row["combos"], row.get("missed"))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def outcome(combos, missed=None):
    """The row's outcome from its combos, and the probe's `missed` (attention recomputed outside
    the stashed blocks, by the module recomputed)."""
    nr, r = combos["non-reentrant"], combos["reentrant"]
    if missed:
        return (f"FAILED: the backward recomputes {sum(missed.values())} attention calls outside the blocks the "
                f"installer found, in {', '.join(sorted(missed))}: checkpointed blocks it did not find")
    for combo in (nr, r):
        if combo["status"] in ("different", "wrong counters"):
            return f"FAILED: {combo['status']}: {json.dumps(combo)}"
        if combo["status"].startswith("refused"):
            return f"{combo['status']}: {combo['error']}"
    if nr["status"] == "not deterministic" or r["status"] == "not deterministic":
        return "baseline not deterministic (its run without the stash differs between two runs)"
    if nr["status"] == "model fails":
        return f"FAILED: the model does not train without the stash: {nr['error']}"
    if r["status"] == "model fails":
        return f"supported (non-reentrant; the model cannot train under reentrant checkpointing: {r['error']})"
    return "supported"


def _short(e, limit=300):
    text = " ".join((str(e) if str(e).startswith("attnstash") else f"{type(e).__name__}: {e}").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def rows(names=None):
    names = names or list(tiny.CASES)
    found = [check(name) for name in names]
    if not names or names == list(tiny.CASES):
        found += [{"model": name, "outcome": f"not run: {why}", "combos": {}, "seconds": 0}
                  for name, why in tiny.NOT_RUN.items()]
    return sorted(found, key=lambda row: row["model"])


def markdown(found):
    import diffusers
    lines = [f"diffusers {diffusers.__version__}, torch {torch.__version__}: {len(found)} model classes "
             "(tests/python/sweep_diffusers.py)", "", "| model | outcome | stashed blocks | keeps / replays (per step) |",
             "|---|---|---:|---|"]
    for row in found:
        nr = row["combos"].get("non-reentrant", {})
        lines.append(f"| {row['model']} | {row['outcome']} | {nr.get('stashed', '')} | "
                     f"{nr.get('keeps', '')} / {nr.get('replays', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="sweep_diffusers.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--out", default="out/sweep-diffusers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = rows(args.models.split(",") if args.models else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(found, indent=1))
    (out / "sweep.md").write_text(markdown(found))
    print(markdown(found))
    return 1 if any(row["outcome"].startswith("FAILED") for row in found) else 0


if __name__ == "__main__":
    sys.exit(main())
