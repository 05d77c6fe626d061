"""What the compile tests count, as `bench --mode compile` counts it (benchmarks/compiled.py):
the graphs dynamo hands a backend and their call nodes (Counting), and the fused attention
forwards a step runs (attention_forwards, torch.profiler); and the runs they are counted on
(compiled_run, with_and_without_stash)."""
import contextlib
import sys
from pathlib import Path

import torch

import attnstash

# benchmarks/ is the repository's, not the installed package's: the repository root on sys.path
# makes it importable whatever directory pytest runs from (test_bench*.py import this for that too).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.compiled import Counting, attention_forwards, traceable_checkpoints  # noqa: E402,F401 (the tests' counters)


def bitwise_equal(runs_a, runs_b):
    """Runs of (loss, {name: grad}): every loss and gradient bitwise equal."""
    return len(runs_a) == len(runs_b) and all(
        torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
        for (la, ga), (lb, gb) in zip(runs_a, runs_b))


def compiled_run(use_stash, build, compile_it, backend="aot_eager", steps=2, traceable=True, **install):
    """Training steps of a fresh model, compiled, with the stash installed (install_attention_stash
    with `install`) or not: build() -> (model, step), step(run) -> (loss, {name: grad});
    compile_it(model, counting) -> what to run; under traceable_checkpoints() where `traceable`
    (as `bench --mode compile` runs), else under dynamo's defaults. Returns (runs, the attention
    forwards of the last step, the Counting backend); uninstalls whatever happens."""
    import attnstash
    torch._dynamo.reset()
    model, step = build()
    if use_stash:
        attnstash.install_attention_stash(model, **install)
    try:
        with traceable_checkpoints() if traceable else contextlib.nullcontext():
            counting = Counting(backend)
            run = compile_it(model, counting)
            runs = [step(run) for _ in range(steps - 1)]
            forwards = attention_forwards(lambda: runs.append(step(run)))
    finally:
        if use_stash:
            attnstash.uninstall_attention_stash(model)
    return runs, forwards, counting


def with_and_without_stash(build, compile_it, **kwargs):
    """compiled_run without the stash, then with it."""
    return [compiled_run(use_stash, build, compile_it, **kwargs) for use_stash in (False, True)]
