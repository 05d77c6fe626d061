"""--mode model: one training step of the whole model under each configuration.

One training step (forward and backward of one micro-batch; no optimizer) for each
configuration, all in one process and interleaved (measure.interleave: rotated rounds,
warm-up dropped, medians). Each configuration has its own deep copy of one model, so all
start from the same weights and see the same batch. The configurations:

  no checkpointing          nothing is recomputed: the time bound, the memory ceiling
  reentrant                 Hugging Face reentrant checkpointing: the baseline
  reentrant, wrapped        the same, with the stash installed on ANOTHER model, so this
                            model's attention goes through the stash's wrapper of the "sdpa"
                            entry and takes its plain path: the cost of stashing 0 layers
  stash k                   reentrant + the stash on the last k decoder layers
  stash all, budget X       reentrant + the stash on every layer under a budget of X bytes
                            (--max-bytes; one row per budget): keeps that would pass it are
                            declined and those layers' recomputes run attention. The stash's
                            peak_bytes is asserted never to pass the budget, on every step.
  SAC                       non-reentrant checkpointing with selective activation
                            checkpointing saving the SDPA op's outputs (the peer approach,
                            which reentrant checkpointing cannot use)
  non-reentrant             plain non-reentrant checkpointing: separates what SAC saves
                            from what non-reentrant checkpointing itself costs or saves
  non-reentrant, stash L    non-reentrant checkpointing + the stash on every layer: the
                            stash next to SAC, at the same memory (compare with both)

The stash is installed before its configuration's step and uninstalled after it (outside
the timed region), so the other configurations run Hugging Face's own "sdpa" entry; a
budget is set the same way and the previous one restored.

Mixed precision (--amp bf16|fp16): a separate run in which EVERY configuration trains the
same float32 weights under torch.autocast; the table has the same rows (its title says
amp), and its losses are compared with one another (bitwise), not with an fp32 run's.

Measurements (measure.py says how time and memory are taken):
  step ms        wall time of forward + backward.
  attention ms   one F.scaled_dot_product_attention call at the layer's shape, q/k/v in
                 Hugging Face's layout (transposed views of the projections) requiring grad,
                 in the compute dtype, grad mode on: the call a layer's recompute makes and
                 the stash skips. Timed in the same rounds (several calls a round), median.
  efficiency k   (reentrant ms - stash k ms) / (k * attention ms): the share of k attention
                 forwards the step actually saved; 1.0 is the physical limit. Under a
                 budget, k is the number of layers whose keep was not declined.
  kept bytes     the stash's own accounting: peak_bytes during the check step (reset before).
  predicted      k * attnstash.backends.kept_bytes for the layer's call (output,
                 log-sum-exp and the backend's extras, shaped by PyTorch's meta functions);
                 under a budget X, k = min(layers, X // per layer).
  peak memory    live tensor bytes at the step's peak above its start (measure.PeakMemory),
                 in a separate, untimed check step.
  loss           every step of every configuration computes the loss of the same batch from
                 the same weights: compared bitwise (and the largest difference printed);
                 the gradients of each configuration's check step are compared with the
                 baseline's, next to the noise floor: a second baseline step against the first.
"""
import copy
import dataclasses
import time

import torch

import attnstash
from attnstash import budget, ops

from . import report as reporting
from .measure import (Clock, PeakMemory, Runner, collector_paused, environment, grad_difference, interleave,
                      loss_difference, progress)
from .models import (attention_forward, attention_inputs, build_model, enable_checkpointing, kept_bytes_per_layer,
                     make_shape, padding_mask, random_batch, sdpa_backend, training_step, zero_grads)

STASHED = ("stash", "stash-nr", "stash-budget")


