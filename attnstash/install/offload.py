"""Offloading what the stash keeps. After a stashed layer's first forward, the output and
log-sum-exp of each record it kept leave the device, and they come back before its recompute,
by one of two movers:
  - Hooks, the user's offloading: the saved-tensor hooks around the layer's checkpoint
    (save_on_cpu, transformers' offload=True, TRL's activation offloading, any pair). The
    records go through their pack, and their unpack brings them back.
  - Own, attnstash's offload (install_attention_stash(offload=True), ATTNSTASH_OFFLOAD=1):
    pinned host memory, copies on a side stream, and the records of the forward recomputed next
    fetched while the current recompute runs, so that the device holds about two layers'
    records at a time. On a CPU the records are in host memory already: it moves nothing.
While moved, a record's bytes count in stash_stats()["moved_bytes"], not in "bytes", so the
budget caps only what stays on the device (csrc/stash_registry.h, moved). The moved tensors
live in a Moved, held by what ties the recompute to its forward (core.Run, module_call.Pending):
a forward whose graph is dropped drops them with it.
"""
import threading
import weakref

import torch

from .. import ops
from ..ops import FramePhase
from ..errors import ReplayError

_lock = threading.Lock()


_HOOKED = (int(FramePhase.non_reentrant_first), int(FramePhase.reentrant_first_hooked))  # (ints: on the hot path)
_REENTRANT_FIRST = int(FramePhase.reentrant_first)


def may_move(stash, phase):
    """Whether what a first forward starting in `phase` (ops.frame_phase) keeps may be moved off
    the device after it: under saved-tensor hooks (the user's offloading around a reentrant
    checkpoint, a non-reentrant checkpoint's own over any of the user's), or, a reentrant one, with
    the layer's own offload. (mover_for says by what.)"""
    return phase in _HOOKED or (phase == _REENTRANT_FIRST and stash.install.offload is not None)


def mover_for(stash, layer_input, grad):
    """The mover of a first forward that keeps: the layer's own offload where installed (None
    where it takes nothing: a layer input in host memory), else the user's saved-tensor hooks
    around its checkpoint, else None. A non-reentrant checkpoint (grad on) pushes its own hooks
    over the user's: those are the pair below the top."""
    own = stash.install.offload
    if own is not None:
        return own if own.takes(layer_input) else None
    if grad and ops.saved_tensor_hooks_depth() < 2:  # only the checkpoint's own (the common case: no pop and push)
        return None
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or not grad:
        return None if top is None else Hooks(*top)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks(*top)
    return None if below is None else Hooks(*below)


def move_out(mover, records):
    """Move the records one first forward kept (ids) off the device: a Moved, or None if none
    was moved."""
    moved = []
    for record in records:
        tensors = ops.move_out(record)
        if tensors:
            moved.append((record, [mover.pack(t) for t in tensors]))
    return Moved(mover, moved) if moved else None


def put_back(record, tensors):
    try:
        ops.move_in(record, *tensors)
    except RuntimeError as e:
        if not str(e).startswith("attnstash"):
            raise
        raise ReplayError(str(e).split("\n")[0]) from None


class Moved:
    """One forward's moved records, [(id, [packed output, packed log-sum-exp])], and their mover."""
    __slots__ = ("mover", "records", "fetching", "__weakref__")

    def __init__(self, mover, records):
        self.mover, self.records, self.fetching = mover, records, None
        mover.moved(self)

    def fetch(self):
        """Before the recompute: the records back in the stash."""
        if self.records:
            self.mover.fetch(self)
            self.records = []


class Hooks:
    """The user's saved-tensor hooks as a mover."""
    __slots__ = ("pack", "unpack")

    def __init__(self, pack, unpack):
        self.pack, self.unpack = pack, unpack

    def moved(self, moved):
        pass

    def fetch(self, moved):
        for record, packed in moved.records:
            put_back(record, [self.unpack(p) for p in packed])


class Own:
    """attnstash's offload: each kept tensor copied to pinned host memory on a side stream; the
    install's forwards' Moved in order, so that a recompute, which comes in the reverse order
    (on the autograd engine's thread), fetches its own records (waiting only if they were not
    fetched ahead) and starts fetching those of the forward before it. `takes`, `to_host`,
    `to_device`, `event` and `wait` are the device steps (a test stands in for them on a CPU)."""

    def __init__(self):
        self._forwards = []  # weak references to Moved, in forward order
        self._order_lock = threading.Lock()

    def __reduce__(self):
        return type(self), ()  # a copy's (state.Install.__reduce__) moves only its own forwards' records

    def moved(self, moved):
        with self._order_lock:
            self._forwards = [m for m in self._forwards if m() is not None and m().records]
            self._forwards.append(weakref.ref(moved))

    def takes(self, tensor):
        return tensor.device.type != "cpu"

    def pack(self, tensor):
        return self.to_host(tensor)

    def fetch(self, moved):
        if moved.fetching is None:
            ops.count_offload_wait()
            self.start(moved)
        fetched, event = moved.fetching
        self.wait(event, fetched)
        for (record, _), tensors in zip(moved.records, fetched):
            put_back(record, tensors)
        moved.fetching = None
        with self._order_lock:
            forwards = self._forwards
            index = next((i for i, m in enumerate(forwards) if m() is moved), None)
            if index is None:
                return
            del forwards[index]
            ahead = next((m() for m in reversed(forwards[:index]) if m() is not None and m().records), None)
        if ahead is not None and ahead.fetching is None:
            self.start(ahead)

    def start(self, moved):
        """Start copying a forward's records back to their device."""
        fetched = [[self.to_device(p) for p in packed] for _, packed in moved.records]
        moved.fetching = (fetched, self.event())

    # ---- the device steps ----
    def to_host(self, tensor):
        stream = _side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done
        return tensor.device, host

    def to_device(self, packed):
        device, host = packed
        if device is None:
            return host
        with torch.cuda.stream(_side_stream(device)):
            return host.to(device, non_blocking=True)

    def event(self):
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        event = torch.cuda.Event()
        event.record(_side_stream(torch.device("cuda", torch.cuda.current_device())))
        return event

    def wait(self, event, fetched):
        if event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(event)
            for tensors in fetched:
                for t in tensors:
                    t.record_stream(stream)  # (allocated on the side stream, used and freed on this one)


_streams = {}


def _side_stream(device):
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream
