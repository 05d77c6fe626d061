"""--mode profile: where one checkpointed decoder layer's step goes, per configuration, under torch.profiler.

Layer mode's configurations (decoder.py), each run --warmup times (default 2), then --repeats
times (default 3) under torch.profiler (CPU and CUDA activity; without CUDA no kernels, only host
figures). A profiled step is a range "bench:step" holding "bench:forward" and "bench:backward",
ending with a device sync; the layer's checkpointed forward runs in "bench:recompute" inside the
backward ("bench:layer" in the forward: SAC wants the recompute to repeat the forward's op calls).

Per configuration and step (ms), from torch.profiler's key_averages() (every op and kernel: calls,
self CPU and device time; its table goes into profile.md) and event tree (prof.events(): parents,
and each kernel's launch by correlation id): host_ms and device_ms, the self CPU time of every op
in the step and the device time of the kernels each launched, by class (attention forward or
backward, or attnstash: the innermost aten attention op or attnstash op around it; other);
attnstash_ops; gpu: span, busy (the union of kernel intervals) and idle (span - busy) of the
kernels launched in the step and in the recompute; step_ms, the bench:step range's wall time.
Comparisons: every key_averages row side by side, and the accounting: the measured step
difference next to measured terms (CUDA: kernel time by class and GPU idle; CPU: host self time
by class), their sum, and what the terms leave out (CUDA: host time before the first and after
the last kernel, concurrent kernels; CPU: host time outside ops, Python and the autograd engine).
Output: profile.json, profile.md; --traces: each Chrome trace, profile_trace_<configuration>.json.gz.
"""
import collections
import copy
import dataclasses
import re

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

import attnstash

from . import report
from .decoder import LAYER_CONFIGS, LayerStep
from .harness import Config, Run, collector_paused, environment, quiet_stderr
from .models import plan

RANGES = ("bench:step", "bench:forward", "bench:backward", "bench:recompute")
CLASSES = ("attention forward", "attention backward", "attnstash", "other")
COMPARISONS = ((Config("reentrant"), Config("reentrant", 1)), (Config("non-reentrant"), Config("non-reentrant", 1)),
               (Config("non-reentrant"), Config("sac")), (Config("sac"), Config("reentrant", 1)),
               (Config("sac"), Config("non-reentrant", 1)))


def mark_recompute(layer):
    """Run the layer's checkpointed forward in a range (its checkpoint function, which every
    transformers release calls with the layer's forward, gets a marked forward)."""
    original = layer.__dict__["_gradient_checkpointing_func"]

    def marked_checkpoint(fn, *args, **kwargs):
        def marked(*a, **k):
            with record_function("bench:recompute" if torch._C._current_graph_task_id() != -1 else "bench:layer"):
                return fn(*a, **k)
        return original(marked, *args, **kwargs)

    layer.__dict__["_gradient_checkpointing_func"] = marked_checkpoint


def kind(event):
    """The class of an op's time (see the module docstring), from its innermost ancestor that is
    an aten attention op or an attnstash op (a stashed layer's aten::scaled_dot_product_attention
    calls attnstash::sdpa_fwd_keep, which calls the fused attention op in a first forward)."""
    while event is not None:
        if event.name.startswith("attnstash::"):
            return "attnstash"
        if event.name.startswith("aten::") and "attention" in event.name:
            return "attention backward" if "backward" in event.name else "attention forward"
        event = event.cpu_parent
    return "other"


def span_and_busy(intervals):
    busy, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return max(b for _, b in intervals) - min(a for a, _ in intervals), busy


