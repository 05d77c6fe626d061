"""The decoder modes: --mode model, --mode layer, --mode seq-sweep.

model      one training step (forward + backward) of the whole decoder per configuration: no
           checkpointing; reentrant (the reference); reentrant with the stash on 0 layers
           (installed on another model: what an install costs the others); reentrant + the stash on the last k
           layers (--stash-points); + the stash on every layer under each --max-bytes budget (its
           peak asserted never above it); SAC; non-reentrant with and without the stash. --pad:
           left-padded batches (4-D masks).
layer      one decoder layer (input x requires grad; loss = sum(layer(x) * g)) under reentrant and
           non-reentrant checkpointing, with and without the stash, and SAC; 30 rounds or more.
seq-sweep  layer mode at each length of --seqs, the micro-batch fixed; each length gets the rounds
           its share of --sweep-seconds holds (5 to 30; --repeats fixes them); a length that fails
           (out of memory) is recorded and the sweep goes on. --offload: every configuration
           under the user's offloading (what the stash keeps goes through it; offload_kind says
           which), and the stash with its own offload (offload=True) besides.
Reported (harness.py measures): medians, saved ms per stashed layer and the efficiency (saved /
one attention forward alone), the stash against SAC, kept bytes against attnstash.plan's
prediction, loss and every gradient against plain checkpointing.
"""
import copy
import dataclasses
import time
import traceback

import torch

from . import report
from .harness import Config, Run, environment, interleave, measure
from .models import build_model, padding_mask, plan, random_batch


class ModelStep:
    """The whole model's step: input_ids (and a padding mask) are also the labels."""
    inputs, layers = (), None

    def __init__(self, shape, ids, mask):
        self.ids, self.mask, self.device, self.amp = ids, mask, shape.device, shape.amp
        self.labels = ids if mask is None else ids.masked_fill(mask == 0, -100)

    def forward(self, model):
        return model(input_ids=self.ids, attention_mask=self.mask, labels=self.labels).loss


class LayerStep:
    """One decoder layer of a one-layer model; set_inputs(shape) draws its input x (requires grad)
    and g, [batch, seq, hidden], on the device."""
    layers = None

    def __init__(self, shape, seed=0):
        self.seed, self.device, self.amp = seed, shape.device, shape.amp
        self.model = build_model(dataclasses.replace(shape, layers=1), seed=seed)
        self.set_inputs(shape)

    def set_inputs(self, shape):
        self.inputs = ()
        self.shape = s = dataclasses.replace(shape, layers=1)
        g, dtype = torch.Generator(device=s.device).manual_seed(self.seed + 3), next(self.model.parameters()).dtype
        x = torch.randn(s.batch, s.seq, s.hidden, generator=g, device=s.device).to(dtype).requires_grad_()
        self.g = torch.randn(s.batch, s.seq, s.hidden, generator=g, device=s.device).to(dtype)
        self.position_ids = torch.arange(s.seq, device=s.device).unsqueeze(0)
        with torch.no_grad():
            self.rope = self.model.model.rotary_emb(x, self.position_ids)
        self.inputs = (x,)

    def forward(self, model):
        y = model.model.layers[0](self.inputs[0], attention_mask=None, position_ids=self.position_ids,
                                  position_embeddings=self.rope)
        return ((y[0] if isinstance(y, tuple) else y) * self.g).sum()


LAYER_CONFIGS = {"reentrant": [Config("reentrant"), Config("reentrant", 1)],
                 "non-reentrant": [Config("non-reentrant"), Config("non-reentrant", 1), Config("sac")]}
LAYER_CONFIGS["both"] = LAYER_CONFIGS["reentrant"] + LAYER_CONFIGS["non-reentrant"]
LAYER = "one decoder layer, forward + backward, ms"


