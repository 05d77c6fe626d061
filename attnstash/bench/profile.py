"""--mode profile: where the time of one checkpointed decoder layer goes, without and with the stash.

One decoder layer (layer_mode.LayerBench, the preset's shape), forward + backward, in each
configuration of --checkpointing (reentrant and non-reentrant, each without and with the
stash, and SAC), each run --warmup times unprofiled (default 2) and then --repeats times
(default 3) under torch.profiler, with CPU and CUDA activity (CPU only without CUDA: then
there are no kernels, and only the host figures are filled). The attention forward alone is
profiled the same way, as the reference for the kernels the stash should remove.

Marks. Every profiled step is a record_function range "bench:step" holding "bench:forward"
and "bench:backward" and ending with a device synchronisation (so the step's kernels run
inside it); a forward pre-hook on the layer opens "bench:recompute" when the layer runs
inside a backward (torch._C._current_graph_task_id() != -1: the checkpoint's recompute) and
its forward hook closes it.

The trace (the profiler's Chrome trace, parsed here) gives, per configuration and per
profiled step (sums divided by the steps):
  kernels      GPU time and calls of every device event (kernels, memcpy, memset), keyed by
               phase (forward / recompute / backward: the range its launch was made in),
               class (attention forward / attention backward: launched inside an aten
               attention op, the innermost one deciding; attnstash: inside an attnstash op
               but no attention op; other; unattributed: no launch event found), the
               innermost op that launched it, and its name. A kernel belongs to the range
               its launch (the CUDA runtime or driver call with its correlation id) was
               made in, whichever thread made it.
  windows      for the step, the forward, the backward (recompute + backward) and the
               recompute alone: span (first kernel start to last kernel end), busy (the union
               of kernel intervals), the kernels' summed time, their overlap (sum - busy) and
               idle (span - busy); summed over the step's instances of the range. Exactly:
               span = sum - overlap + idle.
  host         CPU time of the ranges; of every attnstash::* op (self: excluding the ops,
               ranges and runtime calls nested in it; total: outermost calls only); self time
               of every host op, by phase.
  syncs        synchronisations made inside the forward and backward ranges: runtime/driver
               calls named *Synchronize*, cudaMemcpy (synchronous) and memcpys whose device
               copy is device-to-host.
  allocator    cudaMalloc/cudaFree (and the driver's cuMem*) calls inside the step, and the
               caching allocator's counters over the profiled steps.

Comparisons (plain -> other, per step): every kernel row side by side, sorted by |difference|,
and the accounting: other's step span - plain's = (attention forward kernels' difference) +
(the other kernels grown) - (shrunk) - (overlap difference) + (idle difference), to the last
microsecond. Output under --out: profile.json, profile.md (report.py writes it), and with
--traces the Chrome traces as profile_traces.tar.gz.
"""
import collections
import dataclasses
import io
import json
import os
import tarfile
import tempfile
import time
import traceback

import torch

import attnstash

from . import report as reporting
from .layer_mode import LayerBench, config_names
from .measure import _stderr_silenced, collector_paused, environment

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation") + LAUNCH_CATS
RANGES = ("bench:step", "bench:forward", "bench:backward", "bench:recompute")
WINDOWS = {"step": "bench:step", "forward": "bench:forward", "backward": "bench:backward",
           "recompute": "bench:recompute"}
ALLOC_PREFIXES = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cuMemAlloc", "cuMemFree", "cuMemCreate", "cuMemRelease",
                  "cuMemMap", "cuMemUnmap", "cuMemHostAlloc", "cuMemAddressReserve", "cuMemAddressFree")
# Comparisons: (label, base configuration, other configuration).
COMPARISONS = (
    ("reentrant: stash vs plain", "reentrant, no stash", "reentrant + stash"),
    ("non-reentrant: stash vs plain", "non-reentrant, no stash", "non-reentrant + stash"),
    ("SAC vs non-reentrant plain", "non-reentrant, no stash", "SAC (non-reentrant)"),
    ("reentrant + stash vs SAC", "SAC (non-reentrant)", "reentrant + stash"),
    ("non-reentrant + stash vs SAC", "SAC (non-reentrant)", "non-reentrant + stash"),
)
ATTENTION_REFERENCE = "attention forward alone"


