"""--mode opcodes: the Python the stash runs per stashed layer and step, counted exactly in
bytecode instructions (sys.settrace's opcode events), in about a minute: the same training steps
as --mode instructions (instructions.build: the tiny Qwen3 decoder, 4 layers, batch 1 x 16 tokens,
one thread), for attnstash through transformers' checkpoint function and through a module call,
and for the seed's design (reentrant only), each checked bitwise against the plain step first.

Per stashed layer: (one step with the stash on every layer - one on 0 layers) / layers, in
opcodes executed by every Python function (torch's, transformers', the stash's), with the
functions whose count changed most beside it. Deterministic: the same counts on every run and
machine for the same releases, where callgrind's instructions (--mode instructions) move with
heap layout by up to about 20,000 a layer. It counts the Python only: the native work (the ops,
torch's own kernels, what a Python call costs in C) is --mode instructions'.

    python -m benchmarks --mode opcodes
"""
import collections
import sys

import torch

from . import report
from .instructions import DESIGNS, LAYERS, build, check, configs

ROWS = 12  # functions listed per design and mode


def count(config, mode, warmup=3):
    """{(file, function): opcodes} of one training step of `config`, after `warmup` steps."""
    torch.set_num_threads(1)
    _, step, undo = build(config, mode)
    for _ in range(warmup):
        step()
    counts = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            code = frame.f_code
            counts[code.co_filename, code.co_name] += 1
        return tracer

    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
        undo()
    return counts


def _where(file, function):
    """file:function, the file from its package on (transformers/..., attnstash/..., python3.11/...)."""
    for marker, prefix in (("site-packages/", ""), ("/attnstash/", "attnstash/"), ("/benchmarks/", "benchmarks/"),
                           ("/lib/python", "python")):
        if marker in file:
            return f"{prefix}{file.split(marker, 1)[1]}:{function}"
    return f"{file}:{function}"


def opcodes_mode(shape, args, out):
    result = {"mode": "opcodes", "layers": LAYERS, "per_step": {}, "per_stashed_layer": {}, "by_function": {}}
    for mode in ("reentrant", "non-reentrant"):
        check(mode)
        counts = {config: count(config, mode) for config in configs(mode)}
        result["per_step"][mode] = {config: sum(c.values()) for config, c in counts.items()}
        result["per_stashed_layer"][mode], result["by_function"][mode] = {}, {}
        for design in DESIGNS:
            if f"{design}-all" not in counts:
                continue
            every, none = counts[f"{design}-all"], counts[f"{design}-0"]
            result["per_stashed_layer"][mode][design] = (sum(every.values()) - sum(none.values())) / LAYERS
            changed = {k: (every[k] - none[k]) / LAYERS for k in every.keys() | none.keys() if every[k] != none[k]}
            result["by_function"][mode][design] = {
                _where(*k): n for k, n in sorted(changed.items(), key=lambda kv: -abs(kv[1]))[:ROWS]}
    print("Python opcodes per stashed layer and step (one step with the stash on every layer - on 0 layers) / "
          f"{LAYERS}:")
    for mode, designs in result["per_stashed_layer"].items():
        for design, n in designs.items():
            print(f"\n  {mode:>13}, {design:>10}: {n:+8.1f}")
            for where, k in result["by_function"][mode][design].items():
                print(f"      {k:+8.1f}  {where}")
    report.write(out, "opcodes", result)
    return result
