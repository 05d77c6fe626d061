"""Which layers of a model the installer considers, asked of one adapter per kind of model
(transformers_adapter.py, diffusers_adapter.py, torch_adapter.py). Nothing here needs the
compiled ops: the planner reads it too."""
import functools
import inspect
import operator
import re
import sys
from typing import NamedTuple

import torch

from ..errors import InstallError

CHECKPOINT_FUNCTION, MODULE_CALL = "checkpoint function", "module call"  # how a layer is reached: core.py
ATTR = "_attnstash"  # a stashed layer's core.LayerStash, in its __dict__


class Found(NamedTuple):
    """A layer an adapter found: the module, its name in the model, whether it is one to stash
    (it has attention, and is checkpointed where that can be seen), and how it is reached."""
    module: torch.nn.Module
    name: str
    stashable: bool
    reach: str


def source_calls(klass, words):
    """Whether a class calls one of `words` (names of attention functions) as the adapters read
    it: its source names one, or names a function of its own module whose source does, directly
    or as a value of a module-level dict (the table ModernBERT's attention picks its function
    from)."""
    source = source_of(klass)
    if any(w in source for w in words):
        return True
    module = sys.modules.get(klass.__module__)
    for name in set(re.findall(r"[A-Za-z_]\w*", source)):
        value = getattr(module, name, None)
        for f in (value.values() if isinstance(value, dict) else (value,)):
            if inspect.isfunction(f) and f.__module__ == klass.__module__ and any(w in source_of(f) for w in words):
                return True
    return False


@functools.lru_cache(maxsize=None)
def source_of(obj):
    """An object's source ("" where there is none: a builtin, a class made at run time)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


from . import diffusers_adapter, torch_adapter, transformers_adapter  # noqa: E402 (they use Found)

ADAPTERS = (transformers_adapter, diffusers_adapter, torch_adapter)  # asked in this order (layers=None)


def layer_count(num_layers):
    """num_layers as an int (what operator.index accepts, bools refused) or None; InstallError
    otherwise. Whether it fits the model is install_attention_stash's to check."""
    if num_layers is None:
        return None
    if isinstance(num_layers, bool):
        raise InstallError(f"attnstash: num_layers must be an int or None, got the bool {num_layers!r}.")
    try:
        return operator.index(num_layers)
    except TypeError:
        raise InstallError(f"attnstash: num_layers must be an int or None, got {type(num_layers).__name__} "
                           f"{num_layers!r}.") from None


def find_layers(model, layers=None):
    """[core.Found] for every layer of the model the installer would consider, in the order of
    model.modules(); their indices are the ones install_attention_stash returns."""
    if layers is not None:
        return torch_adapter.named(model, layers, transformers_adapter.reach)
    for adapter in ADAPTERS:
        found = adapter.find(model)
        if found:
            return found
    raise InstallError(
        f"attnstash: found no layers to stash in {type(model).__name__}: looked for "
        + "; for ".join(adapter.describe(model) for adapter in ADAPTERS)
        + ". Name them with layers= (a module class, or the modules its checkpoint calls).")


class AttentionLayer(NamedTuple):
    """A layer install_attention_stash counts: its index (what num_layers and the install's
    result count), its name in the model, and the module. Unpacks as (index, name, module);
    prints as one line."""
    index: int
    name: str
    module: torch.nn.Module

    def __repr__(self):
        stash = self.module.__dict__.get(ATTR)
        calls = getattr(stash, "calls", None)
        return (f"{self.index:>3}  {self.name or '(the model)'}  {type(self.module).__name__}"
                + ("" if stash is None else "  stashed")
                + ("" if calls is None else f", {calls} attention call{'s' if calls != 1 else ''} per forward"))


class AttentionLayers(list):
    """attention_layers' result: a list of AttentionLayer that prints one line per layer."""

    def __repr__(self):
        return "\n".join(map(repr, self)) if self else "(no attention layers)"

    __str__ = __repr__


def attention_layers(model, layers=None):
    """[AttentionLayer(index, name, module)] of the layers install_attention_stash(model,
    layers=layers) counts: those with attention (and, where it can be seen, checkpointed).
    Printed, one line per layer: index, name, class, and for a stashed layer the attention
    calls of its last training forward."""
    return AttentionLayers(AttentionLayer(i, f.name, f.module) for i, f in enumerate(find_layers(model, layers))
                           if f.stashable)
