"""What every mode shares: the configuration type, a configuration's run, the check, the
interleaved timing, peak memory.

Config names a configuration (checkpointing, the stash's layers, a budget) for every table, JSON
file and plot. Run: a Config on its own deep copy of the model (bitwise the same weights) and a
subject: subject.forward(model) -> a scalar loss; subject.inputs, whose gradients count too;
subject.layers (install's layers=), subject.device, subject.amp.

check: one untimed step per run: peak memory, what the stash kept and did, what each layer held
after the forward, the loss and every gradient compared bitwise with plain checkpointing of its
mode (else the reference run); the reference runs twice (its entry is the noise floor: cuDNN's dQ
is not deterministic).

interleave: every round runs each configuration once, the order rotating from round to round,
install and uninstall around each turn outside the clock, the garbage collector paused, warm-up
rounds dropped; the times are torch.utils.benchmark Measurements (median, IQR, variance
warnings; Compare prints them), taken with torch.utils.benchmark.timer (it synchronises the
accelerator). Timer itself times only the attention forward alone: Timer.timeit runs at least 2
untimed calls before its timed ones (blocked_autorange 1), which would double or triple a turn.

peak_bytes: live tensor bytes at the peak above the start. CUDA: the caching allocator's peak.
CPU: the maximum running sum of the allocations and frees torch.profiler (profile_memory=True)
records, in time order: exact and repeatable, where process RSS is neither (glibc keeps freed
blocks; a transient peak never shows).
"""
import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import platform
import sys
from typing import Optional

import torch
from torch.utils import benchmark

import attnstash

from .models import attention_forward, autocast, describe_call, enable_checkpointing

ATTENTION = "attention forward alone"


@dataclasses.dataclass(frozen=True)
class Config:
    """checkpointing: "none", "reentrant", "non-reentrant" or "sac"; stash: None (no stash), k
    (the last k attention layers), 0 (installed on another model only: transformers' layer class
    carries the checkpoint function's stand-in, this model has no stash); budget: a max_bytes as written ("2.2MB"); offload: the
    stash's own offload (install_attention_stash(offload=True))."""
    checkpointing: str
    stash: Optional[int] = None
    budget: Optional[str] = None
    offload: bool = False

    @property
    def name(self):
        base = {"none": "no checkpointing", "sac": "SAC (non-reentrant)"}.get(self.checkpointing, self.checkpointing)
        if self.stash == 0:
            return f"{base}, stash on 0 layers"
        if self.stash:
            return f"{base} + stash {self.stash}" + (f", budget {self.budget}" if self.budget else "") + \
                (", offload" if self.offload else "")
        return base

    @property
    def max_bytes(self):
        return attnstash.parse_bytes(self.budget)

    @property
    def plain(self):
        """What this configuration's saving is measured against: plain checkpointing of its mode
        (SAC's is non-reentrant); None for plain checkpointing and none."""
        if self.checkpointing == "sac":
            return Config("non-reentrant")
        return Config(self.checkpointing) if self.stash is not None else None


@functools.lru_cache(maxsize=None)
def decoy(owner=""):
    """A tiny Qwen3 model that stash-on-0-layers configurations install the stash on: one per
    `owner`, for configurations that are installed at once."""
    from .models import build_model, make_shape
    return build_model(make_shape("tiny", layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, vocab=16, seq=8,
                                  device="cpu", dtype="fp32"))


class Run:
    """A Config on its own copy of the model (see the module docstring)."""

    def __init__(self, config, model, subject, tag=""):
        self.config, self.subject, self.tag = config, subject, tag
        self.model = enable_checkpointing(model, config.checkpointing,
                                          offload=getattr(subject, "offload", None) == "transformers")
        self.losses = []

    def name_of(self, config):
        """A configuration's name among runs of this one's tag (several models in one table)."""
        return self.tag + config.name

    @property
    def name(self):
        return self.name_of(self.config)

    def enter(self):
        for t in [*self.model.parameters(), *self.subject.inputs]:
            t.grad = None
        c = self.config
        if c.stash == 0:
            attnstash.install_attention_stash(decoy(), 1)
        elif c.stash:
            attnstash.install_attention_stash(self.model, c.stash, layers=self.subject.layers, max_bytes=c.max_bytes,
                                              offload=c.offload)

    def exit(self):
        c = self.config
        if c.stash == 0:
            attnstash.uninstall_attention_stash(decoy())
        elif c.stash:
            peak = attnstash.stash_stats()["peak_bytes"]  # since the install
            attnstash.uninstall_attention_stash(self.model)
            if c.budget is not None and peak > c.max_bytes:
                raise AssertionError(f"{c.name}: the stash held {peak:,} bytes, over its budget of {c.max_bytes:,}")

    def step(self, after_forward=None, mark=lambda name: contextlib.nullcontext()):
        """Forward (under the subject's autocast) and backward; returns the loss, detached."""
        with mark("bench:forward"), autocast(self.subject.device, self.subject.amp), offloading(self.subject):
            loss = self.subject.forward(self.model)
        if after_forward is not None:
            after_forward()
        with mark("bench:backward"):
            loss.backward()
        self.losses.append(loss.detach())
        return self.losses[-1]

    def grads(self):
        return [t.grad for t in [*self.model.parameters(), *self.subject.inputs]]


