"""--mode soak: many irregular steps; the stash must be empty after every one.

A few hundred optimizer steps of a tiny model (preset "tiny") under each checkpointing mode
(--checkpointing reentrant, non-reentrant or both, the default; a fresh model for each).
Every step: the number of stashed layers is drawn anew (uninstall + install), then 1 to 4
micro-batches, each one of
    trained     forward + backward (the loss scaled by the micro-batch count)
    dropped     a forward whose graph is dropped without a backward (its records must go
                with the graph)
    no-grad     an evaluation forward under torch.no_grad (keeps nothing)
and an SGD step. Optionally under a budget (--max-bytes: keeps past it are declined, and
the stash's peak_bytes must never pass it) and under autocast (--amp).

After every step the stash must hold 0 entries and 0 bytes (asserted), under either mode.
Process RSS (psutil) is recorded per step: first, last, maximum, and the least-squares
slope over the second half (bytes/step), next to what one leaked entry per step would add.
"""
import dataclasses
import random
import time
import warnings

import torch

import attnstash
from attnstash import budget, ops

from . import report as reporting
from .measure import environment, progress, slope
from .models import build_model, enable_checkpointing, kept_bytes_per_layer

MODES = ("reentrant", "non-reentrant")


def soak_one_mode(shape, mode, steps, seed, max_bytes=None):
    """`steps` irregular steps under checkpointing `mode`; returns that mode's report."""
    import psutil

    rng = random.Random(seed)
    model = enable_checkpointing(build_model(shape, seed=seed), mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    process = psutil.Process()
    g = torch.Generator().manual_seed(seed + 1)
    rss, log = [], []
    budget_before = budget.stash_max_bytes()
    if max_bytes is not None:
        budget.stash_set_max_bytes(max_bytes)
    ops.stash_reset_peak()
    start = attnstash.stash_stats()
    stashed = 0
    bar = progress(steps, f"soak steps ({mode})", unit="step")
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            if stashed:
                attnstash.uninstall_attention_stash(model)
                stashed = 0
            stashed = rng.randint(1, shape.layers)
            attnstash.install_attention_stash(model, stashed)
            micro = rng.randint(1, 4)
            kinds = []
            for _ in range(micro):
                ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(shape.device)
                roll = rng.random()
                if roll < 0.1:  # an evaluation forward: keeps nothing
                    with torch.no_grad(), shape.autocast(), warnings.catch_warnings():
                        # reentrant checkpointing warns that no input requires grad: true, and meant
                        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
                        model(input_ids=ids, labels=ids)
                    kinds.append("no-grad")
                elif roll < 0.35:  # a forward whose graph is dropped without a backward
                    with shape.autocast():
                        model(input_ids=ids, labels=ids)  # the graph is dropped at once
                    kinds.append("dropped")
                else:
                    with shape.autocast():
                        loss = model(input_ids=ids, labels=ids).loss / micro
                    loss.backward()
                    del loss
                    kinds.append("trained")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            held = attnstash.stash_stats()
            assert held["entries"] == 0 and held["bytes"] == 0, \
                f"soak ({mode}) step {step}: the stash still holds {held['entries']} entries, {held['bytes']} bytes"
            if max_bytes is not None:
                assert held["peak_bytes"] <= max_bytes, \
                    f"soak ({mode}) step {step}: the stash held {held['peak_bytes']:,} bytes, over {max_bytes:,}"
            rss.append(process.memory_info().rss)
            log.append({"step": step, "stashed_layers": stashed, "micro_batches": kinds, "rss": rss[-1]})
            if bar is not None:
                bar.update(1)
    finally:
        if stashed:
            attnstash.uninstall_attention_stash(model)
        budget.stash_set_max_bytes(budget_before)
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    end = attnstash.stash_stats()
    counts = {k: end[k] - start[k] for k in ("keeps", "declined", "replays", "misses", "released_unused")}
    half = rss[len(rss) // 2:]
    kinds = [k for entry in log for k in entry["micro_batches"]]
    return {
        "checkpointing": mode, "steps": steps, "seconds": seconds,
        "micro_batches": {k: kinds.count(k) for k in ("trained", "dropped", "no-grad")},
        "stash": {**counts, "peak_bytes": end["peak_bytes"], "entries_at_end": end["entries"],
                  "bytes_at_end": end["bytes"]},
        "rss": {"first": rss[0], "last": rss[-1], "max": max(rss), "second_half_slope_bytes_per_step": slope(half),
                "second_half_steps": len(half)},
        "log": log,
    }


def run_soak(shape, args, out_dir):
    """The soak under each checkpointing mode asked for; the stash must be empty after each step."""
    modes = MODES if args.checkpointing == "both" else (args.checkpointing,)
    limits = [budget.parse_bytes(p.strip()) for p in (args.max_bytes or "").split(",") if p.strip()]
    if len(limits) > 1:
        raise SystemExit("attnstash.bench: --mode soak takes one --max-bytes budget")
    max_bytes = limits[0] if limits else None
    runs = {mode: soak_one_mode(shape, mode, args.steps, args.seed, max_bytes) for mode in modes}
    one_entry, _ = kept_bytes_per_layer(shape)
    report = {
        "mode": "soak", "shape": dataclasses.asdict(shape), "environment": environment(shape, torch.get_num_threads()),
        "steps": args.steps, "max_bytes": max_bytes, "bytes_of_one_kept_entry": one_entry, "runs": runs,
    }
    reporting.print_soak_report(report, shape.describe())
    if out_dir is not None:
        reporting.write_json(out_dir / "soak.json", report)
        print(f"wrote {out_dir / 'soak.json'}")
    return report
