"""What the installer holds for the whole process, for each install and for each thread: stated
here once, below core.py and compiled.py, which both read it (none reaches into
another's privates for it). Not kept here: the phase each forward starts in (the ops read it
from torch's autograd state, ops.frame_phase) and the slots each layer keeps under (the registry
hands out their ranges, ops.new_slot_base)."""
import itertools
import threading
import weakref

import torch

from ..errors import CheckpointingError

lock = threading.RLock()  # installs, uninstalls, and the patch of transformers' layer class
live = weakref.WeakSet()  # every core.LayerStash in use (deep copies of models included)


class Install:
    """One install_attention_stash, or a deep copy of a model that has one: what its layers
    (core.LayerStash.install) share. `offload`: its offload.Own, or None; `budget`: whether it set a
    budget (budget.push, with this object as the token); `layers`: how many of its layers are
    still stashed. The install ends with the last of them (installer.py gives its budget back);
    `compile_fell_back`: whether compiled.py has said that a checkpoint it traced ran eagerly;
    `watches`: the hooks on the blocks unread.py watches, which go when the install ends."""
    __slots__ = ("offload", "budget", "layers", "compile_fell_back", "watches")

    def __init__(self, offload=None):
        self.offload, self.budget, self.layers, self.compile_fell_back = offload, False, 0, False
        self.watches = []

    def __reduce__(self):
        # A copy of a model (attaching.copy_of) gets an install of its own: an offload of
        # its own if the original has one, no budget (the original's lasts as long as its install).
        return Install, (self.offload,)


class _Thread(threading.local):
    """What one thread runs: `reached`, {a stashed layer's slot base: first forwards its Runs
    started} (core.Run). Read as an attribute (`state.thread.reached`) on the installer's hot path.
    (The frames of stashed layers' forwards are native: torch_ops/frames.h.)"""

    def __init__(self):
        self.reached = {}


thread = _Thread()


def _callback_unknown():
    return True


dynamo_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback",
                          _callback_unknown)
"""dynamo's frame callback: None in plain eager, set where a torch.compile'd caller runs code
eagerly (core.stashed_forward turns it off there); taken as set where a torch release does not
say."""


def anchor_of(stash, args, kwargs, more_kwargs=None):
    """A stashed layer's input, what its forward anchors on: its first tensor argument
    (positional first, then keyword, then `more_kwargs`, a checkpointed partial's keywords)."""
    if args and isinstance(args[0], torch.Tensor):  # (the common case, without the chain)
        return args[0]
    for value in itertools.chain(args, kwargs.values(), (more_kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return value
    raise CheckpointingError(f"attnstash: {stash.name} was called without a tensor argument; the stash anchors on "
                             "the layer's input (its first tensor argument).")