# ---- the trace --------------------------------------------------------------------------------

class Event:
    __slots__ = ("name", "cat", "ts", "dur", "end", "thread", "corr", "ext", "parent", "child_dur", "launch")

    def __init__(self, raw):
        self.name = raw.get("name", "")
        self.cat = raw.get("cat", "")
        self.ts = float(raw.get("ts", 0.0))
        self.dur = float(raw.get("dur", 0.0))
        self.end = self.ts + self.dur
        self.thread = (raw.get("pid"), raw.get("tid"))
        args = raw.get("args") or {}
        self.corr = args.get("correlation")
        self.ext = args.get("External id")
        self.parent = None
        self.child_dur = 0.0
        self.launch = None

    def ancestors(self):
        node = self.parent
        while node is not None:
            yield node
            node = node.parent


def _nest(host, slack=0.05):
    """Give every host event its parent: the innermost event of its thread that holds it
    whole (to `slack` microseconds), and every parent the time of its children. The profiler
    does not always nest properly (a range opened inside a dispatch mode's event outlives
    that event): such an event is not the parent of what outlives it."""
    by_thread = collections.defaultdict(list)
    for e in host:
        by_thread[e.thread].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e.ts, -e.dur))
        stack = []
        for e in events:
            while stack and e.ts >= stack[-1].end:
                stack.pop()
            for holder in reversed(stack):
                if holder.end + slack >= e.end:
                    e.parent = holder
                    holder.child_dur += e.dur
                    break
            stack.append(e)


def _is_attention_op(name):
    return name.startswith("aten::") and "attention" in name


def kernel_class(origin):
    """attention forward / attention backward (the innermost aten attention op around the
    launch decides), attnstash (inside an attnstash op, no attention op), other;
    unattributed without a host event to start from. `origin`: the launch (runtime or
    driver call), or the op the kernel's External id names."""
    if origin is None:
        return "unattributed"
    inside_stash = False
    for node in [origin] + list(origin.ancestors()):
        if node.cat != "cpu_op":
            continue
        if _is_attention_op(node.name):
            return "attention backward" if "backward" in node.name else "attention forward"
        inside_stash = inside_stash or node.name.startswith("attnstash::")
    return "attnstash" if inside_stash else "other"


def innermost_op(event):
    for node in ([event] if event.cat == "cpu_op" else []) + list(event.ancestors()):
        if node.cat == "cpu_op":
            return node.name
    return "-"


class Ranges:
    """The instances of each bench:* range, as sorted (start, end) pairs."""

    def __init__(self, host):
        self.by_name = {name: sorted((e.ts, e.end) for e in host if e.cat == "user_annotation" and e.name == name)
                        for name in RANGES}

    def index(self, name, t):
        """The index of the instance of range `name` holding time t, or None."""
        for i, (start, end) in enumerate(self.by_name[name]):
            if start <= t <= end:
                return i
        return None

    def phase(self, t):
        if self.index("bench:recompute", t) is not None:
            return "recompute"
        if self.index("bench:forward", t) is not None:
            return "forward"
        if self.index("bench:backward", t) is not None:
            return "backward"
        return "step" if self.index("bench:step", t) is not None else None


def _union(intervals):
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def window(kernels):
    """span, busy, sum, overlap, idle (microseconds) of device events [(start, end)]."""
    if not kernels:
        return {"span": 0.0, "busy": 0.0, "sum": 0.0, "overlap": 0.0, "idle": 0.0}
    span = max(e for _, e in kernels) - min(s for s, _ in kernels)
    busy = _union(kernels)
    total = sum(e - s for s, e in kernels)
    return {"span": span, "busy": busy, "sum": total, "overlap": total - busy, "idle": span - busy}


def _is_sync(e, device_by_corr):
    if "Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaMemcpy2D"):
        return True
    if "Memcpy" in e.name or "cuMemcpy" in e.name:
        if "DtoH" in e.name:
            return True
        copy = device_by_corr.get(e.corr)
        return copy is not None and "DtoH" in copy.name
    return False


