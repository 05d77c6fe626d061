"""How attention calls reach a stashed layer's frame: while any stash is installed,
F.scaled_dot_product_attention is `route`, and so is every module-level name bound to it (code
that imported it by name before the install); `route` is torch's own function outside the frames
(core.py) and, while torch.compile traces, what compiled.attend says."""
import gc
import sys

import torch
import torch.nn.functional as F

from . import compiled, state

_SDPA = F.scaled_dot_product_attention  # torch's own
_rebound = []  # [(module dict, name)] bound to `route` in place of _SDPA


def route(*args, **kwargs):
    """F.scaled_dot_product_attention while a stash is installed: inside the frame of a
    stashed layer's forward that keeps, attnstash::sdpa_fwd_keep on the frame's anchor and next
    slot; while torch.compile traces, what compiled.attend says; anywhere else torch's own function."""
    if torch.compiler.is_compiling():
        return compiled.attend(_SDPA, args, kwargs)
    frames = state.thread.frames
    if not frames or not frames[-1].keep:
        return _SDPA(*args, **kwargs)
    frame = frames[-1]
    try:
        return frame.attend(*args, **kwargs)
    except TypeError as e:
        if e.__traceback__.tb_next is not None:  # raised inside attend, not by binding its arguments
            raise
        raise frame.bad_arguments(e, args, kwargs) from None


def patch():
    """Make F.scaled_dot_product_attention, and every module-level name bound to it, `route`
    (once: while any stash is installed)."""
    if _rebound:
        return
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is torch._C._nn or names is globals():
            continue
        for name, value in list(names.items()):
            if value is _SDPA:
                names[name] = route
                _rebound.append((names, name))


def unpatch_if_unused():
    """Once no stash is in use (models dropped without an uninstall are collected first), every
    name `patch` bound is torch's own function again. Returns whether it is."""
    if state.live:
        gc.collect()
    if state.live:
        return False
    while _rebound:
        names, name = _rebound.pop()
        if names.get(name) is route:
            names[name] = _SDPA
    return True
