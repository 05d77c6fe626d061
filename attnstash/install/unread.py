"""What runs checks the reading of a diffusers model: the blocks with attention its structure
lists (diffusers_adapter.listed_blocks) that the reading of its forward did not find
(diffusers_adapter.find) are watched at their training forwards until what runs tells:
  - a forward inside a backward pass (a checkpoint's recompute): the model checkpoints the block
    and the reading missed it, so its attention forward is recomputed. Said once (StashWarning),
    with the fix;
  - a forward outside any checkpoint (grad on, no saved-tensor hooks): the model does not
    checkpoint it (Lumina2's refiners, UNetMotion's motion modules), as the reading has it.
Either way the block's watch then goes (a forward pre-hook that removes itself), as every watch
of an install does when the install ends. Not watched: eval forwards, forwards torch.compile traces,
and copies of the model (their watches go at their first forward)."""
import sys
import warnings

import torch

from .. import ops
from ..errors import StashWarning
from ..ops import FramePhase
from . import diffusers_adapter

_RECOMPUTE = int(FramePhase.recompute)
_OUTSIDE_CHECKPOINT = int(FramePhase.outside_checkpoint)


class _Watch:
    """The forward pre-hook on one unread block: `name`, its name in `model` (a class name); `handle`,
    its torch.utils.hooks.RemovableHandle; `watching`: False in a copy of the model."""
    __slots__ = ("name", "model", "handle", "watching")

    def __init__(self, name, model, handle=None, watching=True):
        self.name, self.model, self.handle, self.watching = name, model, handle, watching

    def __call__(self, block, args):
        if torch.compiler.is_compiling():
            return None
        if self.watching:
            if not block.training:
                return None
            phase = ops.frame_phase(-1)
            if phase == _RECOMPUTE:
                warnings.warn(missed(self.name, self.model, type(block).__name__), StashWarning)
            elif phase != _OUTSIDE_CHECKPOINT:
                return None  # (not told yet: grad off, or under saved-tensor hooks, a checkpoint's or the user's)
        try:
            self.handle.remove()
        except KeyError:  # (another thread's forward of the block removed it first)
            pass
        return None

    def __reduce__(self):  # deepcopy, torch.save: the copy's hook goes at its first call
        return _Watch, (self.name, self.model, self.handle, False)


def missed(name, model, kind):
    version = getattr(sys.modules.get("diffusers"), "__version__", "?")
    return (f"attnstash: {model} checkpoints its block {name} ({kind}), which has attention (its recompute runs in "
            f"this backward), but attnstash's reading of diffusers {version}'s forward did not find it among the blocks "
            "the model checkpoints: it is not stashed, and its attention forward is recomputed. To stash it, name the "
            "checkpointed blocks yourself: install_attention_stash(model, filter_fn=lambda module, fqn: ...) or "
            "layers=[...] (attnstash.attention_layers(model, layers=...) lists what a choice stashes). Please report "
            "the diffusers release: the reading needs to learn how it checkpoints this block.")


def watch(model, found):
    """Watch the blocks listed_blocks gives and `found` (the layers found, core.Found) neither has
    nor nests in or around; returns their handles (state.Install.watches), [] for a model that is
    not a diffusers one."""
    found_ids = {id(f.module) for f in found}
    inside = {id(m) for f in found for m in f.module.modules()}
    handles = []
    for key, (name, block) in diffusers_adapter.listed_blocks(model).items():
        if key in inside or any(id(m) in found_ids for m in block.modules()):
            continue
        hook = _Watch(name, type(model).__name__)
        hook.handle = block.register_forward_pre_hook(hook)
        handles.append(hook.handle)
    return handles


def stop(handles):
    for handle in handles:
        handle.remove()
