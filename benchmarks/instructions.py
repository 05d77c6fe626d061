"""--mode instructions: the host work the stash adds per stashed layer and step, counted in
instructions by callgrind (deterministic: the same count whatever else the machine does), for
attnstash and for the seed pull request's design (seed_design.py), and timed beside them.

A tiny Qwen3 decoder (4 layers, hidden 64, 4 query / 2 KV heads of 16, batch 1 x sequence 16,
fp32, CPU, one thread) where attention itself costs little, trained with reentrant checkpointing
(the seed's design serves no other) and, for attnstash, non-reentrant; attnstash both through
transformers' checkpoint function ("attnstash") and through a module call ("modulecall": the
same layers in a plain loop that checkpoints each, dit.PlainDecoder, as diffusers and plain
PyTorch models reach the stash). Each configuration runs in
its own process under `valgrind --tool=callgrind` (addresses fixed: setarch -R, hash seed 0),
once for `warmup + a` and once for
`warmup + b` steps, the collector's state frozen after the warm-up (run_steps): the difference
over b - a steps is one step's instructions, start-up and warm-up cancelled. Per stashed layer: (the stash on every layer - on 0 layers) / layers, where
"0 layers" is each design installed with nothing to keep (attnstash: installed on a decoy model;
the seed: its wrapper of the "sdpa" entry). The plain step (no install) is counted too: each
configuration against it is what its install costs in all, the wrapper's passes on the path
where nothing is kept included (attnstash's kernel on aten::scaled_dot_product_attention is on
the op in every configuration, the plain step's included: attnstash is imported). So is what the seed's
design skips by replacing transformers' attention entry (run_entry), and what one layer's ops
cost with no other record held and with 256 held (run_held: the registry's work per record held).
Losses and gradients of every
configuration are checked bitwise against the plain run's in one process first.

    python -m benchmarks --mode instructions            (about 40 minutes on 2 cores)
"""
import concurrent.futures
import functools
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnstash

from . import report

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("attnstash-0", "attnstash-all", "modulecall-0", "modulecall-all", "seed-0", "seed-all")
DESIGNS = ("attnstash", "modulecall", "seed")
LAYERS = 4


def configs(mode):
    """The configurations measured under checkpointing `mode` (the seed's design: reentrant only)."""
    return [c for c in CONFIGS if mode == "reentrant" or not c.startswith("seed")]


def build(config, mode):
    """(model, step, undo) for one configuration: the stash as it says, checkpointing `mode`;
    undo() removes what it installed."""
    from .dit import Block, PlainDecoder
    from .harness import decoy
    from .models import build_model, enable_checkpointing, make_shape, random_batch
    from .seed_design import SeedStash
    shape = make_shape("tiny", layers=LAYERS, hidden=64, heads=4, kv_heads=2, head_dim=16, seq=16, batch=1)
    design, _, layers = config.partition("-")
    model = build_model(shape)
    if design == "modulecall":
        model = PlainDecoder(model)
    enable_checkpointing(model, mode)
    undo = lambda: None  # noqa: E731
    if design in ("attnstash", "modulecall"):
        # 0 layers: an install elsewhere, nothing of this model (each design on a decoy of its own)
        stashed = model if layers == "all" else decoy(design)
        attnstash.install_attention_stash(stashed, None if layers == "all" else 1,
                                          layers=Block if design == "modulecall" and layers == "all" else None)
        undo = functools.partial(attnstash.uninstall_attention_stash, stashed)
    elif design == "seed":
        undo = SeedStash(model, None if layers == "all" else 0).uninstall
    ids = random_batch(shape)

    def step():
        loss = model(ids) if design == "modulecall" else model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()
    return model, step, undo


def run_steps(config, mode, warmup, steps):
    """warmup steps, then `steps` from the same collector state: every object made so far
    collected or frozen (gc.freeze), so that where the cyclic collector runs inside the measured
    steps depends on their own allocations alone, not on what start-up and install left."""
    torch.set_num_threads(1)
    _, step, _ = build(config, mode)
    for _ in range(warmup):
        step()
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        step()


