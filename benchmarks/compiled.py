"""compile mode: the decoder trained under torch.compile (the whole model, as
Trainer(torch_compile=True) compiles it), side by side in interleaved rounds:

    compiled, <mode>            compiled checkpointing without the stash (reentrant, non-reentrant)
    compiled + stash, <mode>    the same with the stash on every layer (install/compiled.py)
    compiled SAC                selective checkpointing saving the fused attention ops, compiled
    eager + stash               non-reentrant checkpointing with the stash, not compiled

For each: the graphs dynamo compiled (Counting), the fused attention forwards a step runs
(torch.profiler), the median step, and for the stash and SAC the ms saved per stashed layer
against the compiled run of their mode over one attention forward alone. The losses and
gradients of each compiled run with the stash are compared bitwise with its mode's run without.
Each run is compiled once, before the rounds, with the stash installed before compile traces
(an install is part of what compile traces). Every run compiles under traceable_checkpoints()."""
import contextlib

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

import attnstash
from attnstash.install import compiled as compiled_frames

from .harness import ATTENTION, environment, interleave, median_ms
from attnstash import backends
from .models import attention_forward, build_model, enable_checkpointing, plan, random_batch
from .report import write as write_report

SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def traceable_checkpoints():
    """dynamo's setting under which a checkpointed forward with a side effect compiles (SIDE_EFFECTS
    on, where the installed torch has it). transformers 5.25 requires the `kernels` package, whose
    forward wrappers set a context variable inside attention modules' forwards; by default dynamo
    cannot trace a checkpoint around them, and torch.utils.checkpoint runs it eagerly, with or
    without the stash (attnstash/install/compiled.py, _fell_back, says so)."""
    if not hasattr(torch._dynamo.config, SIDE_EFFECTS):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(**{SIDE_EFFECTS: True})


FORWARD_EVENTS = {f"aten::{row.forward_op.name().split('::')[1].split('.')[0]}"
                  for row in backends.KEPT_BACKENDS if row.forward_op is not None}


class Counting:
    """A torch.compile backend that counts the graphs it is given and their call nodes (their
    subgraphs' included), apart from the compiled frames' markers (`markers`: the nodes of
    attnstash.install.compiled's _frame_open and _frame_close, which AOT autograd does not
    record), then compiles them with `backend` ("aot_eager" or "inductor")."""

    def __init__(self, backend="inductor"):
        self.backend, self.graphs, self.nodes, self.markers = backend, 0, 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        nodes = _call_nodes(gm)
        markers = _call_nodes(gm, lambda node: node.target in MARKERS)
        self.nodes += nodes - markers
        self.markers += markers
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)


MARKERS = (compiled_frames._frame_open, compiled_frames._frame_close)


def _call_nodes(gm, which=lambda node: True):
    count = sum(1 for node in gm.graph.nodes if node.op.startswith("call") and which(node))
    return count + sum(_call_nodes(sub, which) for sub in gm.children() if isinstance(sub, torch.fx.GraphModule))


def attention_forwards(step):
    """How many fused attention forwards step() runs, forward and backward together."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key in FORWARD_EVENTS)


class CompiledRun:
    """One configuration: its own model (the same seeded weights), checkpointed, the stash
    installed or not, compiled or not; step() is one training step on the fixed batch."""

    def __init__(self, name, shape, checkpointing, stash, compiled, backend):
        self.name, self.stash, self.counting = name, stash, Counting(backend) if compiled else None
        self.model = enable_checkpointing(build_model(shape), checkpointing)
        if stash:
            attnstash.install_attention_stash(self.model)
        self.run = torch.compile(self.model, backend=self.counting) if compiled else self.model
        self.ids, self.losses = random_batch(shape), []

    def enter(self):
        self.model.zero_grad(set_to_none=True)

    def exit(self):
        pass

    def step(self):
        loss = self.run(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.losses.append(loss.detach())
        return self.losses[-1]

    def grads(self):
        return [p.grad.clone() for p in self.model.parameters()]

    def close(self):
        if self.stash:
            attnstash.uninstall_attention_stash(self.model)


def compile_mode(shape, args, out):
    modes = ["reentrant", "non-reentrant"] if args.checkpointing == "both" else [args.checkpointing]
    specs = [(f"compiled, {m}", m, False, True) for m in modes] + [(f"compiled + stash, {m}", m, True, True)
                                                                    for m in modes]
    specs += [("compiled SAC", "sac", False, True), ("eager + stash", "non-reentrant", True, False)]
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(specs))
    runs = [CompiledRun(name, shape, kind, stash, compiled, args.backend) for name, kind, stash, compiled in specs]
    with traceable_checkpoints():
        try:
            checks = {}
            for run in runs:  # compiles (untimed), then the check step: attention forwards and gradients
                run.enter(), run.step(), run.enter()
                forwards = attention_forwards(run.step)
                checks[run.name] = {"graphs": run.counting.graphs if run.counting else 0,
                                    "nodes": run.counting.nodes if run.counting else 0,
                                    "attention_forwards_per_step": forwards, "grads": run.grads()}
            planned = plan(runs[0].model, shape)
            call = planned.layers[-1].calls[0]
            times = interleave(runs, args.repeats, args.warmup, "compile",
                               attention=attention_forward(call, shape.device, planned.dtype))
        finally:
            for run in runs:
                run.close()
    attention_ms = median_ms(times[ATTENTION])
    by_name = {run.name: run for run in runs}
    references = {**{f"compiled + stash, {m}": f"compiled, {m}" for m in modes},
                  "compiled SAC": f"compiled, {modes[-1]}"}
    table = []
    for run in runs:
        row = {"name": run.name, "median_ms": median_ms(times[run.name]),
               **{k: v for k, v in checks[run.name].items() if k != "grads"}}
        reference = by_name.get(references.get(run.name))
        if reference is not None:
            saved = (median_ms(times[reference.name]) - row["median_ms"]) / shape.layers
            row.update(reference=reference.name, saved_ms_per_layer=saved, efficiency=saved / attention_ms)
            if run.stash:
                row["bitwise_vs_reference"] = (
                    all(torch.equal(a, b) for a, b in zip(run.losses, reference.losses))
                    and all(torch.equal(a, b) for a, b in zip(checks[run.name]["grads"],
                                                              checks[reference.name]["grads"])))
        table.append(row)
    report = {"mode": "compile", "shape": shape.describe(), "backend": args.backend,
              "attention_forward_ms": attention_ms, "rounds": {"warmup": args.warmup, "repeats": args.repeats},
              "configs": table, "environment": environment(shape.device),
              "dynamo": {SIDE_EFFECTS: hasattr(torch._dynamo.config, SIDE_EFFECTS)}}
    side_effects = f", dynamo's {SIDE_EFFECTS} on" if hasattr(torch._dynamo.config, SIDE_EFFECTS) else ""
    print(f"compile mode, {shape.describe()}, backend {args.backend}{side_effects}; "
          f"attention forward alone {attention_ms:.3f} ms")
    print(f"{'configuration':32} {'graphs':>6} {'nodes':>6} {'attn/step':>9} {'step ms':>9} {'saved/layer':>11} "
          f"{'efficiency':>10}  bitwise")
    for r in table:
        saved = f"{r['saved_ms_per_layer']:11.3f} {r['efficiency']:10.2f}" if "saved_ms_per_layer" in r else " " * 22
        print(f"{r['name']:32} {r['graphs']:6} {r['nodes']:6} {r['attention_forwards_per_step']:9} "
              f"{r['median_ms']:9.2f} {saved}  {r.get('bitwise_vs_reference', '')}")
    write_report(out, "compile", report)
    return report
