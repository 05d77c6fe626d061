"""What makes a layer stashed, and what undoes it: the entries attach puts in its __dict__ (its
core.LayerStash, its forward, core.stashed_forward bound to it, and the methods by which others
copy it, BOUND) and detach removes. Copies of a stashed layer are stashed too (copy_of,
replica_of): their methods are bound to the copy, never to the original, whose forward would
run the original's modules."""
import types

from . import core, state, transformers_adapter
from .found import ATTR, CHECKPOINT_FUNCTION


def attach(layer, index, name, reach, install):
    """Stash one layer of `install` (a state.Install; the caller holds state.lock)."""
    stash = core.LayerStash(index, name, reach, install, type(layer).forward, type(layer).__name__)
    previous = layer.__dict__.get("forward")
    if previous is not None:
        layer.__dict__[core.PREVIOUS] = previous
    layer.__dict__[ATTR] = stash
    layer.__dict__["forward"] = types.MethodType(core.stashed_forward, layer)
    _bind(layer)
    return stash


def _ours(forward):
    """Whether a layer's `forward` entry is the stash's (not one set over it since the install)."""
    return getattr(forward, "__func__", None) is core.stashed_forward


def detach(layer):
    """Unstash one layer; its state.Install if that was the install's last layer, else None."""
    stash = layer.__dict__.pop(ATTR, None)
    for name in BOUND:
        layer.__dict__.pop(name, None)
    forward = layer.__dict__.get("forward")
    if _ours(forward):  # (one set over it since stays, and passes through)
        previous = layer.__dict__.pop(core.PREVIOUS, None)
        if previous is None:
            del layer.__dict__["forward"]
        else:
            layer.__dict__["forward"] = previous
    if stash is None:
        return None
    state.live.discard(stash)
    stash.install.layers -= 1
    return None if stash.install.layers else stash.install


def copy_of(layer, protocol):
    """How a stashed layer is copied (copy.copy, copy.deepcopy, pickle: torch.save(model), then
    torch.load), in place of the default, which would copy its forward as a method bound to the
    original (pickled: a lookup of the name stashed_forward) and its stash with the original's
    slots: the copy is made stashed (copied), and gets the rest of the layer's state as usual.
    Its stash has slots of its own and shares an install with the other layers of its copy (the
    install's own state.Install.__reduce__); nothing the original holds or kept comes with it."""
    stash = layer.__dict__[ATTR]
    rest = layer.__getstate__()
    for name in (ATTR, *BOUND):
        rest.pop(name)
    if _ours(rest.get("forward")):  # (copied binds its own)
        del rest["forward"]
    return copied, (type(layer), stash.index, stash.name, stash.reach, stash.install), rest


def replica_of(layer):
    """torch.nn.parallel.replicate's copy of a stashed layer (DataParallel: one per device and
    forward, run in threads): Module's own (a copy of the layer's __dict__, its parameters' copies
    on the replica's device set on it after), with the layer's methods bound to the replica. The
    replicas share the layer's stash: their records are told apart by their anchors, their inputs."""
    replica = type(layer)._replicate_for_data_parallel(layer)
    if _ours(replica.__dict__.get("forward")):
        replica.__dict__["forward"] = types.MethodType(core.stashed_forward, replica)
    _bind(replica)
    return replica


BOUND = {"__reduce_ex__": copy_of, "_replicate_for_data_parallel": replica_of}  # name: function


def _bind(layer):
    """Binds BOUND's methods to a stashed layer (attach, replica_of)."""
    for name, function in BOUND.items():
        layer.__dict__[name] = types.MethodType(function, layer)


def copied(cls, index, name, reach, install):
    """A copy of a stashed layer, stashed as its original was, before the rest of its state is set
    (copy_of). Every pickled stashed layer names this function: its module and name stay. Where
    the copy is made in a process where no install has patched transformers' layer class yet
    (torch.load), it is patched."""
    layer = cls.__new__(cls)
    with state.lock:
        if reach is CHECKPOINT_FUNCTION:
            transformers_adapter.patch(core.stand_in)
        attach(layer, index, name, reach, install)
    return layer
