"""What the adapters report of a model's layers (Found: the module, its name, whether to
stash it, how it is reached), and the reading of class source they share. Below layers.py,
which asks the adapters, and the adapters, which import this; nothing here needs the ops."""
import enum
import functools
import inspect
import re
import sys
from typing import NamedTuple

import torch


class Reach(enum.Enum):
    """How a stashed layer's checkpointed forward is reached (core.py says what each means)."""
    CHECKPOINT_FUNCTION = "checkpoint function"
    MODULE_CALL = "module call"


CHECKPOINT_FUNCTION, MODULE_CALL = Reach.CHECKPOINT_FUNCTION, Reach.MODULE_CALL
ATTR = "_attnstash"  # a stashed layer's core.LayerStash, in its __dict__


class Found(NamedTuple):
    """A layer an adapter found: the module, its name in the model, whether it is one to stash
    (it has attention, and is checkpointed where that can be seen), and how it is reached."""
    module: torch.nn.Module
    name: str
    stashable: bool
    reach: Reach


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
