"""What the installer needs to know of models in plain PyTorch.

Layers found by themselves: the modules torch's checkpoint_wrapper wraps (CheckpointWrapper,
torch.distributed.algorithms._checkpoint.checkpoint_wrapper, as torchtitan and FSDP recipes
apply it), in the order of model.modules(). A layer has attention if one of its module classes
calls F.scaled_dot_product_attention (read from its code: found.calls_any) or is
torch.nn.MultiheadAttention. Layers the user names (layers=: a module class, or modules) are
taken as given. Either way the checkpoint runs the layer module itself (MODULE_CALL).
"""
import functools

import torch

from ..errors import InstallError
from .found import Found, MODULE_CALL, calls_any


@functools.lru_cache(maxsize=None)
def class_calls_sdpa(cls):
    """Whether a module class (or a base class of it outside torch) calls
    F.scaled_dot_product_attention, or is torch.nn.MultiheadAttention."""
    if issubclass(cls, torch.nn.MultiheadAttention):
        return True
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            continue
        if calls_any(klass, ("scaled_dot_product_attention",)):
            return True
    return False


def has_attention(module):
    return any(class_calls_sdpa(type(m)) for m in module.modules())


def _wrapper_class():
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch built without torch.distributed
        return None
    return CheckpointWrapper


def find(model):
    """[core.Found] for the modules checkpoint_wrapper wraps, or None if there are none."""
    wrapper = _wrapper_class()
    if wrapper is None:
        return None
    found = [Found(m._checkpoint_wrapped_module, f"{name}._checkpoint_wrapped_module" if name else
                        "_checkpoint_wrapped_module", has_attention(m._checkpoint_wrapped_module), MODULE_CALL)
             for name, m in model.named_modules() if isinstance(m, wrapper)]
    return found or None


def wrapped_modules(model):
    """The ids of the modules checkpoint_wrapper wraps in `model` (a transformers layer that
    FSDP's activation checkpointing wraps is checkpointed with its own gradient_checkpointing off)."""
    return {id(f.module) for f in find(model) or ()}


def named(model, layers, reach):
    """[core.Found] for the layers a user names: a module class (its instances in the model, in
    the order of model.modules()) or an iterable of the model's modules. `reach(module)` says
    how an adapter reaches one (None: a module call)."""
    names = {id(m): name for name, m in model.named_modules()}
    if isinstance(layers, type):
        if not issubclass(layers, torch.nn.Module):
            raise InstallError(f"attnstash: layers= must be a torch.nn.Module subclass or an iterable of modules, got "
                               f"the class {layers.__name__}.")
        modules = [m for m in model.modules() if isinstance(m, layers)]
        if not modules:
            raise InstallError(f"attnstash: layers={layers.__name__}, but {type(model).__name__} has no module of that "
                               "class.")
    else:
        try:
            modules = list(layers)
        except TypeError:
            raise InstallError(f"attnstash: layers= must be a torch.nn.Module subclass or an iterable of modules, got "
                               f"{type(layers).__name__}.") from None
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                raise InstallError(f"attnstash: layers= holds {type(m).__name__} {m!r:.60}, not a torch.nn.Module.")
            if id(m) not in names:
                raise InstallError(f"attnstash: layers= holds a {type(m).__name__} that is not a module of "
                                   f"{type(model).__name__}.")
        if len({id(m) for m in modules}) != len(modules):
            raise InstallError("attnstash: layers= holds the same module twice.")
        if not modules:
            raise InstallError("attnstash: layers= is empty.")
        order = {id(m): i for i, m in enumerate(model.modules())}
        modules.sort(key=lambda m: order[id(m)])
    return [Found(m, names[id(m)], True, reach(m) or MODULE_CALL) for m in modules]


def describe(model):
    return "modules wrapped by torch's checkpoint_wrapper (CheckpointWrapper)"