def offloading(subject):
    """The user's activation offloading around the forward where the subject asks for it
    (seq-sweep --offload without transformers' own: decoder.offload_kind): save_on_cpu, pinned
    on CUDA."""
    if getattr(subject, "offload", None) != "save_on_cpu":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.device(subject.device).type == "cuda")


def difference(grads, reference):
    """(bitwise equal, max |g - r| / max |r|) over paired gradients."""
    equal, worst, scale = True, 0.0, 0.0
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            equal = equal and g is None and r is None
            continue
        equal = equal and torch.equal(g, r)
        worst = max(worst, (g.float() - r.float()).abs().max().item())
        scale = max(scale, r.float().abs().max().item())
    return equal, (worst / scale if scale else worst)


def check(runs, reference):
    """{name: the check step's figures} for every run (see the module docstring). Each is compared
    with plain checkpointing of its mode (config.plain) where that ran, else with the reference;
    the reference's own entry compares its second step with its first (the noise floor)."""
    results, baselines = {}, {}
    for run in [reference, *sorted(runs, key=lambda r: r.config.plain is not None)]:  # baselines first
        run.enter()
        try:
            attnstash.stash_reset_peak()
            before, during = attnstash.stash_stats(), {}
            with collector_paused():
                loss, peak = peak_bytes(run.subject.device, lambda: run.step(
                    lambda: during.update(layers=attnstash.layer_stash_stats(run.model),
                                          moved=attnstash.stash_stats()["moved_bytes"])))
            after = attnstash.stash_stats()
            grads = [g.detach().clone() if g is not None else None for g in run.grads()]
        finally:
            run.exit()
        if not baselines:
            baselines[run.name] = loss, grads
            continue
        against = run.name_of(run.config.plain) if run.config.plain else None
        against = against if against in baselines else reference.name
        equal, worst = difference(grads, baselines[against][1])
        results[run.name] = {
            "loss": loss.item(), "loss_equal": torch.equal(loss, baselines[against][0]), "grads_equal": equal,
            "grad_max_rel_diff": worst, "compared_with": against, "peak_bytes": peak,
            "kept_bytes": after["peak_bytes"],
            "held_after_step": {"records": after["records"], "bytes": after["bytes"]},
            "held_after_forward": {str(i): list(h) for i, h in during["layers"].items()},
            "moved_bytes_after_forward": during["moved"],
            **{k: after[k] - before[k] for k in ("keeps", "declined", "replays", "misses", "offload_waits")}}
        if run.config.plain is None:
            baselines.setdefault(run.name, (loss, grads))
        del grads
    return {run.name: results[run.name] for run in runs}


def losses_equal(runs):
    """Whether every step of every run (check steps and timed ones) had bitwise the same loss."""
    losses = [loss for run in runs for loss in run.losses]
    return all(torch.equal(loss, losses[0]) for loss in losses)


def _turn(run, clock, untimed):
    run.enter()
    try:
        for _ in range(untimed):
            run.step()
        with collector_paused():
            start = clock()
            run.step()
            return clock() - start
    finally:
        run.exit()


def interleave(runs, rounds, warmup, label, column="step", attention=None, calls=3, clock=benchmark.timer,
               untimed=0):
    """{name: torch.utils.benchmark.Measurement} of each run's steps over `rounds` interleaved
    rounds after `warmup` (see the module docstring); with `attention` (a function), the attention
    forward alone too (Timer.timeit(calls) a round), under ATTENTION. clock: wall time
    (benchmark.timer), or time.thread_time for the host's CPU time alone; untimed: steps each turn
    runs before its timed one (so that no set-up, an install say, leaves it a cold cache)."""
    threads = torch.get_num_threads()
    turns = [(run.name, functools.partial(_turn, run, clock, untimed)) for run in runs]
    if attention is not None:
        timer = benchmark.Timer("attention()", globals={"attention": attention}, label=label, sub_label=ATTENTION,
                                description=column, num_threads=threads, timer=clock)
        turns.append((ATTENTION, lambda: timer.timeit(calls)))
    taken = {name: [] for name, _ in turns}
    for r in range(warmup + rounds):
        for name, turn in turns[r % len(turns):] + turns[:r % len(turns)]:
            result = turn()
            if r >= warmup:
                taken[name].append(result)
    return {name: (benchmark.Measurement.merge(got)[0] if name == ATTENTION else benchmark.Measurement(
        1, got, benchmark.TaskSpec(name, "", label=label, sub_label=name, description=column, num_threads=threads)))
        for name, got in taken.items() if got}