def check(mode):
    """Loss and every gradient of each configuration bitwise the plain run's (one process; the
    module call's against its own model on 0 layers, which keeps nothing of it)."""
    results = {}
    for config in ["plain", *configs(mode)]:
        model, step, undo = build(config, mode)
        before = attnstash.stash_stats()["replays"]
        loss = step()
        undo()
        results[config] = (loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert attnstash.stash_stats()["records"] == 0, f"{config}: the stash holds records after a step"
        replays, wanted = attnstash.stash_stats()["replays"] - before, LAYERS if config.endswith("-all") else 0
        if not config.startswith("seed") and replays != wanted:
            raise SystemExit(f"benchmarks: {config} ({mode}) replayed {replays} attention calls in a step, not {wanted}")
    for config, (other_loss, other_grads) in results.items():
        reference = "modulecall-0" if config.startswith("modulecall") else "plain"
        if config == reference:
            continue
        loss, grads = results[reference]
        same = (torch.equal(loss, other_loss) and grads.keys() == other_grads.keys()
                and all(torch.equal(grads[n], other_grads[n]) for n in grads))
        if not same:
            raise SystemExit(f"benchmarks: {config} ({mode}) does not give the plain run's loss and gradients bitwise")


ENTRY_CONFIGS = ("entry", "bare")


def run_entry(config, warmup, steps):
    """What the seed's design skips that attnstash runs: transformers' attention entry
    (`sdpa_attention_forward`) around F.sdpa, which the seed's design replaces in the layers it
    stashes and attnstash, reached through F.sdpa inside it, leaves to run. A step here is one
    stashed layer's two passes as a reentrant checkpoint makes them (the first forward without
    grad, the recompute with), on the decoder's own attention module and arguments; F.sdpa is a
    stand-in that returns a ready output. "entry": the entry's calls; "bare": what the seed's
    wrapper does in their place after its attention (the output transposed, made contiguous)."""
    import torch.nn.functional as F
    from transformers.integrations import sdpa_attention
    torch.set_num_threads(1)
    model, _, _ = build("plain", "reentrant")
    attention = model.model.layers[0].self_attn
    shape = (1, attention.config.num_attention_heads, 16, attention.head_dim)
    kv = (1, attention.config.num_key_value_heads, 16, attention.head_dim)
    query, key, value = (torch.randn(s, requires_grad=True) * 1 for s in (shape, kv, kv))
    ready = torch.randn(shape, requires_grad=True) * 1
    called = []

    def stand_in(*args, **kwargs):
        called.append(1)
        return ready
    F.scaled_dot_product_attention = stand_in  # (this process only)

    def entry():
        return sdpa_attention.sdpa_attention_forward(attention, query, key, value, None, dropout=0.0,
                                                     scaling=attention.scaling, sliding_window=None,
                                                     position_ids=None, use_cache=False)

    def bare():
        return ready.transpose(1, 2).contiguous(), None
    call = entry if config == "entry" else bare

    def step():
        with torch.no_grad():
            call()
        call()
    for _ in range(warmup):
        step()
    if config == "entry" and len(called) != 2 * warmup:
        raise SystemExit("benchmarks: transformers' sdpa_attention_forward did not call "
                         "torch.nn.functional.scaled_dot_product_attention once a pass: run_entry would not measure it")
    gc.collect()
    gc.freeze()  # as run_steps
    for _ in range(steps):
        step()


HELD = 256
HELD_CONFIGS = ("held-0", f"held-{HELD}")


def run_held(config, warmup, steps):
    """What one stashed layer's ops cost as the records of other layers grow (`held-N`: N
    records held, as N layers' first forwards awaiting their recompute would hold them). A step
    is one layer's reentrant checkpoint on the ops alone: its keep on a fresh token, its
    recompute's replay, the token freed with the graph (which releases what is left under it)."""
    from torch.utils.checkpoint import checkpoint

    from attnstash import ops
    KEEP = torch.ops.attnstash.sdpa_fwd_keep.default._op  # (the op's binding, positionally)
    torch.set_num_threads(1)
    x = torch.randn(1, 2, 16, 16, requires_grad=True)
    held = [ops.new_token() for _ in range(int(config.partition("-")[2]))]
    with torch.no_grad():
        for token in held:
            KEEP(x, x, x, token, 0, None, 0.0, False, None, False)

    def layer(x, token):
        return KEEP(x, x, x, token, 0, None, 0.0, False, None, False)

    def step():
        checkpoint(layer, x, ops.NEW_TOKEN(), use_reentrant=True).sum().backward()
    for _ in range(warmup):
        step()
    stats = attnstash.stash_stats()
    if stats["records"] != len(held) or stats["replays"] != warmup:
        raise SystemExit(f"benchmarks: run_held's step did not keep and replay once, leaving {len(held)} records "
                         f"held: {stats}")
    gc.collect()
    gc.freeze()  # as run_steps
    for _ in range(steps):
        step()


def count(config, kind, warmup, steps):
    """Instructions of one process running `warmup` then `steps` steps (callgrind's total); `kind`
    a checkpointing mode (run_steps), "entry" (run_entry) or "held" (run_held)."""
    with tempfile.TemporaryDirectory() as out:
        log = Path(out) / "callgrind.out"
        # Addresses fixed (no ASLR): dicts and the registry hash pointers, which would move the counts.
        fixed = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
        cmd = [*fixed, "valgrind", "--tool=callgrind", f"--callgrind-out-file={log}", sys.executable, "-m",
               "benchmarks.instructions", "--run", config, kind, str(warmup), str(steps)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
                                   "PYTHONPATH": str(ROOT)})
        totals = re.findall(r"^(?:summary|totals): (\d+)", log.read_text() if log.exists() else "", re.M)
        if done.returncode or not totals:
            raise SystemExit(f"benchmarks: callgrind failed for {config} ({kind}):\n{done.stderr[-2000:]}")
        return int(totals[-1])