class ModelConfig:
    """One configuration of the model-mode benchmark, with its own copy of the model.
    kind: "none", "reentrant", "wrapped", "stash", "stash-budget" (the stash on every layer
    under `max_bytes`), "sac", "non-reentrant" or "stash-nr" (the stash under non-reentrant
    checkpointing); stash_layers: k for the stashed kinds."""

    def __init__(self, name, kind, model, input_ids, stash_layers=0, wrapper_host=None, attention_mask=None,
                 amp=None, max_bytes=None):
        self.name, self.kind, self.model, self.input_ids = name, kind, model, input_ids
        self.attention_mask, self.amp, self.max_bytes = attention_mask, amp, max_bytes
        self.stash_layers, self.wrapper_host = stash_layers, wrapper_host
        self.losses = []  # every step's loss
        self.peak_over_budget = []  # the stash's peak_bytes of every turn above the budget (must stay empty)
        self._budget_before = None
        self.runner = Runner(name, self.step, self.setup, self.teardown)
        checkpointing = {"none": "none", "sac": "sac", "non-reentrant": "non-reentrant", "stash-nr": "non-reentrant"}
        enable_checkpointing(model, checkpointing.get(kind, "reentrant"))

    def setup(self):
        zero_grads(self.model)
        if self.kind in STASHED:
            if self.kind == "stash-budget":
                self._budget_before = budget.stash_max_bytes()
                ops.stash_reset_peak()
            attnstash.install_attention_stash(self.model, self.stash_layers, max_bytes=self.max_bytes)
        elif self.kind == "wrapped":
            attnstash.install_attention_stash(self.wrapper_host, 1)

    def teardown(self):
        if self.kind in STASHED:
            attnstash.uninstall_attention_stash(self.model)
            if self.kind == "stash-budget":
                budget.stash_set_max_bytes(self._budget_before)
                peak = attnstash.stash_stats()["peak_bytes"]
                if peak > self.max_bytes:
                    self.peak_over_budget.append(peak)
        elif self.kind == "wrapped":
            attnstash.uninstall_attention_stash(self.wrapper_host)

    def step(self, after_forward=None):
        loss = training_step(self.model, self.input_ids, after_forward, self.attention_mask, self.amp)
        self.losses.append(loss)
        return loss


def check_step(config, device):
    """One untimed step of a configuration that records its memory, what the stash holds,
    and its gradients."""
    config.setup()
    try:
        ops.stash_reset_peak()
        before = attnstash.stash_stats()
        during = {}

        def after_forward():
            during["stash"] = attnstash.stash_stats()
            during["layers"] = attnstash.layer_stash_stats(config.model)

        with collector_paused(), PeakMemory(device) as peak:
            loss = config.step(after_forward)
        after = attnstash.stash_stats()
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in config.model.parameters()]
    finally:
        config.teardown()
        zero_grads(config.model)
    return {
        "loss": loss.item(),
        "peak_bytes": peak.bytes,
        "kept_bytes": after["peak_bytes"],
        "held_after_forward": {"entries": during["stash"]["entries"], "bytes": during["stash"]["bytes"],
                               "by_layer": {str(i): list(v) for i, v in during["layers"].items()}},
        "held_after_step": {"entries": after["entries"], "bytes": after["bytes"]},
        **{k: after[k] - before[k] for k in ("keeps", "declined", "replays", "misses")},
    }, grads


