"""--mode soak: many irregular steps; the stash must be empty after every one.

--steps SGD steps of a tiny model under each checkpointing mode of --checkpointing. Each step
installs the stash on a random number of layers, then runs 1 to 4 micro-batches, each trained,
dropped (a forward whose graph goes without a backward) or no-grad; optionally under a budget
(--max-bytes: the peak must never pass it) and autocast (--amp). After every step the stash holds
0 records and 0 bytes (asserted). RSS per step: the least-squares slope over the second half,
next to what one leaked record per step would add.
"""
import dataclasses
import random
import statistics
import time
import warnings

import torch

import attnstash

from . import report
from .harness import environment
from .models import build_model, enable_checkpointing, plan

COUNTS = ("keeps", "declined", "replays", "misses", "released_unused")


def soak(shape, mode, steps, seed, max_bytes=None):
    """`steps` irregular steps under checkpointing `mode`; that mode's figures."""
    import psutil
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed + 1)
    model = enable_checkpointing(build_model(shape, seed=seed), mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rss, log, peak, start, t0 = [], [], 0, attnstash.stash_stats(), time.perf_counter()
    for step in range(steps):
        stashed = rng.randint(1, shape.layers)
        attnstash.install_attention_stash(model, stashed, max_bytes=max_bytes)  # resets the peak
        kinds, micro = [], rng.randint(1, 4)
        try:
            for _ in range(micro):
                ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(shape.device)
                roll = rng.random()
                kinds.append("no-grad" if roll < 0.1 else "dropped" if roll < 0.35 else "trained")
                with shape.autocast(), torch.set_grad_enabled(kinds[-1] != "no-grad"), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
                    loss = model(input_ids=ids, labels=ids).loss / micro
                if kinds[-1] == "trained":
                    loss.backward()
                del loss  # a dropped forward's graph goes here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            held = attnstash.stash_stats()
        finally:
            attnstash.uninstall_attention_stash(model)
        assert held["records"] == 0 and held["bytes"] == 0, \
            f"soak ({mode}) step {step}: the stash still holds {held['records']} records, {held['bytes']} bytes"
        assert max_bytes is None or held["peak_bytes"] <= max_bytes, \
            f"soak ({mode}) step {step}: the stash held {held['peak_bytes']:,} bytes, over {max_bytes:,}"
        peak = max(peak, held["peak_bytes"])
        rss.append(psutil.Process().memory_info().rss)
        log.append({"step": step, "stashed_layers": stashed, "micro_batches": kinds, "rss": rss[-1]})
    end = attnstash.stash_stats()
    half = rss[len(rss) // 2:]
    slope = statistics.linear_regression(range(len(half)), half).slope if len(half) > 1 else 0.0
    kinds = [k for entry in log for k in entry["micro_batches"]]
    return {"checkpointing": mode, "steps": steps, "seconds": time.perf_counter() - t0,
            "micro_batches": {k: kinds.count(k) for k in ("trained", "dropped", "no-grad")},
            "stash": {**{k: end[k] - start[k] for k in COUNTS}, "peak_bytes": peak, "records_at_end": end["records"],
                      "bytes_at_end": end["bytes"]},
            "rss": {"first": rss[0], "last": rss[-1], "max": max(rss), "second_half_slope_bytes_per_step": slope,
                    "second_half_steps": len(half)}, "log": log}


def soak_mode(shape, args, out):
    if len(args.max_bytes) > 1:
        raise SystemExit("benchmarks: --mode soak takes one --max-bytes budget")
    max_bytes = args.max_bytes[0][1] if args.max_bytes else None
    modes = ("reentrant", "non-reentrant") if args.checkpointing == "both" else (args.checkpointing,)
    runs = {mode: soak(shape, mode, args.steps, args.seed, max_bytes) for mode in modes}
    one_record = plan(build_model(dataclasses.replace(shape, layers=1)), shape).total_bytes
    result = {"mode": "soak", "shape": dataclasses.asdict(shape), "environment": environment(shape.device),
              "steps": args.steps, "max_bytes": max_bytes, "bytes_of_one_kept_record": one_record, "runs": runs}
    print(f"soak: {args.steps} steps under each of {', '.join(runs)} checkpointing; {shape.describe()}"
          + (f"; budget {max_bytes:,} bytes (never passed, asserted)" if max_bytes is not None else ""))
    print(report.table(runs.values(), [
        ("checkpointing", lambda r: r["checkpointing"]), ("seconds", lambda r: f"{r['seconds']:.1f}"),
        *[(k, lambda r, k=k: r["stash"][k]) for k in COUNTS], ("peak bytes", lambda r: f"{r['stash']['peak_bytes']:,}"),
        ("held after every step", lambda r: "0 records, 0 bytes (asserted)"),
        ("RSS slope, 2nd half", lambda r: f"{r['rss']['second_half_slope_bytes_per_step'] / 1e3:+.2f} kB/step")]))
    print(f"one leaked record per step would add {one_record / 1e3:.1f} kB/step")
    report.write(out, "soak", result)
    return result
