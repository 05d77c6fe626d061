"""The tie between a MODULE_CALL layer's first forward and its recompute under saved-tensor
hooks (core.py, Anchor).

Such a layer's checkpoint is not seen from outside, so no Run holds a token for the checkpoint
call. Under saved-tensor hooks (a non-reentrant checkpoint's own, and the user's offloading)
the recompute may be handed a copy of the layer input, at another address: the ops then anchor
on a token made for the first forward (ops.new_token: a 0-dim CPU tensor that requires grad,
which hooks that offload never copy), in a Pending entry that the layer's stash
lists until its record is gone (with the layer's own offload too: the entry holds what
offload.py moved). The entry lives as long as the graph that can recompute the forward: it is
held by the grad_fn of the layer input (the node before the checkpoint), else, for a
non-reentrant checkpoint (whose records its own graph node owns), by the list until that
record is gone. A recompute takes the token whose first forward's input it was
handed (the same tensor, where the hooks did not copy it), else the one pending token; more
than one it cannot tell apart, and says so.
"""
import weakref

import torch

from .. import ops
from ..ops import FramePhase
from ..errors import CheckpointingError, ReplayError
from . import offload

_HELD = "attnstash_tokens"  # the key of the tokens a grad_fn holds, in its metadata


class Pending:
    """One first forward awaiting its recompute: its token, its layer input (weakly), what
    offload.py moved off the device after it (or None), and whether it ran in a non-reentrant
    checkpoint (whose saved tensors then expect its recompute to replay: awaiting_a_replay)."""
    __slots__ = ("token", "layer_input", "moved", "non_reentrant", "__weakref__")

    def __init__(self, token, layer_input, non_reentrant):
        self.token, self.layer_input, self.moved = token, weakref.ref(layer_input), None
        self.non_reentrant = non_reentrant


def _entry(held):
    return held() if isinstance(held, weakref.ref) else held


def _live(stash):
    """The pending first forwards whose record is still held (the others are dropped)."""
    kept, live = [], []
    for held in stash.pending:
        entry = _entry(held)
        if entry is not None and ops.record_id(entry.token, stash.slot_base):
            kept.append(held)
            live.append(entry)
    stash.pending = kept
    return live


def _handed(entry, layer_input):
    """Whether the recompute was handed the very input of this entry's first forward."""
    original = entry.layer_input()
    return original is layer_input or (original is not None and original.data_ptr() == layer_input.data_ptr()
                                       and original.shape == layer_input.shape)


def _may_be_a_copy(entry, layer_input):
    """Whether a recompute's input that is not this entry's first forward's input may be a copy of
    it, as hooks that offload hand one: that input is gone (as it is once hooks that copy it
    hold the copy only), or it is alive and equal to it."""
    original = entry.layer_input()
    return original is None or (original.shape == layer_input.shape and original.dtype == layer_input.dtype
                                and original.device == layer_input.device and torch.equal(original, layer_input))


def pending_for(stash, layer_input, phase):
    """The Pending entry whose token a MODULE_CALL layer's forward anchors on in place of its
    input, or None (the input). `phase`: the forward's (ops.frame_phase)."""
    if phase == FramePhase.recompute:
        return _for_recompute(stash, layer_input)
    if offload.may_move(stash, phase):
        return _for_first_forward(stash, layer_input, phase == FramePhase.non_reentrant_first)
    return None


def _for_first_forward(stash, layer_input, grad):
    """A new entry for a first forward under saved-tensor hooks (or with the layer's own
    offload), or None where none can be held for as long as its recompute may come (a reentrant
    checkpoint of a leaf input: core.run_frame refuses it under hooks)."""
    holder = layer_input.grad_fn
    if holder is None and not grad:
        return None
    _live(stash)
    entry = Pending(ops.NEW_TOKEN(), layer_input, grad)
    if holder is not None:  # the graph holds it; the layer only looks it up
        holder.metadata.setdefault(_HELD, []).append(entry)
        stash.pending.append(weakref.ref(entry))
    else:  # a non-reentrant checkpoint: its own node owns the record, which _live follows
        stash.pending.append(entry)
    return entry