def analyse_trace(raw_events, steps):
    """The figures of one profiled configuration from its Chrome trace events (see the module
    docstring); every time in milliseconds per step."""
    events = [Event(r) for r in raw_events if r.get("ph") == "X"]
    host = [e for e in events if e.cat in HOST_CATS]
    device = [e for e in events if e.cat in DEVICE_CATS]
    _nest(host)
    ranges = Ranges(host)
    launches = {e.corr: e for e in host if e.cat in LAUNCH_CATS and e.corr is not None}
    ops_by_ext = {e.ext: e for e in host if e.cat == "cpu_op" and e.ext is not None}
    per = 1.0 / max(1, steps)
    ms = 1e-3 * per  # microseconds summed over the steps -> milliseconds per step

    # Device events: the launch, the phase and class, the windows.
    rows = {}
    in_range = {name: collections.defaultdict(list) for name in WINDOWS}
    without_launch = without_origin = 0
    by_class = collections.Counter()
    for k in device:
        k.launch = launches.get(k.corr)
        # Where the kernel comes from: its launch, nested in the ops of its thread; else the
        # op its External id names; else nothing (then its own start stands for its launch).
        origin = k.launch if k.launch is not None and k.launch.parent is not None else ops_by_ext.get(k.ext, k.launch)
        without_launch += k.launch is None
        without_origin += origin is None
        t = k.launch.ts if k.launch is not None else origin.ts if origin is not None else k.ts
        if ranges.index("bench:step", t) is None:
            continue
        phase = ranges.phase(t)
        cls = kernel_class(origin)
        op = innermost_op(origin) if origin is not None else "-"
        key = f"{phase} | {cls} | {op} | {k.name}"
        row = rows.setdefault(key, {"phase": phase, "class": cls, "op": op, "name": k.name, "ms": 0.0, "calls": 0.0})
        row["ms"] += k.dur * ms
        row["calls"] += per
        by_class[cls] += k.dur * ms
        for w, name in WINDOWS.items():
            i = ranges.index(name, t)
            if i is not None:
                in_range[w][i].append((k.ts, k.end))
    windows = {}
    for w in WINDOWS:
        total = collections.Counter()
        for kernels in in_range[w].values():
            total.update(window(kernels))
        windows[w] = {f"{k}_ms": total[k] * ms for k in ("span", "busy", "sum", "overlap", "idle")}
    starts = [start for start, _ in ranges.by_name["bench:step"]]
    lead = [min(s for s, _ in ks) - starts[i] for i, ks in in_range["step"].items()]

    # Host: ranges, attnstash ops, every op's self time by phase.
    step_host = [e for e in host if ranges.index("bench:step", e.ts) is not None]
    range_ms = {name.split(":")[1]: sum(e - s for s, e in ranges.by_name[name]) * ms for name in RANGES}
    stash_ops, host_ops = {}, {}
    for e in step_host:
        if e.cat != "cpu_op":
            continue
        self_us = e.dur - e.child_dur
        outermost = not any(a.name == e.name for a in e.ancestors())
        if e.name.startswith("attnstash::"):
            op = stash_ops.setdefault(e.name, {"calls": 0.0, "self_ms": 0.0, "total_ms": 0.0})
            op["self_ms"] += self_us * ms
            if outermost:
                op["calls"] += per
                op["total_ms"] += e.dur * ms
        phase = ranges.phase(e.ts)
        row = host_ops.setdefault(f"{phase} | {e.name}", {"phase": phase, "name": e.name, "self_ms": 0.0,
                                                          "calls": 0.0})
        row["self_ms"] += self_us * ms
        row["calls"] += per
    stash_total = sum(e.dur for e in step_host if e.cat == "cpu_op" and e.name.startswith("attnstash::")
                      and not any(a.name.startswith("attnstash::") for a in e.ancestors())) * ms

    # Synchronisations inside the forward and backward; allocator calls inside the step.
    device_by_corr = {k.corr: k for k in device if k.corr is not None}
    syncs, allocs = collections.defaultdict(lambda: [0.0, 0.0]), collections.defaultdict(lambda: [0.0, 0.0])
    for e in step_host:
        if e.cat not in LAUNCH_CATS:
            continue
        inside = ranges.index("bench:forward", e.ts) is not None or ranges.index("bench:backward", e.ts) is not None
        if inside and _is_sync(e, device_by_corr):
            syncs[e.name][0] += per
            syncs[e.name][1] += e.dur * ms
        if e.name.startswith(ALLOC_PREFIXES):
            allocs[e.name][0] += per
            allocs[e.name][1] += e.dur * ms

    return {
        "steps": steps,
        "ranges_found": {name: len(v) for name, v in ranges.by_name.items()},
        "device": {
            "events": len(device), "events_in_steps_per_step": sum(r["calls"] for r in rows.values()),
            "without_launch_event": without_launch, "without_host_origin": without_origin,
            "ms_by_class": dict(by_class), "windows": windows,
            "lead_ms": sum(lead) * ms if lead else None,
            "kernels": sorted(rows.values(), key=lambda r: -r["ms"]),
        },
        "host": {
            "range_ms": range_ms,
            "attnstash_ops": stash_ops, "attnstash_total_ms": stash_total,
            "attnstash_self_ms": sum(op["self_ms"] for op in stash_ops.values()),
            "ops": sorted(host_ops.values(), key=lambda r: -r["self_ms"]),
        },
        "syncs": {"count": sum(v[0] for v in syncs.values()), "ms": sum(v[1] for v in syncs.values()),
                  "by_name": {k: {"count": v[0], "ms": v[1]} for k, v in syncs.items()}},
        "allocator": {"calls": sum(v[0] for v in allocs.values()), "ms": sum(v[1] for v in allocs.values()),
                      "by_name": {k: {"count": v[0], "ms": v[1]} for k, v in allocs.items()}},
    }