def timed(mode, rounds):
    """Host time per step (time.thread_time, us) of each configuration, interleaved, medians. In
    one process, so F.sdpa reaches attnstash's kernel on the op in every configuration (outside
    stashed layers it passes the call to torch's own, at a cost below what host mode resolves),
    and seed-0's attention passes seed-all's wrapper too: in the seed's favour."""
    torch.set_num_threads(1)
    built = {c: build(c, mode) for c in configs(mode)}
    steps = {c: step for c, (_, step, _) in built.items()}
    times = {c: [] for c in steps}
    for _ in range(10):
        for s in steps.values():
            s()
    for _ in range(rounds):
        for c, s in steps.items():
            t = time.thread_time()
            s()
            times[c].append(time.thread_time() - t)
    for _, _, undo in reversed(built.values()):
        undo()
    return {c: sorted(t)[len(t) // 2] * 1e6 for c, t in times.items()}


def instructions_mode(shape, args, out):
    if shutil.which("valgrind") is None:
        raise SystemExit("benchmarks: --mode instructions needs valgrind (Debian: apt-get install valgrind)")
    warmup, a, b = 3, 2, 22
    result = {"mode": "instructions", "layers": LAYERS, "steps": {"warmup": warmup, "a": a, "b": b},
              "per_step": {}, "per_stashed_layer": {}, "against_plain": {}, "time_per_step_us": {},
              "entry_skipped_by_seed": None, "held": None}
    kinds = {"reentrant": ("plain", *configs("reentrant")), "non-reentrant": ("plain", *configs("non-reentrant")),
             "entry": ENTRY_CONFIGS, "held": HELD_CONFIGS}
    jobs = [(config, kind, n) for kind, names in kinds.items() for config in names for n in (a, b)]
    for mode in ("reentrant", "non-reentrant"):
        check(mode)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # a process each
        counts = dict(zip(jobs, pool.map(lambda job: count(job[0], job[1], warmup, job[2]), jobs)))
    entry = {config: (counts[config, "entry", b] - counts[config, "entry", a]) / (b - a) for config in ENTRY_CONFIGS}
    result["entry_skipped_by_seed"] = entry["entry"] - entry["bare"]
    held = {config: (counts[config, "held", b] - counts[config, "held", a]) / (b - a) for config in HELD_CONFIGS}
    result["held"] = {"records": HELD, "per_step": held,
                      "per_held_record": (held[HELD_CONFIGS[1]] - held[HELD_CONFIGS[0]]) / HELD}
    for mode in ("reentrant", "non-reentrant"):
        per_step = {config: (counts[config, m, b] - counts[config, m, a]) / (b - a)
                    for config, m, _ in jobs if m == mode}
        for config, n in per_step.items():
            print(f"{mode}, {config}: {n:,.0f} instructions a step", flush=True)
        result["per_step"][mode] = per_step
        result["per_stashed_layer"][mode] = {
            design: (per_step[f"{design}-all"] - per_step[f"{design}-0"]) / LAYERS
            for design in DESIGNS if f"{design}-all" in per_step}
        result["against_plain"][mode] = {  # what each install costs where it keeps nothing, and in all
            f"{design}-{layers}": per_step[f"{design}-{layers}"] - per_step["plain"]
            for design in ("attnstash", "seed") for layers in ("0", "all") if f"{design}-all" in per_step}
        # (the module call's steps are another model's: they are compared with its own 0 layers only)
        result["time_per_step_us"][mode] = timed(mode, args.repeats)
    print("\nper stashed layer and step (instructions; host time, us, from the interleaved medians):")
    for mode, designs in result["per_stashed_layer"].items():
        us = result["time_per_step_us"][mode]
        for design, n in designs.items():
            t = (us[f"{design}-all"] - us[f"{design}-0"]) / LAYERS
            print(f"  {mode:>13}, {design:>10}: {n:>12,.0f} instructions, {t:+8.1f} us")
    print(f"\ntransformers' attention entry around F.sdpa, which the seed's design replaces and attnstash runs "
          f"(run_entry): {result['entry_skipped_by_seed']:,.0f} instructions a stashed layer and step")
    print(f"\none layer's keep, replay and token on the ops alone (run_held): {held[HELD_CONFIGS[0]]:,.0f} "
          f"instructions with no other record held, {held[HELD_CONFIGS[1]]:,.0f} with {HELD} held "
          f"({result['held']['per_held_record']:+,.1f} a record held)")
    print("\neach configuration against the plain step (no install), instructions a step:")
    for mode, rows in result["against_plain"].items():
        for config, n in rows.items():
            print(f"  {mode:>13}, {config:>13}: {n:>+12,.0f}")
    report.write(out, "instructions", result)
    return result


if __name__ == "__main__" and sys.argv[1:2] == ["--run"]:
    runner = {"entry": run_entry, "held": run_held}.get(sys.argv[3])
    (runner(sys.argv[2], int(sys.argv[4]), int(sys.argv[5])) if runner else
     run_steps(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