def model_mode(shape, args, out):
    base, mask = build_model(shape, seed=args.seed), padding_mask(shape, args.pad)
    step = ModelStep(shape, random_batch(shape, seed=args.seed + 1), mask)
    planned = plan(base, shape, padded=mask is not None)
    n = len(planned.layers)
    points = args.stash_points or sorted({1, max(1, n // 4), max(1, n // 2), n})
    if not all(1 <= k <= n for k in points):
        raise SystemExit(f"benchmarks: --stash-points must be between 1 and the {n} layers, got {points}")
    configs = ([Config("none"), Config("reentrant"), Config("reentrant", 0)] + [Config("reentrant", k) for k in points]
               + [Config("reentrant", n, spec) for spec, _ in args.max_bytes]
               + [Config("sac"), Config("non-reentrant"), Config("non-reentrant", n)])
    print(f"model: {shape.describe()}", flush=True)
    runs = [Run(c, copy.deepcopy(base), step) for c in configs]
    del base
    times, point = measure(runs, runs[1], planned, "training step, ms", args.repeats, args.warmup)
    table = point["configs"]
    result = {"mode": "model", "preset": args.preset, "shape": dataclasses.asdict(shape), "pad": args.pad,
              "environment": environment(shape.device), **point,
              "installed_overhead": next(r["vs_reference"] for r in table if r["stash_layers"] == 0),
              "efficiency": {str(r["stash_layers"]): r["efficiency"] for r in table
                             if r["checkpointing"] == "reentrant" and r["stash_layers"] and not r["budget"]}}
    report.print_measurements(times)
    report.print_rows(result)
    report.write(out, "bench", result, report.plot_model)
    return result


def layer_mode(shape, args, out):
    step = LayerStep(shape, seed=args.seed)
    runs = [Run(c, copy.deepcopy(step.model), step) for c in LAYER_CONFIGS[args.checkpointing]]
    repeats = args.repeats if args.repeats_given else max(args.repeats, 30)
    print(f"one decoder layer: {step.shape.describe()}", flush=True)
    times, point = measure(runs, runs[0], plan(step.model, step.shape), LAYER, repeats, args.warmup)
    headline = next(iter(point["modes"].values()))
    compared = point["configs"][1:]
    result = {"mode": "layer", "preset": args.preset, "shape": dataclasses.asdict(step.shape),
              "environment": environment(shape.device), "checkpointing": args.checkpointing, **point,
              "saved_ms_per_layer": headline["saved_ms_per_layer"], "efficiency": headline["efficiency"],
              "grads_equal": all(r["grads_equal"] for r in compared),
              "grad_max_rel_diff": max(r["grad_max_rel_diff"] for r in compared)}
    report.print_measurements(times)
    report.print_rows(result)
    report.write(out, "layer", result)
    return result


def offload_kind(device):
    """The user's offloading the sweep runs under: on CUDA, transformers' own where it has one
    (activation_checkpointing_enable(offload=True): save_on_cpu, pinned, around each checkpoint),
    else save_on_cpu around the forward (harness.offloading; pinned on CUDA)."""
    import inspect
    from transformers import PreTrainedModel
    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    if torch.device(device).type == "cuda" and enable is not None and "offload" in inspect.signature(enable).parameters:
        return "transformers"
    return "save_on_cpu"


def seq_sweep(shape, args, out):
    step = LayerStep(dataclasses.replace(shape, seq=args.seqs[0]), seed=args.seed)
    step.offload = offload_kind(shape.device) if args.offload else None
    configs = LAYER_CONFIGS[args.checkpointing] + ([dataclasses.replace(c, offload=True)
                                                    for c in LAYER_CONFIGS[args.checkpointing] if c.stash]
                                                   if args.offload else [])
    runs = [Run(c, copy.deepcopy(step.model), step) for c in configs]
    fixed = args.repeats if args.repeats_given else None
    budget, points, everything, t0 = args.sweep_seconds, [], [], time.perf_counter()
    print(f"seq-sweep: one decoder layer, {step.shape.describe()}; micro-batch {shape.batch} at every length "
          f"{args.seqs}{f'; every step under the offloading of {step.offload} (--offload)' if args.offload else ''}",
          flush=True)
    for i, seq in enumerate(args.seqs):
        share, start = budget / (len(args.seqs) - i), time.perf_counter()
        for run in runs:
            run.losses.clear()
        try:
            step.set_inputs(dataclasses.replace(shape, seq=seq))
            planned = plan(step.model, step.shape)
            round_start = time.perf_counter()
            interleave(runs, 0, 1, "warm-up")  # one untimed round (cuDNN plans each new shape), timed
            rounds = fixed or max(5, min(30, int(share / max(time.perf_counter() - round_start, 1e-9))))
            times, point = measure(runs, runs[0], planned, LAYER, rounds, 0, column=f"seq {seq}")
        except Exception as e:  # out of memory at the longest length, say: record it and go on
            points.append({"seq": seq, "batch": shape.batch, "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()})
            step.inputs = ()
            if torch.device(shape.device).type == "cuda":
                torch.cuda.empty_cache()
            print(f"  seq {seq}: FAILED ({points[-1]['error'].splitlines()[0][:200]})", flush=True)
            continue
        budget -= min(share, time.perf_counter() - start)
        everything += times.values()
        points.append({"seq": seq, "batch": shape.batch, "tokens": shape.batch * seq, **point,
                       "kept_bytes_measured": {r["checkpointing"]: r["kept_bytes"] for r in point["configs"]
                                               if r["stash_layers"]}, "seconds": time.perf_counter() - start})
        print(f"seq {seq}: {rounds} rounds, {time.perf_counter() - start:.1f} s", flush=True)
        report.print_rows(point)
    result = {"mode": "seq-sweep", "preset": args.preset, "shape": dataclasses.asdict(step.shape),
              "environment": environment(shape.device), "checkpointing": args.checkpointing, "seqs": args.seqs,
              "offload": step.offload,
              "batch": shape.batch, "sweep_seconds": args.sweep_seconds, "rounds_fixed": fixed, "points": points,
              "seconds": time.perf_counter() - t0}
    report.print_measurements(everything)
    print(f"the sweep took {result['seconds']:.1f} s, micro-batch {shape.batch} at every length")
    report.write(out, "seq_sweep", result, report.plot_sweep)
    return result
