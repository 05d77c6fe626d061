"""--mode seq-sweep: what the stash saves and keeps per layer against the sequence length.

At the preset's attention shape (heads, KV heads, head_dim, hidden, dtype) and the preset's
micro-batch, HELD FIXED (4 for qwen3-30b-a3b; --batch changes it), for each sequence length
of --seqs (default 1024,4096,16384,32768): layer mode's measurement (layer_mode.LayerBench:
one decoder layer forward + backward in each configuration of --checkpointing, interleaved
with the attention forward alone; one model, new inputs per length), giving per length
  attention forward ms    median of the attention forward alone at that length
  saved ms per layer      plain - stash under each checkpointing mode (and SAC's saving
                          against plain non-reentrant), efficiency = saved / attention forward
  stash - SAC             time and peak memory
  kept bytes per layer    measured (the stash's peak_bytes in one check step) and predicted
                          (attnstash.backends.kept_bytes for the layer's call)
  peak memory             of each configuration's check step (measure.PeakMemory)

Rounds. One untimed check step per configuration (it warms up the new length: cuDNN builds
its plans per shape), one untimed round that also times a whole round, then as many timed
rounds as fit the length's share of --sweep-seconds (default 60 s for the timed rounds of
the whole sweep; what a short length leaves goes to the longer ones), at least 5 and at most
30 (--repeats fixes the number). A length that fails (out of memory, say) is recorded with
its error and the sweep goes on.

Output under --out: seq_sweep.json and seq_sweep.png (saved ms and kept MB against the
sequence length).
"""
import dataclasses
import time
import traceback

import torch

from . import report as reporting
from .layer_mode import ATTENTION, MODES, LayerBench, config_names, stash_vs_sac, summarise
from .measure import Clock, environment, interleave

DEFAULT_SEQS = "1024,4096,16384,32768"
MIN_ROUNDS, MAX_ROUNDS = 5, 30


def parse_seqs(spec):
    """"1024, 4k,16384" -> [1024, 4096, 16384] (k = 1024), ascending, each at least 1."""
    seqs = []
    for part in (spec or DEFAULT_SEQS).split(","):
        part = part.strip().lower()
        if not part:
            continue
        value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        if value < 1:
            raise ValueError(f"--seqs: {part!r} is not a sequence length")
        seqs.append(value)
    if not seqs:
        raise ValueError("--seqs: no sequence length given")
    return sorted(set(seqs))


def rounds_for(round_seconds, budget_seconds, fixed=None):
    """Timed rounds for one length: `fixed` if given, else as many as fit the budget, between
    MIN_ROUNDS and MAX_ROUNDS."""
    if fixed is not None:
        return fixed
    fit = int(budget_seconds / round_seconds) if round_seconds > 0 else MAX_ROUNDS
    return max(MIN_ROUNDS, min(MAX_ROUNDS, fit))


def sweep_point(bench, shape, clock, budget_seconds, fixed_repeats=None):
    """Layer mode's measurement at one sequence length (bench gets new inputs)."""
    t0 = time.perf_counter()
    bench.set_inputs(shape)
    backend, predicted = bench.sdpa_backend(), bench.predicted_kept_bytes()
    checks = {c.name: bench.check(c, keep_grads=False)[0] for c in bench.configs}
    runners = [bench.runner(c) for c in bench.configs] + [bench.attention_runner(calls=3)]
    t_round = time.perf_counter()
    interleave(runners, clock, 1, 0)  # one untimed round, which times a whole round
    round_seconds = time.perf_counter() - t_round
    repeats = rounds_for(round_seconds, budget_seconds, fixed_repeats)
    interleave(runners, clock, 0, repeats)
    medians = {r.name: r.median_ms for r in runners}
    attn_ms = medians.pop(ATTENTION)
    peaks = {name: checks[name]["peak_bytes"] for name in medians}
    s = bench.shape
    return {
        "seq": s.seq, "batch": s.batch, "tokens": s.batch * s.seq, "sdpa_backend": backend,
        "rounds": {"warmup": 1, "repeats": repeats}, "round_seconds": round_seconds,
        "attention_forward_ms": attn_ms,
        "runs": {r.name: {"times_ms": r.times_ms, "median_ms": r.median_ms} for r in runners},
        "configs": {name: {"median_ms": medians[name], **checks[name]} for name in medians},
        "modes": summarise(medians, attn_ms), "stash_vs_sac": stash_vs_sac(medians, peaks),
        "kept_bytes_measured": {mode: checks[stash]["kept_bytes"] for mode, (_, stash) in MODES.items()
                                if stash in checks},
        "kept_bytes_predicted": predicted,
        "seconds": time.perf_counter() - t0,
    }


def run_seq_sweep(shape, args, out_dir):
    """Layer mode at each sequence length of --seqs, the micro-batch held fixed."""
    seqs = parse_seqs(args.seqs)
    names = config_names(getattr(args, "checkpointing", "both"))
    clock = Clock(shape.device)
    t0 = time.perf_counter()
    bench = LayerBench(dataclasses.replace(shape, seq=seqs[0]), names, seed=args.seed)
    fixed = args.repeats if args.repeats_given else None
    budget = args.sweep_seconds
    print(f"seq-sweep: one decoder layer, {bench.shape.describe()}; micro-batch held at {shape.batch} for every "
          f"sequence length {seqs}; timed rounds: "
          + (f"{fixed} per length" if fixed else f"{budget:g} s for the sweep ({MIN_ROUNDS}-{MAX_ROUNDS} per length)"),
          flush=True)
    points = []
    for i, seq in enumerate(seqs):
        share = budget / (len(seqs) - i)
        start = time.perf_counter()
        try:
            point = sweep_point(bench, dataclasses.replace(shape, seq=seq, layers=1), clock, share, fixed)
        except Exception as e:  # out of memory at the longest length, say: record it and go on
            point = {"seq": seq, "batch": shape.batch, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()}
            for config in bench.configs:
                bench.reset(config)
            if torch.device(shape.device).type == "cuda":
                torch.cuda.empty_cache()
        spent = time.perf_counter() - start
        if "error" not in point:
            budget -= min(share, point["round_seconds"] * point["rounds"]["repeats"])
            print(f"  seq {seq}: {point['rounds']['repeats']} rounds, {spent:.1f} s", flush=True)
        else:
            print(f"  seq {seq}: FAILED ({point['error'].splitlines()[0][:200]})", flush=True)
        points.append(point)
    report = {
        "mode": "seq-sweep", "preset": args.preset, "shape": dataclasses.asdict(bench.shape),
        "environment": environment(bench.shape, torch.get_num_threads()),
        "checkpointing": getattr(args, "checkpointing", "both"), "seqs": seqs,
        "batch": shape.batch, "batch_note": f"micro-batch held at {shape.batch} for every sequence length",
        "sweep_seconds": args.sweep_seconds, "rounds_fixed": fixed, "points": points,
        "seconds": time.perf_counter() - t0,
    }
    reporting.print_sweep_report(report)
    if out_dir is not None:
        reporting.write_json_and_plot(out_dir, "seq_sweep", report, reporting.plot_sweep)
    return report