def median_ms(measurement):
    return measurement.median * 1e3


def predicted_bytes(plan, config):
    """What the planner says the stash keeps for `config`: the last k attention layers' bytes,
    k cut to what the budget holds (attnstash.plan's layers_within)."""
    k = config.stash or 0
    if config.budget is not None:
        k = min(k, plan.layers_within(config.max_bytes))
    return sum(layer.bytes or 0 for layer in plan.layers[len(plan.layers) - k:]) if k else 0


def rows(runs, measurements, checks, plan, reference):
    """One row per run: its times (ms), median and IQR, against `reference`'s median, what the
    check found, the bytes predicted; for the stash and SAC, saved_ms_per_layer (plain - this,
    per layer the stash kept, or per attention layer for SAC), efficiency (that / one attention
    forward alone: 1.0 is the limit) and, next to SAC, the difference in time and peak memory."""
    med = {name: median_ms(m) for name, m in measurements.items()}
    attention, out = med.get(ATTENTION), []
    for run in runs:
        c, check, m = run.config, checks[run.name], measurements[run.name]
        plain, sac = run.name_of(c.plain) if c.plain else None, run.name_of(Config("sac"))
        row = {"name": run.name, "checkpointing": c.checkpointing, "stash_layers": c.stash, "budget": c.budget,
               "max_bytes": c.max_bytes, "times_ms": [t * 1e3 for t in m.times], "median_ms": med[run.name],
               "iqr_ms": m.iqr * 1e3, "vs_reference": med[run.name] / med[reference] - 1,
               "predicted_kept_bytes": predicted_bytes(plan, c), **check}
        if plain in med:
            layers = check["replays"] if c.stash is not None else len(plan.layers)
            saved = med[plain] - med[run.name]
            row.update(plain_ms=med[plain], saved_ms=saved, saved_ms_per_layer=saved / layers if layers else None,
                       efficiency=saved / layers / attention if layers and attention else None)
        if c.stash and sac in med:
            peaks = check["peak_bytes"], checks[sac]["peak_bytes"]
            row.update(vs_sac_ms=med[run.name] - med[sac],
                       vs_sac_peak_bytes=None if None in peaks else peaks[0] - peaks[1])
        out.append(row)
    return out


@contextlib.contextmanager
def collector_paused():
    """Collect the young generations now and keep the collector out of the block."""
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def quiet_stderr():
    """Hide what the profiler's native start and stop print on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(device, fn):
    """(fn(), its peak of live tensor bytes above the start) (see the module docstring)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, result = torch.cuda.memory_allocated(), fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - start
    from torch._C._profiler import _EventType
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.start()
    try:
        result = fn()
    finally:
        with quiet_stderr():
            prof.stop()
    stack, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocations.append((e.start_time_ns, e.extra_fields.alloc_size))
    return result, max(itertools.accumulate((size for _, size in sorted(allocations)), initial=0))


@contextlib.contextmanager
def cpu_threads(n):
    """Run with n intra-op threads (0: torch's setting), restoring it after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def environment(device):
    """Versions, device and threads, for the reports."""
    facts = {"python": platform.python_version(), "torch": torch.__version__, "attnstash": attnstash.__version__,
             "device": str(device), "cpu threads": torch.get_num_threads()}
    for name in ("transformers", "diffusers"):
        if name in sys.modules:
            facts[name] = sys.modules[name].__version__
    if torch.device(device).type == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version())
    else:
        facts["cpu"] = platform.processor() or platform.machine()
    return facts


def summary(table):
    """{name: plain_ms, median_ms, saved_ms_per_layer, efficiency} of the stash's and SAC's rows."""
    return {r["name"]: {k: r[k] for k in ("plain_ms", "median_ms", "saved_ms_per_layer", "efficiency")}
            for r in table if r.get("saved_ms_per_layer") is not None}


def measure(runs, reference, planned, label, rounds, warmup, column="step"):
    """One point: the check, the interleaved rounds with the attention forward alone (at the
    shape of the last layer's call, as the planner recorded it) and the rows. (Measurements, figures)."""
    checks = check(runs, reference)
    call = planned.layers[-1].calls[0]
    times = interleave(runs, rounds, warmup, label, column,
                       attention=attention_forward(call, reference.subject.device, planned.dtype))
    table = rows(runs, times, checks, planned, reference.name)
    return times, {"sdpa_backend": call.backend.name, "rounds": {"warmup": warmup, "repeats": rounds},
                   "attention_forward_ms": median_ms(times[ATTENTION]),
                   "kept_bytes_per_layer": planned.layers[-1].bytes,
                   "prediction_formula": describe_call(call), "configs": table, "modes": summary(table),
                   "losses_equal": losses_equal(runs), "grad_noise_floor": checks[reference.name]}