def analyse(prof, steps):
    """The figures of one profiled configuration (see the module docstring), ms per step."""
    events, per = prof.events(), 1e-3 / steps
    spans = {name: [(e.time_range.start, e.time_range.end) for e in events
                    if e.name == name and e.device_type == DeviceType.CPU] for name in RANGES}

    def within(name, t):
        return next((i for i, (a, b) in enumerate(spans[name]) if a <= t <= b), None)

    host, device, launches = collections.Counter(), collections.Counter(), {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_user_annotation or within("bench:step", e.time_range.start) is None:
            continue
        cls = kind(e)
        host[cls] += e.self_cpu_time_total * per
        device[cls] += e.self_device_time_total * per
        if e.kernels:
            launches[e.id] = e
    windows = {}
    for window in ("step", "recompute"):
        by_instance = collections.defaultdict(list)
        for k in events:
            kernel = k.device_type == DeviceType.CUDA and not k.is_user_annotation
            launch = launches.get(k.linked_correlation_id) if kernel else None
            i = None if launch is None else within(f"bench:{window}", launch.time_range.start)
            if i is not None:
                by_instance[i].append((k.time_range.start, k.time_range.end))
        span, busy = map(sum, zip(*(span_and_busy(ks) for ks in by_instance.values()))) if by_instance else (0, 0)
        windows[window] = {"span_ms": span * per, "busy_ms": busy * per, "idle_ms": (span - busy) * per}
    averages = prof.key_averages()
    ops = {a.key: {"calls": a.count / steps, "self_cpu_ms": a.self_cpu_time_total * per,
                   "cpu_ms": a.cpu_time_total * per, "self_device_ms": a.self_device_time_total * per}
           for a in averages}
    return {"ranges_found": {name: len(s) for name, s in spans.items()},
            "step_ms": sum(b - a for a, b in spans["bench:step"]) * per,
            "recompute_host_ms": sum(b - a for a, b in spans["bench:recompute"]) * per,
            "host_ms": {c: host[c] for c in CLASSES}, "device_ms": {c: device[c] for c in CLASSES}, "gpu": windows,
            "attnstash_ops": {k: v for k, v in ops.items() if k.startswith("attnstash::")}, "ops": ops,
            "table": averages.table(sort_by="self_device_time_total" if windows["step"]["span_ms"] else
                                    "self_cpu_time_total", row_limit=30)}


def compare(base, other, cuda):
    """other - base, per step: the ops side by side and the accounting (see the module docstring)."""
    def diff(f):
        return f(other) - f(base)
    side = "device_ms" if cuda else "host_ms"
    terms = {f"{c} ({'GPU' if cuda else 'host'})": diff(lambda r: r[side][c]) for c in CLASSES}
    if cuda:
        terms["GPU idle in the step"] = diff(lambda r: r["gpu"]["step"]["idle_ms"])
    measured = diff(lambda r: r["step_ms"])
    names = set(base["ops"]) | set(other["ops"])
    zero = {"calls": 0.0, "self_cpu_ms": 0.0, "self_device_ms": 0.0}
    rows = [{"name": n, **{f"{who}_{k}": side_of["ops"].get(n, zero)[k] for who, side_of in (("base", base),
                                                                                               ("other", other))
                           for k in ("calls", "self_cpu_ms", "self_device_ms")}} for n in names]
    for r in rows:
        r["cpu_diff_ms"], r["device_diff_ms"] = (r["other_self_cpu_ms"] - r["base_self_cpu_ms"],
                                                 r["other_self_device_ms"] - r["base_self_device_ms"])
    rows.sort(key=lambda r: -abs(r["device_diff_ms" if cuda else "cpu_diff_ms"]))
    return {"accounting": {"step_diff_ms": measured, "terms_ms": terms, "sum_of_terms_ms": sum(terms.values()),
                           "not_in_the_terms_ms": measured - sum(terms.values()),
                           "gpu_idle_in_the_recompute_diff_ms": diff(lambda r: r["gpu"]["recompute"]["idle_ms"])},
            "ops": rows}


def profile_mode(shape, args, out):
    cuda = torch.device(shape.device).type == "cuda"
    steps = args.repeats if args.repeats_given else 3
    warmup = args.warmup if args.warmup_given else 2
    step = LayerStep(shape, seed=args.seed)
    planned = plan(step.model, step.shape)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    print(f"profile: one decoder layer, {step.shape.describe()}; {warmup} warm-up + {steps} profiled steps per "
          f"configuration ({'CPU + CUDA' if cuda else 'CPU only: no kernels'})", flush=True)
    configs = {}
    for config in LAYER_CONFIGS[args.checkpointing]:
        run = Run(config, copy.deepcopy(step.model), step)
        mark_recompute(run.model.model.layers[0])
        run.enter()
        try:
            before = attnstash.stash_stats()
            for _ in range(warmup):
                run.step()
            prof = torch.profiler.profile(activities=activities)
            with quiet_stderr():
                prof.start()
            for _ in range(steps):
                with collector_paused(), record_function("bench:step"):
                    run.step(mark=record_function)
                    if cuda:
                        torch.cuda.synchronize()
            with quiet_stderr():
                prof.stop()
            after = attnstash.stash_stats()
        finally:
            run.exit()
        configs[run.name] = {**analyse(prof, steps), "stash": {"steps": warmup + steps, **{
            k: after[k] - before[k] for k in ("keeps", "replays", "declined", "misses")}}}
        if args.traces and out is not None:
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"profile_trace_{re.sub(r'[^a-z0-9]+', '_', run.name.lower())}.json.gz"))
        print(f"  profiled {run.name}", flush=True)
    comparisons = {f"{o.name} vs {b.name}": {"base": b.name, "other": o.name, **compare(configs[b.name],
                                                                                      configs[o.name], cuda)}
                   for b, o in COMPARISONS if b.name in configs and o.name in configs}
    result = {"mode": "profile", "preset": args.preset, "shape": dataclasses.asdict(step.shape),
              "environment": environment(shape.device), "sdpa_backend": planned.layers[0].calls[0].backend.name,
              "checkpointing": args.checkpointing, "activities": [a.name for a in activities], "steps": steps,
              "warmup": warmup, "configs": configs, "comparisons": comparisons}
    markdown = profile_markdown(result)
    print(markdown.split("\n## torch.profiler")[0])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.md").write_text(markdown)
    report.write(out, "profile", {**result, "configs": {k: {kk: vv for kk, vv in v.items() if kk != "table"}
                                                         for k, v in configs.items()}})
    return result


