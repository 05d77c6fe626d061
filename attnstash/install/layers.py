"""Which layers of a model the installer considers, asked of one adapter per kind of model
(transformers_adapter.py, diffusers_adapter.py, torch_adapter.py). Nothing here needs the
compiled ops: the planner reads it too."""
import operator
from typing import NamedTuple

import torch

from ..errors import InstallError
from . import diffusers_adapter, torch_adapter, transformers_adapter
from .found import ATTR

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


def class_has_attention(cls):
    """Whether a module class calls attention, as one of the adapters reads it (the planner's
    question of the modules its shape-only forward runs)."""
    return transformers_adapter.class_has_attention(cls) or torch_adapter.class_calls_sdpa(cls)


def find_layers(model, layers=None, filter_fn=None):
    """[found.Found] for every layer of the model the installer would consider, in the order of
    model.modules(); their indices are the ones install_attention_stash returns. `layers` or
    `filter_fn(module, fqn) -> bool` (the modules of model.named_modules() it accepts) name the
    checkpointed layers; with neither, the adapters find them."""
    if filter_fn is not None:
        layers = _filtered(model, layers, filter_fn)
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


def _filtered(model, layers, filter_fn):
    """The modules filter_fn(module, fqn) accepts, as layers= would name them."""
    if layers is not None:
        raise InstallError("attnstash: give layers= or filter_fn=, not both: each names the checkpointed layers.")
    if not callable(filter_fn):
        raise InstallError(f"attnstash: filter_fn must be a callable (module, fqn) -> bool, got "
                           f"{type(filter_fn).__name__} {filter_fn!r:.60}.")
    chosen = [m for fqn, m in model.named_modules() if filter_fn(m, fqn)]
    if not chosen:
        raise InstallError(f"attnstash: filter_fn accepted none of the modules of {type(model).__name__} "
                           "(it is called as filter_fn(module, fqn) for each of model.named_modules(), the model "
                           "itself with fqn \"\"): it must return True for the checkpointed layers.")
    return chosen


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


def attention_layers(model, layers=None, filter_fn=None):
    """[AttentionLayer(index, name, module)] of the layers install_attention_stash(model,
    layers=layers, filter_fn=filter_fn) counts: those with attention (and, where it can be seen,
    checkpointed). Printed, one line per layer: index, name, class, and for a stashed layer the
    attention calls of its last training forward."""
    found = find_layers(model, layers, filter_fn)
    return AttentionLayers(AttentionLayer(i, f.name, f.module) for i, f in enumerate(found) if f.stashable)