# ---- comparisons ------------------------------------------------------------------------------

def _side_by_side(base_rows, other_rows, value, keys):
    def key(r):
        return " | ".join(str(r[k]) for k in keys)
    base = {key(r): r for r in base_rows}
    other = {key(r): r for r in other_rows}
    rows = []
    for k in set(base) | set(other):
        b, o = base.get(k), other.get(k)
        ref = b or o
        bv, ov = (b[value] if b else 0.0), (o[value] if o else 0.0)
        bc, oc = (b["calls"] if b else 0.0), (o["calls"] if o else 0.0)
        diff = ov - bv
        change = ("appears" if not b else "disappears" if not o else "grows" if diff > 0
                  else "shrinks" if diff < 0 else "same")
        rows.append({**{kk: ref[kk] for kk in keys}, "base_ms": bv, "other_ms": ov, "diff_ms": diff,
                     "base_calls": bc, "other_calls": oc, "change": change})
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return rows


def compare(base, other):
    """other - base, per step: the kernel rows side by side and the accounting of the step's
    GPU span (and the host's figures next to it)."""
    kernels = _side_by_side(base["device"]["kernels"], other["device"]["kernels"], "ms",
                            ("phase", "class", "op", "name"))
    attention = sum(r["diff_ms"] for r in kernels if r["class"] == "attention forward")
    grown = sum(r["diff_ms"] for r in kernels if r["class"] != "attention forward" and r["diff_ms"] > 0)
    shrunk = -sum(r["diff_ms"] for r in kernels if r["class"] != "attention forward" and r["diff_ms"] < 0)
    bw, ow = base["device"]["windows"], other["device"]["windows"]
    d = {w: {k: ow[w][k] - bw[w][k] for k in bw[w]} for w in bw}
    step = d["step"]
    accounting = {
        "base_span_ms": bw["step"]["span_ms"], "other_span_ms": ow["step"]["span_ms"],
        "span_diff_ms": step["span_ms"],
        "attention_forward_diff_ms": attention, "grown_ms": grown, "shrunk_ms": shrunk,
        "attention_forward_diff_by_phase_ms": {
            phase: sum(r["diff_ms"] for r in kernels if r["class"] == "attention forward" and r["phase"] == phase)
            for phase in ("forward", "recompute", "backward", "step")},
        "kernel_sum_diff_ms": step["sum_ms"], "overlap_diff_ms": step["overlap_ms"], "idle_diff_ms": step["idle_ms"],
        "idle_diff_by_window_ms": {w: d[w]["idle_ms"] for w in ("forward", "backward", "recompute")},
        "residual_ms": step["span_ms"] - (attention + grown - shrunk - step["overlap_ms"] + step["idle_ms"]),
        "removed_attention_forward_kernels": [r for r in kernels if r["class"] == "attention forward"
                                              and r["diff_ms"] < 0],
    }
    host_rows = _side_by_side([{**r, "ms": r["self_ms"]} for r in base["host"]["ops"]],
                              [{**r, "ms": r["self_ms"]} for r in other["host"]["ops"]], "ms", ("phase", "name"))
    host = {k: other["host"]["range_ms"][k] - base["host"]["range_ms"][k] for k in base["host"]["range_ms"]}
    return {"kernels": kernels, "accounting": accounting, "windows_diff": d, "host_range_diff_ms": host,
            "host_ops": host_rows,
            "syncs_diff": other["syncs"]["count"] - base["syncs"]["count"],
            "allocator_calls_diff": other["allocator"]["calls"] - base["allocator"]["calls"]}