def stash_points(spec, layers):
    """"1,2,4" -> [1, 2, 4]; "all" stands for every layer; default: 1, a quarter, half, all."""
    if not spec:
        return sorted({1, max(1, layers // 4), max(1, layers // 2), layers})
    points = sorted({layers if p.strip() == "all" else int(p) for p in spec.split(",") if p.strip()})
    for p in points:
        if not 1 <= p <= layers:
            raise ValueError(f"--stash-points: {p} is not between 1 and the {layers} layers")
    return points


def budgets(spec):
    """"2MB, 1.5MiB" -> [("2MB", 2000000), ("1.5MiB", 1572864)] (attnstash.parse_bytes); [] for none."""
    if not spec:
        return []
    return [(part.strip(), budget.parse_bytes(part.strip())) for part in spec.split(",") if part.strip()]


def run_model_mode(shape, args, out_dir):
    """Build the configurations, run their check steps, time them interleaved, report."""
    device = shape.device
    clock = Clock(device)
    backend = sdpa_backend(shape)
    per_layer, formula = kept_bytes_per_layer(shape)
    if per_layer is None:
        raise SystemExit(f"attnstash.bench: torch picks {backend} attention at this shape on {device}; {formula} "
                         "(it keeps CPU flash attention, and cuDNN, flash and memory-efficient attention on CUDA).")
    points = stash_points(args.stash_points, shape.layers)
    limits = budgets(getattr(args, "max_bytes", None))
    print(f"model: {shape.describe()}\nSDPA backend: {backend}; stash points: {points}"
          + (f"; budgets: {', '.join(spec for spec, _ in limits)}" if limits else ""), flush=True)

    t0 = time.perf_counter()
    base = build_model(shape, seed=args.seed)
    input_ids = random_batch(shape, seed=args.seed + 1)
    mask = padding_mask(shape, args.pad)
    host = build_model(make_shape("tiny", layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, vocab=16, seq=8,
                                  device="cpu", dtype="float32"))

    def config(name, kind, **kwargs):  # each configuration gets its own copy of the model
        return ModelConfig(name, kind, copy.deepcopy(base), input_ids, attention_mask=mask, amp=shape.amp, **kwargs)

    configs = [config("no checkpointing", "none"), config("reentrant", "reentrant"),
               config("reentrant, wrapped", "wrapped", wrapper_host=host)]
    configs += [config(f"stash {k}", "stash", stash_layers=k) for k in points]
    configs += [config(f"stash all, budget {spec}", "stash-budget", stash_layers=shape.layers, max_bytes=limit)
                for spec, limit in limits]
    configs += [config("SAC (non-reentrant)", "sac"), config("non-reentrant", "non-reentrant"),
                config(f"non-reentrant, stash {shape.layers}", "stash-nr", stash_layers=shape.layers)]
    del base
    baseline = configs[1]

    # Check steps first: memory, kept bytes, gradients against the baseline's; a second
    # baseline step gives the noise floor of that comparison.
    checks, reference = {}, None
    for c in [baseline] + [c for c in configs if c is not baseline]:
        result, grads = check_step(c, device)
        if reference is None:
            reference = grads
            _, again = check_step(baseline, device)
            noise_floor = dict(zip(("grads_equal", "grad_max_rel_diff"), grad_difference(again, reference)))
            del again
        result["grads_equal"], result["grad_max_rel_diff"] = grad_difference(grads, reference)
        checks[c.name] = result
        del grads
    del reference
    print(f"built {len(configs)} model copies and ran their check steps in {time.perf_counter() - t0:.1f} s",
          flush=True)

    # Timed rounds: every configuration, plus the attention forward alone, interleaved.
    q, k, v = attention_inputs(shape)
    attention = Runner("attention forward (one layer)", lambda: attention_forward(shape, q, k, v), calls=5)
    runners = [c.runner for c in configs] + [attention]
    bar = progress(args.warmup + args.repeats, "bench rounds")
    interleave(runners, clock, args.warmup, args.repeats, bar)
    if bar is not None:
        bar.close()

    all_losses = [loss for c in configs for loss in c.losses]
    losses_equal, max_loss_diff = loss_difference(all_losses, [all_losses[0]] * len(all_losses))
    t_base, t_attn = baseline.runner.median_ms, attention.median_ms
    # The stash saves against the checkpointing it runs under.
    t_non_reentrant = next(c for c in configs if c.kind == "non-reentrant").runner.median_ms
    t_under = {"stash": t_base, "stash-budget": t_base, "stash-nr": t_non_reentrant}
    rows = []
    for c in configs:
        check = checks[c.name]
        row = {
            "name": c.name, "kind": c.kind, "stash_layers": c.stash_layers,
            "times_ms": c.runner.times_ms, "median_ms": c.runner.median_ms,
            "vs_reentrant": c.runner.median_ms / t_base - 1.0,
            "loss": check["loss"], "peak_bytes": check["peak_bytes"], "kept_bytes": check["kept_bytes"],
            "predicted_kept_bytes": per_layer * c.stash_layers if c.kind in STASHED else 0,
            "check": check,
        }
        if c.kind == "stash-budget":
            fitting = min(c.stash_layers, c.max_bytes // per_layer)
            row.update(max_bytes=c.max_bytes, predicted_kept_bytes=per_layer * fitting, kept_layers=check["replays"],
                       peak_over_budget=c.peak_over_budget)
            if check["kept_bytes"] > c.max_bytes or c.peak_over_budget:
                raise AssertionError(f"{c.name}: the stash held {max([check['kept_bytes'], *c.peak_over_budget]):,} "
                                     f"bytes, over its budget of {c.max_bytes:,}")
        if c.kind in STASHED:
            saved = t_under[c.kind] - c.runner.median_ms
            kept_layers = row.get("kept_layers", c.stash_layers)
            row["saved_ms_per_layer"] = saved / kept_layers if kept_layers else float("nan")
            row["efficiency"] = saved / (kept_layers * t_attn) if kept_layers else float("nan")
        rows.append(row)
    wrapped = next(r for r in rows if r["kind"] == "wrapped")
    report = {
        "mode": "model", "preset": args.preset, "shape": dataclasses.asdict(shape), "pad": args.pad,
        "environment": environment(shape, torch.get_num_threads()), "sdpa_backend": backend,
        "rounds": {"warmup": args.warmup, "repeats": args.repeats},
        "attention_forward_ms": {"times_ms": attention.times_ms, "median_ms": t_attn},
        "kept_bytes_per_layer": per_layer, "prediction_formula": formula,
        "configs": rows,
        "losses_equal": losses_equal, "max_loss_diff": max_loss_diff, "grad_noise_floor": noise_floor,
        "wrapper_overhead": {"reentrant_ms": t_base, "wrapped_ms": wrapped["median_ms"],
                             "relative": wrapped["vs_reentrant"]},
        "efficiency": {str(r["stash_layers"]): r["efficiency"] for r in rows if r["kind"] == "stash"},
    }
    reporting.print_model_report(report)
    if out_dir is not None:
        reporting.write_json_and_plot(out_dir, "bench", report, reporting.plot_model_report)
    return report
