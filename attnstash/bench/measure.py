"""The measurement harness: how the benchmark and the demo time, count memory and compare.

Step time. CPU: time.perf_counter around the call. CUDA: CUDA events around it, read after
synchronising. Python's garbage collector collects its young generations before, and is
off during, each timed call (collector_paused): a collection inside a step would be charged
to whichever configuration happened to trigger it.

Interleaving. Things compared run in one process and INTERLEAVED (interleave): every round
runs each of them once, the order rotates from round to round (so none always runs first,
after the same neighbour, or on a cold cache), the warm-up rounds are dropped, and medians
are reported. Each Runner's setup() and teardown() (installing and removing the stash, say)
run around its turn, outside the clock.

Peak memory (PeakMemory): bytes of live tensors at the block's peak, above what was live
when it began (so the weights of all model copies are excluded, gradients that the block
creates included: callers set them to None first).
    CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
    memory_allocated() at the start.
    CPU: PyTorch's profiler with profile_memory=True records every allocation and free of
    the CPU allocator with its size and time; the maximum of their running sum is the peak.
    It is exact and repeatable (the same number on every run), which process RSS is not:
    glibc keeps freed blocks, other threads allocate, and RSS never shows a transient peak
    that was given back. Counting tensors saved for backward with saved_tensors_hooks is
    not an option: it misses every temporary, and such hooks change what the stash does
    (they mark a non-reentrant checkpoint's first forward). The profiled step is a
    separate, untimed one: the profiler slows what it watches.

Equality. Losses and gradients are compared bitwise (torch.equal), with the largest
difference reported next to them (grad_difference: relative to the largest gradient), and
next to a noise floor: the same comparison between two runs of the baseline (on CUDA
cuDNN's dQ is not deterministic, so no two runs agree bitwise there).

CPU threads: cpu_threads(n) runs a block with n intra-op threads (on a small shared machine
more threads make timings erratic).
"""
import contextlib
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time

import torch

import attnstash


class Clock:
    """Times a call in milliseconds: CUDA events on a CUDA device (read after synchronising),
    time.perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def time(self, fn):
        """(fn(), milliseconds)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end)
        t0 = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def collector_paused():
    """Collect the young generations now (a full collection takes a quarter of a second with
    transformers loaded) and keep the collector from running inside a timed region."""
    gc.collect(1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _stderr_silenced():
    """Hide what the profiler's native start/stop print on stderr (file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then m.bytes: the peak of live tensor bytes in the
    block above what was live when it began (None if this torch cannot say). CUDA: the
    caching allocator's counters. CPU: the allocation events of PyTorch's profiler (see the
    module docstring)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _stderr_silenced():
                self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start
            return False
        with _stderr_silenced():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.bytes = cpu_peak_from_profile(self._prof)
        return False


def cpu_peak_from_profile(prof):
    """The maximum running sum of the CPU allocations (+size) and frees (-size) the profiler
    recorded, in time order; None if this torch's profiler does not expose them."""
    try:
        from torch._C._profiler import _EventType
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
    except (AttributeError, ImportError, RuntimeError):
        return None
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def cpu_threads(n):
    """Run with n intra-op threads on CPU (0: leave torch's setting), restoring it after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


# ---- interleaved timing ---------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """One thing to time: setup() and teardown() run around its turn in a round, outside the
    clock; step() is timed `calls` times a turn."""
    name: str
    step: object
    setup: object = None
    teardown: object = None
    calls: int = 1
    times_ms: list = dataclasses.field(default_factory=list)

    @property
    def median_ms(self):
        return statistics.median(self.times_ms) if self.times_ms else float("nan")


def interleave(runners, clock, warmup, repeats, progress=None):
    """warmup + repeats rounds; each runs every runner once, starting one further along the
    list each round. Times of the warm-up rounds are dropped."""
    for r in range(warmup + repeats):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            if runner.setup:
                runner.setup()
            try:
                for _ in range(runner.calls):
                    with collector_paused():
                        _, ms = clock.time(runner.step)
                    if r >= warmup:
                        runner.times_ms.append(ms)
            finally:
                if runner.teardown:
                    runner.teardown()
        if progress is not None:
            progress.update(1)


def progress(total, desc, unit="round"):
    """A tqdm bar on stderr, or None without tqdm."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
    except ImportError:
        return None


# ---- comparisons ----------------------------------------------------------------------------

def grad_difference(grads, reference):
    """(bitwise equal, max |g - g_ref| / max |g_ref|) over all parameters."""
    equal, worst, scale = True, 0.0, 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            equal = equal and g is None and r is None
            continue
        equal = equal and torch.equal(g, r)
        worst = max(worst, (g.float() - r.float()).abs().max().item())
        scale = max(scale, r.float().abs().max().item())
    return equal, (worst / scale if scale else worst)


def loss_difference(losses, reference):
    """(bitwise equal, max |loss - reference|) over paired lists of 0-dim loss tensors."""
    equal = len(losses) == len(reference) and all(torch.equal(a, b) for a, b in zip(losses, reference))
    worst = max(((a.float() - b.float()).abs().item() for a, b in zip(losses, reference)), default=0.0)
    return equal, worst


def slope(values):
    """Least-squares slope of values against their index (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def environment(shape, threads):
    """Versions, device and thread count, for the reports."""
    import transformers
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "attnstash": attnstash.__version__,
             "device": shape.device, "cpu threads": threads}
    if torch.device(shape.device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["cudnn"] = torch.backends.cudnn.version()
    else:
        facts["cpu"] = platform.processor() or platform.machine()
    return facts
