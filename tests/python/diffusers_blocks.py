"""Which blocks a diffusers model checkpoints, found three ways, for every model class of the sweep
(tiny_diffusers): the installer's (diffusers_adapter.find, which reads the loops of each class's
forward), the model's structure (diffusers_adapter.listed_blocks: the blocks with attention in its
checkpointing modules' lists, which the installer watches where the reading leaves them out:
install/unread.py) and what runs (the modules the model hands its _gradient_checkpointing_func in
one training step, non-reentrant). The facts behind the choice between them.

    python tests/python/diffusers_blocks.py [--models Flux...,Wan...] [--out out/diffusers-blocks.md]

A row per class: the blocks each way, those with attention (diffusers_adapter.has_attention, the
ones the stash would take), and the names only one way finds.
"""
import argparse
import sys
from pathlib import Path

import torch

import tiny_diffusers as tiny
from attnstash.install import diffusers_adapter


def blocks(name):
    """(the model, found by the installer, handed to the checkpoint function in one step):
    {id: (name, module)} each."""
    model, inputs = tiny.build(name)
    model.enable_gradient_checkpointing(tiny.checkpoint_function(False))
    names = {id(m): n for n, m in model.named_modules()}
    found = {id(f.module): (f.name, f.module) for f in diffusers_adapter.find(model) or ()}
    handed = {}
    for module in model.modules():
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        if checkpoint is not None:
            def seeing(fn, *args, _checkpoint=checkpoint, **kwargs):
                block = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", fn)
                handed[id(block)] = (names.get(id(block), repr(block)), block)
                return _checkpoint(fn, *args, **kwargs)
            module._gradient_checkpointing_func = seeing
    tiny.loss_and_grads(model, inputs)
    return model, found, handed


def row(name):
    try:
        model, found, handed = blocks(name)
    except Exception as e:  # the model itself fails: sweep_diffusers.py says why
        return f"| {name} | not run: {type(e).__name__} | | | |"
    attends = {k for k, (_, m) in {**found, **handed}.items()
               if isinstance(m, torch.nn.Module) and diffusers_adapter.has_attention(m)}
    only = lambda a, b: ", ".join(sorted(a[k][0] for k in a.keys() - b.keys())) or "-"  # noqa: E731
    same = "same" if (found.keys() & attends) == (handed.keys() & attends) else "DIFFERENT"
    listed = diffusers_adapter.listed_blocks(model)
    covers = "covers" if handed.keys() & attends <= listed.keys() else "MISSES"
    return (f"| {name} | {len(found)} / {len(handed)} | {len(found.keys() & attends)} / "
            f"{len(handed.keys() & attends)} ({same}) | {only(found, handed)} | {only(handed, found)} | "
            f"{len(listed)} ({covers}) | {only(listed, handed)} |")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="diffusers_blocks.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--out", default="out/diffusers-blocks.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.models.split(",") if args.models else list(tiny.CASES)
    lines = ["| model | blocks: installer / one step | with attention | only the installer's | only the step's "
             "| listed by structure | listed, not handed |", "|---|---|---|---|---|---|---|"] + [row(name) for name in names]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
