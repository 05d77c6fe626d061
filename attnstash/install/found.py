"""What the adapters report of a model's layers (Found: the module, its name, whether to
stash it, how it is reached), and the reading of class code they share. Below layers.py,
which asks the adapters, and the adapters, which import this; nothing here needs the ops."""
import enum
import functools
import inspect
import types
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


def calls_any(klass, words):
    """Whether a class's code calls one of `words` (names of attention functions), as the adapters
    read it from the code Python runs (its methods' code objects, not their source text: a
    docstring or a comment that mentions one does not count, and a class made at run time, with
    no source, is read like any other): a method of its own refers to one by name (a global, an
    attribute, or the string getattr takes), or refers to a global, directly or as a value of a
    module-level dict (the table ModernBERT's attention picks its function from), that is one of
    them under another name or a function of the class's own module whose code names one."""
    words = frozenset(words)
    functions = list(_functions_of(klass))
    if any(_names(f.__code__) & words for f in functions):
        return True
    for function in functions:
        for name in _names(function.__code__):
            value = function.__globals__.get(name)
            for f in (value.values() if isinstance(value, dict) else (value,)):
                if not callable(f):
                    continue
                if _name_of(f) in words:  # the function itself, by another name
                    return True
                if inspect.isfunction(f) and f.__module__ == klass.__module__ and \
                        any(_names(g.__code__) & words for g in _as_written(f)):
                    return True
    return False


def _functions_of(klass):
    """The functions a class defines itself (methods, static and class methods, properties'
    accessors), each with what it wraps (_as_written)."""
    for value in vars(klass).values():
        for f in ((value.fget, value.fset, value.fdel) if isinstance(value, property)
                  else (_attribute(value, "__func__", value),)):
            if inspect.isfunction(f):
                yield from _as_written(f)


def _as_written(f):
    """A function and the functions it wraps (functools.wraps decorators: __wrapped__), outermost
    first; a wrapped object that is not a Python function ends the chain."""
    seen = []
    while inspect.isfunction(f) and not any(f is g for g in seen):
        seen.append(f)
        f = _attribute(f, "__wrapped__", None)
    return seen


def _attribute(obj, name, default):
    """getattr(obj, name, default), for objects whose attribute lookup raises something else."""
    try:
        return getattr(obj, name, default)
    except Exception:
        return default


def _name_of(f):
    name = _attribute(f, "__name__", None)
    return name if isinstance(name, str) else None


@functools.lru_cache(maxsize=None)
def _names(code):
    """Every name a code object and the code nested in it (inner functions, lambdas,
    comprehensions) refer to: globals and attributes, and strings made only of an identifier."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
        elif isinstance(const, str) and const.isidentifier():
            names.add(const)
    return frozenset(names)