# ---- profiling --------------------------------------------------------------------------------

class RecomputeMarks:
    """Marks the layer's checkpointed forward with a record_function range: "bench:recompute"
    around the run inside a backward (the checkpoint's recompute), "bench:layer" around the
    other. It stands in for the layer's checkpoint function (its _gradient_checkpointing_func,
    which every transformers release calls with the layer's forward, inside or outside module
    hooks), so that the ranges are inside the checkpoint. Both runs open a range, so that they
    make the same calls: selective activation checkpointing checks that the recompute makes
    exactly the forward's op calls. A range closes when the run returns or raises (a
    non-reentrant recompute stops early by raising once it has what the backward needs)."""
    NAME = "_gradient_checkpointing_func"

    def __init__(self, layer):
        self.layer, self.original = layer, layer.__dict__.get(self.NAME)
        if self.original is not None:  # (a layer that is not checkpointed has no recompute)
            layer.__dict__[self.NAME] = self._checkpoint

    def _checkpoint(self, fn, *args, **kwargs):
        from torch.profiler import record_function

        def marked(*a, **k):
            recompute = torch._C._current_graph_task_id() != -1
            with record_function("bench:recompute" if recompute else "bench:layer"):
                return fn(*a, **k)

        return self.original(marked, *args, **kwargs)

    def remove(self):
        if self.original is not None:
            self.layer.__dict__[self.NAME] = self.original