def profile_markdown(result, top=30):
    cuda, f, side = "CUDA" in result["activities"], report.num, "GPU" if "CUDA" in result["activities"] else "host"
    s, by = result["shape"], "device_ms" if "CUDA" in result["activities"] else "host_ms"
    out = [f"# attnstash profile: one checkpointed decoder layer, forward + backward\n\n{s['heads']} query / "
           f"{s['kv_heads']} KV heads x {s['head_dim']}, hidden {s['hidden']}, micro-batch {s['batch']} x seq "
           f"{s['seq']}, {s['amp'] or s['dtype']} on {result['environment'].get('gpu', s['device'])}; SDPA backend "
           f"{result['sdpa_backend']}; torch {result['environment']['torch']}; {result['warmup']} warm-up + "
           f"{result['steps']} profiled steps per configuration; ms per step"
           + ("." if cuda else "; CPU only: no kernels, every GPU figure 0."), "\n## Per configuration\n", "```",
           report.table(result["configs"].items(), [
               ("configuration", lambda kv: kv[0]), ("step", lambda kv: f(kv[1]["step_ms"])),
               ("recompute (host)", lambda kv: f(kv[1]["recompute_host_ms"])),
               ("GPU idle", lambda kv: f(kv[1]["gpu"]["step"]["idle_ms"])),
               ("GPU idle in the recompute", lambda kv: f(kv[1]["gpu"]["recompute"]["idle_ms"])),
               *[(f"{c} ({side})", lambda kv, c=c: f(kv[1][by][c])) for c in CLASSES],
               ("kept/replayed", lambda kv: f"{kv[1]['stash']['keeps']}/{kv[1]['stash']['replays']}")]),
           "\nattnstash ops, host ms per step (self):",
           *[f"  {name}: {op} {v['calls']:g} calls, {v['cpu_ms']:.3f} ({v['self_cpu_ms']:.3f}); "
             f"device {v['self_device_ms']:.3f}"
             for name, c in result["configs"].items() for op, v in c["attnstash_ops"].items()], "```"]
    for label, c in result["comparisons"].items():
        a = c["accounting"]
        terms = [*a["terms_ms"].items(), ("sum of the terms", a["sum_of_terms_ms"]),
                 ("the step, measured (bench:step)", a["step_diff_ms"]), ("not in the terms", a["not_in_the_terms_ms"])]
        out += [f"\n## {label}\n", "```", report.table(terms, [("difference, ms per step", lambda kv: kv[0]),
                                                               ("", lambda kv: f"{kv[1]:+.3f}")]),
                f"(GPU idle in the recompute: {a['gpu_idle_in_the_recompute_diff_ms']:+.3f})\n",
                report.table(c["ops"][:top], [
                    ("op or kernel (key_averages), per step", lambda r: r["name"][:80]),
                    ("calls", lambda r: f"{r['base_calls']:g} -> {r['other_calls']:g}"),
                    ("self CPU ms", lambda r: f"{r['base_self_cpu_ms']:.3f} -> {r['other_self_cpu_ms']:.3f}"),
                    ("self device ms", lambda r: f"{r['base_self_device_ms']:.3f} -> {r['other_self_device_ms']:.3f}"),
                    ("difference", lambda r: f"{r['device_diff_ms' if cuda else 'cpu_diff_ms']:+.3f}")]), "```"]
    out.append("\n## torch.profiler's tables (key_averages of each configuration's profiled steps)\n")
    for name, c in result["configs"].items():
        out += [f"### {name}\n", "```", c["table"], "```"]
    return "\n".join(out) + "\n"