def awaiting_a_replay(stash):
    """How many of this layer's non-reentrant first forwards, each in a frame of its own (its
    checkpoint calls the module), await their recompute with their records held. Their
    checkpoint saved what the stash's op saves, and recomputes by calling the layer module."""
    return sum(1 for entry in _live(stash) if entry.non_reentrant) if stash.pending else 0


def _for_recompute(stash, layer_input):
    """The entry of the first forward this recompute repeats, its moved records fetched back, or
    None if no first forward is pending (the ops then look for the layer input itself, and say
    what they miss)."""
    if not stash.pending:
        return None
    live = _live(stash)
    entry = None
    for candidate in live:
        if _handed(candidate, layer_input):
            entry = candidate
            break
    if entry is None and len(live) == 1:
        if not _may_be_a_copy(live[0], layer_input):
            raise ReplayError(
                f"attnstash: {stash.name}: its recompute was handed an input that is neither the input of the one "
                "first forward of it that awaits a recompute, which is still alive, nor equal to it. Either this "
                "recompute repeats a forward that kept nothing (one that ran before the stash was installed on this "
                "layer, while a later forward kept), or saved-tensor hooks hand the recompute an input that is not "
                "an exact copy (lossy offloading); attnstash cannot tell which forward it repeats. Run the backward "
                "of forwards that ran before install_attention_stash before the next forward, or do not stash this "
                "layer under hooks that change what they save.")
        entry = live[0]
    if entry is None and live:
        raise ReplayError(
            f"attnstash: {stash.name}: its recompute was handed a copy of the layer input (saved-tensor hooks that "
            f"offload it), while {len(live)} of its first forwards are waiting for their recompute (the layer ran "
            "more than once before this backward: shared weights, or several forwards before one backward), so "
            "attnstash cannot tell which one this recompute repeats. Run the backward of each forward before the "
            "next forward of this layer, turn offloading off for it, or do not stash it.")
    if entry is None:
        return None
    if entry.moved is not None:
        entry.moved.fetch()
    return entry


def refuse_an_untied_recompute(stash, layer_input):
    """A reentrant recompute (no saved-tensor hooks: a non-reentrant one runs under its
    checkpoint's) hands what its checkpoint calls a detached alias of the checkpoint's input: no
    grad_fn, and requires_grad as the input had it. Where nothing is kept for the layer input,
    one that has a grad_fn was made inside the checkpoint (its first forward's input was another
    tensor, made without grad), and one that does not require grad was the first forward's too;
    either way that first forward kept nothing (keep_replay.h, Phase: a reentrant first forward
    is told from a no-grad one by its anchor requiring grad). An input that only passes through
    a node, such as a full backward hook's, is still the first forward's, and its records are
    found. Called for a recompute with no pending entry; raises there."""
    made_here = layer_input.grad_fn is not None
    if (not made_here and layer_input.requires_grad) \
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None \
            or ops.record_id(layer_input, stash.slot_base):
        return
    if made_here:
        raise CheckpointingError(
            f"attnstash: {stash.name}: nothing is kept for its recompute's input, which has a grad_fn: it was made "
            "inside its reentrant activation checkpoint (several layers checkpointed together, as in "
            "torch.utils.checkpoint.checkpoint_sequential's segments, or code or a forward pre-hook that makes the "
            "layer's input inside the checkpointed function), where a reentrant checkpoint hands what it calls a "
            "detached alias of its own input; its first forward's input was another tensor, which nothing ties to "
            "this one. Stash only the layers each checkpoint calls on its own input (layers=), checkpoint each "
            "stashed layer on its own, or use non-reentrant checkpointing (use_reentrant=False).")
    raise CheckpointingError(
        f"attnstash: {stash.name}: its input (its first tensor argument, which the stash anchors on) does not "
        "require grad, so its first forward, which a reentrant checkpoint runs with grad off, could not be told "
        "from a no-grad forward and kept nothing, and its recompute has nothing to replay. Make that input require "
        "grad (the output of a frozen embedding, for one: x.requires_grad_() before the checkpoint), use "
        "non-reentrant checkpointing (use_reentrant=False), or do not stash this layer.")