def _allocator_counters(cuda):
    if not cuda:
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def profile_steps(step, reset, steps, warmup, cuda):
    """warmup unprofiled calls of step(), then `steps` under torch.profiler; reset() runs
    before each, outside the ranges. Returns (Chrome trace events, seconds, allocator
    counter differences)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        reset()
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    before = _allocator_counters(cuda)
    t0 = time.perf_counter()
    prof = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False)
    with _stderr_silenced():
        prof.__enter__()
    try:
        for _ in range(steps):
            reset()
            with collector_paused():
                step()
    finally:
        with _stderr_silenced():
            prof.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    after = _allocator_counters(cuda)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="attnstash_profile_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return trace, seconds, {k: after[k] - before[k] for k in after}


def run_profile_mode(shape, args, out_dir):
    """Profile each configuration of --checkpointing and the attention forward alone; compare."""
    names = config_names(getattr(args, "checkpointing", "both"))
    cuda = torch.device(shape.device).type == "cuda"
    steps = args.repeats if args.repeats_given else 3
    warmup = args.warmup if getattr(args, "warmup_given", False) else 2
    bench = LayerBench(shape, names, seed=args.seed)
    one = bench.shape
    traces, configs = {}, {}
    print(f"profile: one decoder layer, {one.describe()}; {warmup} warm-up + {steps} profiled steps per "
          f"configuration ({'CPU + CUDA' if cuda else 'CPU only: no kernels'})", flush=True)

    def no_reset():
        pass

    def analyse(name, trace, seconds, counters):
        try:
            configs[name] = analyse_trace(trace.get("traceEvents", []), steps)
        except Exception:  # a trace this parser does not understand: say so, keep going
            configs[name] = {"error": traceback.format_exc()}
        configs[name]["profiled_seconds"] = seconds
        configs[name]["allocator_counters"] = counters

    trace, seconds, counters = profile_steps(lambda: _marked(bench.attention, cuda), no_reset, steps, warmup, cuda)
    analyse(ATTENTION_REFERENCE, trace, seconds, counters)
    if args.traces:
        traces[ATTENTION_REFERENCE] = trace
    for config in bench.configs:
        config.setup()
        marks = RecomputeMarks(config.layer)
        try:
            before = attnstash.stash_stats()
            trace, seconds, counters = profile_steps(lambda: bench.step(config, marks=True),
                                                     lambda: bench.reset(config), steps, warmup, cuda)
            after = attnstash.stash_stats()
        except Exception:  # record it and profile the others (the run is blind: keep what can be kept)
            configs[config.name] = {"error": traceback.format_exc()}
            print(f"  {config.name}: profiling FAILED\n{configs[config.name]['error']}", flush=True)
            continue
        finally:
            marks.remove()
            config.teardown()
            bench.reset(config)
        analyse(config.name, trace, seconds, counters)
        # The stash's counters over the warm-up and the profiled steps together.
        counts = {k: after[k] - before[k] for k in ("keeps", "replays", "declined", "misses")}
        configs[config.name]["stash"] = {"steps": warmup + steps, **counts}
        if args.traces:
            traces[config.name] = trace
        del trace
        print(f"  profiled {config.name} in {seconds:.1f} s", flush=True)

    comparisons = {}
    for label, base, other in COMPARISONS:
        if base in configs and other in configs and "error" not in configs[base] and "error" not in configs[other]:
            comparisons[label] = {"base": base, "other": other, **compare(configs[base], configs[other])}
    reference = configs[ATTENTION_REFERENCE]
    report = {
        "mode": "profile", "preset": args.preset, "shape": dataclasses.asdict(one),
        "environment": environment(one, torch.get_num_threads()), "sdpa_backend": bench.sdpa_backend(),
        "checkpointing": getattr(args, "checkpointing", "both"), "activities": ["CPU"] + (["CUDA"] if cuda else []),
        "steps": steps, "warmup": warmup, "order": [ATTENTION_REFERENCE] + [c.name for c in bench.configs],
        "attention_forward_alone": {
            "gpu_ms_per_call": reference.get("device", {}).get("windows", {}).get("step", {}).get("sum_ms"),
            "host_ms_per_call": reference.get("host", {}).get("range_ms", {}).get("step")},
        "configs": configs, "comparisons": comparisons,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        reporting.write_json(out_dir / "profile.json", report)
        (out_dir / "profile.md").write_text(reporting.profile_markdown(report))
        written = [out_dir / "profile.json", out_dir / "profile.md"]
        if traces:
            written.append(write_traces(out_dir / "profile_traces.tar.gz", traces))
        print("wrote " + ", ".join(str(p) for p in written))
    reporting.print_profile_report(report)
    return report


def _marked(fn, cuda):
    from torch.profiler import record_function
    with record_function("bench:step"):
        with record_function("bench:forward"):
            fn()
        if cuda:
            torch.cuda.synchronize()


def write_traces(path, traces):
    """The Chrome traces, one JSON file per configuration, in one gzipped tar (open them in
    Perfetto or chrome://tracing)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, trace in traces.items():
            data = json.dumps(trace).encode()
            info = tarfile.TarInfo(name.replace(" ", "_").replace(",", "").replace("+", "plus")
                                   .replace("(", "").replace(")", "") + ".json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


__all__ = ["analyse_trace", "compare", "run_profile_mode"]
