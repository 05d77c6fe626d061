"""What the compile tests count, as `bench --mode compile` counts it (attnstash/bench/compiled.py):
the graphs dynamo hands a backend and their call nodes (Counting), and the fused attention
forwards a step runs (attention_forwards, torch.profiler)."""
import torch

from attnstash.bench.compiled import Counting, attention_forwards  # noqa: F401 (the tests' counters)


def bitwise_equal(runs_a, runs_b):
    """Runs of (loss, {name: grad}): every loss and gradient bitwise equal."""
    return len(runs_a) == len(runs_b) and all(
        torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
        for (la, ga), (lb, gb) in zip(runs_a, runs_b))
