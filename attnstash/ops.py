"""The one Python module that names the attnstash ops (torch.ops.attnstash.*).

Typed wrappers with their contracts, the stash's Python API, and the fake kernels that
let torch.compile and FakeTensor trace the ops.
"""
import enum
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _library, backends
from .errors import KeepError

NATIVE = _library.load()  # attnstash/_C: registers the ops; explains a missing or mismatched build
_ops = torch.ops.attnstash


def sdpa_fwd_keep(query, key, value, anchor, slot: int, attn_mask=None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False):
    """F.scaled_dot_product_attention that keeps its output for its activation-checkpoint recompute.

    Args:
        query: (batch, heads, seq_q, head_dim).
        key, value: (batch, kv_heads, seq_k, head_dim) and (batch, kv_heads, seq_k, head_dim_v).
        anchor: the tensor that identifies this forward: the checkpointed function's input
            (the decoder layer's input), which its recompute receives again (a reentrant
            checkpoint passes a detached alias of it); or, where offloading hooks hand the
            recompute a copy of that input, a 0-dim tensor that requires grad, created for
            this checkpoint call and held until its recompute (torch_ops/schemas.cpp).
        slot: which attention call on that anchor (several calls of one layer need
            several slots).
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as F.scaled_dot_product_attention.

    Returns:
        (batch, heads, seq_q, head_dim_v): bitwise what F.scaled_dot_product_attention returns.

    What it does depends on where it runs (attnstash decides; see torch_ops/keep_replay.h):
    in a reentrant checkpoint's first forward (grad off, anchor requires grad) or a
    non-reentrant one's (grad on, under the checkpoint's saved-tensor hooks) it runs the
    forward F.sdpa would run, with its log-sum-exp, and keeps both (or a declined record where
    the budget has no room, csrc/stash_registry.h, Budget: that recompute then runs attention
    as usual); in the
    recompute (grad on, inside backward) it returns the kept output through a node whose
    backward is PyTorch's own derivative; anywhere else (an empty input included) it is
    exactly F.scaled_dot_product_attention and keeps nothing. Under torch.autocast it casts
    its inputs as F.sdpa does.

    Raises:
        RuntimeError: when a call it should keep cannot be kept (attention dropout, a mask
            that requires grad, a backend it cannot keep, inputs F.sdpa refuses: PyTorch's own
            message), and when a recompute differs from its first forward or finds nothing kept.
    """
    return _ops.sdpa_fwd_keep(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def sdpa_replay(query, key, value, anchor, slot: int, attn_mask=None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False):
    """The recompute half of sdpa_fwd_keep on its own: takes what it kept for (anchor, slot).

    Arguments and result as sdpa_fwd_keep. The output is the kept one (for a declined
    record, the forward run now), as a node whose backward is the kept backend's derivative.

    Raises:
        RuntimeError: if nothing is kept for (anchor, slot), or the call differs from the one
            that kept it (shapes, dtypes, device, flags, mask, the backend PyTorch would now
            choose, an anchor, mask or output modified in place).
    """
    return _ops.sdpa_replay(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _entry(packet):
    """An op's C++ entry, what its OpOverload calls (torch._ops.OpOverload.__call__ calls `_op`),
    without the two Python frames of the packet and the overload. Where a torch release names it
    otherwise, the overload itself, which is the same call."""
    overload = packet.default
    return getattr(overload, "_op", overload)


frame_phase = NATIVE.frame_phase
"""(outer_grad) -> FramePhase value: the phase of a stashed layer's forward as it starts, from this
thread's autograd state (torch_ops/keep_replay.h states the rule). `outer_grad`: whether a
backward can reach the layer's checkpoint, as seen from the call outside it, 1 or 0 (a bool
does), or -1 where it cannot be seen."""


class FramePhase(enum.IntEnum):
    """The phase of a stashed layer's forward (torch_ops/keep_replay.h, FramePhase): frame_phase's
    values. The recomputes first, then the first forwards that keep, then the rest."""
    recompute = 0
    recompute_without_grad = 1
    reentrant_first = 2
    reentrant_first_hooked = 3
    non_reentrant_first = 4
    unreachable = 5
    outside_checkpoint = 6


NATIVE._set_token_binding(_entry(_ops._new_token))
NEW_TOKEN = NATIVE.new_token
"""_new_token called (new_token below): its kernel from C, or its binding where a mode would see the
call (torch_ops/python_module.cpp says which), the same call either way."""


# The frames the installer opens around each forward of a stashed layer: inside one that keeps,
# aten::scaled_dot_product_attention goes to sdpa_fwd_keep (torch_ops/frames.h states the rule).
frame_open = NATIVE.frame_open
"""(anchor, slot_base, limit, phase, collect, random, random_input) -> keep: open a frame on this
thread, inside those open on it, for a forward that starts in `phase` (a FramePhase), which
decides whether its calls keep (returned) and whether the frame owns what they keep until it
closes. `limit` -1 for none; `random` a RandomCheck; `random_input` the layer input whose
device's random state a note or refuse check starts from (else None)."""
frame_close = NATIVE.frame_close
"""(interrupted) -> (calls, ids or None, noted, failure or None): close this thread's innermost
frame; `interrupted`: its forward raised, and what the frame owns is released. `ids`: the records
its calls kept (opened with `collect`); `noted`: a call noted a random state on its record;
`failure`: (Failure, message, dropout_p) of the call it refused."""
frame_run = NATIVE.frame_run
"""(fn, args, kwargs, anchor, slot_base, limit, phase, collect, random, random_input) -> (fn's
output, calls, keep, ids or None, noted): fn(*args, **kwargs) (`kwargs` a dict or None) in a frame
opened as frame_open opens it and closed as it returns, as frame_close(False) closes it. Where fn
raises, the frame closes as interrupted and fn's error propagates: frame_interrupted() then gives
that frame's (noted, failure or None)."""
frame_interrupted = NATIVE.frame_interrupted
"""() -> (noted, failure or None): what the frame of this thread's last frame_run whose forward
raised said as it closed, as frame_close(True) would have."""
new_slot_base = NATIVE.new_slot_base
"""() -> int: the first slot of a range of SLOTS_PER_RANGE no one else has (a stashed layer's, or
a compiled layer class's): its k-th attention call is slot base + k (csrc/stash_registry.h,
stash_new_slot_range)."""
SLOTS_PER_RANGE = NATIVE.slots_per_range
"""How many slots a range holds: the most attention calls one forward of a layer may make."""
frame_depth = NATIVE.frame_depth
"""How many frames are open on this thread."""
frame_is_open = NATIVE.frame_is_open
"""(slot_base) -> bool: whether a frame of the layer whose first slot is `slot_base` is open on this
thread, at any depth."""
saved_tensor_hooks_depth = NATIVE.saved_tensor_hooks_depth
"""How many saved-tensor hook pairs this thread has pushed (torch.autograd.graph.saved_tensors_hooks,
a non-reentrant checkpoint's own): offload.py reads below the top pair only where there is one."""
set_compiled_attention = NATIVE._set_compiled_attention
"""(fn): the installer's hook for compiled frames, fn(query, key, value, attn_mask, dropout_p,
is_causal, scale, enable_gqa) -> Tensor or None (torch_ops/frames.h, CompiledAttention)."""
set_compiled_frames = NATIVE.set_compiled_frames
"""(count): how many compiled frames this thread has open."""


class RandomCheck(enum.IntEnum):
    """What a frame checks of the random state before each call (torch_ops/frames.h, RandomCheck;
    install/random_state.py says when each applies)."""
    none = 0
    note = 1
    refuse = 2
    check = 3


class Failure(enum.IntEnum):
    """Why a frame refused a call (torch_ops/frames.h, Failure)."""
    none = 0
    op = 1
    limit = 2
    random_state = 3


_offload_waits = [0]
OFFLOAD_WAITS = "recomputes whose records attnstash's offload had not fetched back ahead (install/offload.py)"


RECOMPUTED = ("attention calls run again in a backward that the stash did not serve: in layers not stashed, or "
              "stashed and run as without it (eager; declined keeps are counted apart, compiled graphs not at all)")


def stash_stats() -> dict:
    """The process-wide stash's counters, by name (csrc/stash_registry.h defines them):
    records, bytes, peak_bytes, max_bytes (-1: no budget), keeps, declined, replays,
    misses, released_unused, moved_bytes; offload_waits (install/offload.py); and
    recomputed (torch_ops/frames.h). stash_stats_meanings() says what each one counts."""
    return dict(_ops.stash_stats(), offload_waits=_offload_waits[0], recomputed=NATIVE.recomputed())


def stash_stats_meanings() -> dict:
    """{counter: what it counts} for the fields of stash_stats()."""
    return dict(_ops.stash_stats_meanings(), offload_waits=OFFLOAD_WAITS, recomputed=RECOMPUTED)


def count_offload_wait() -> None:
    _offload_waits[0] += 1


def move_out(record: int) -> list:
    """Offloading: record `record`'s output and log-sum-exp, which it no longer holds, its bytes
    counted in moved_bytes; [] if there is nothing to move (torch_ops/records.h, move_out)."""
    return _ops._record_move_out(record)


def move_in(record: int, output, logsumexp) -> bool:
    """Offloading: put them back before the recompute; whether the record is still held."""
    return _ops._record_move_in(record, output, logsumexp)


def note_rng(record: int, state) -> bool:
    """The random-number check: note on record `record` the random state its first forward's
    call was made in; whether it is still held (torch_ops/records.h, note_rng)."""
    return _ops._record_note_rng(record, state)


def noted_rng(anchor, slot: int):
    """The random state noted on the record held for (anchor, slot), or None."""
    return _ops._record_noted_rng(anchor, slot)


def stash_clear() -> int:
    """Release everything kept; returns the number of records released. A recompute whose
    output was released fails clearly (it never recomputes silently)."""
    return _ops.stash_clear()


def stash_reset_peak() -> None:
    """Set peak_bytes to the bytes held now (to measure one phase of a run)."""
    _ops.stash_reset_peak()


def set_max_bytes(max_bytes: int) -> None:
    """The registry's budget in bytes (negative: none). attnstash.stash_set_max_bytes is the
    one to call: it reads the units users write (attnstash/budget.py)."""
    _ops.stash_set_max_bytes(max_bytes)


class Held(NamedTuple):
    """What the stash holds for one slot (or one layer): records, bytes, and how many of
    those records are declined (held without bytes: their recompute runs attention)."""
    records: int
    bytes: int
    declined: int


def held_by_slot() -> dict:
    """{slot: Held(records, bytes, declined)} for every slot that holds something."""
    flat = _ops.stash_held_by_slot()
    return {flat[i]: Held(*flat[i + 1:i + 4]) for i in range(0, len(flat), 4)}


def release_slots(first: int, count: int) -> int:
    """Release every record under slots [first, first + count); how many."""
    return _ops._release_slots(first, count)


record_id = NATIVE.record_id
"""record_id(anchor, slot) -> int: the id of the record held for (anchor, slot), 0 if none; the
stash_record_id op's kernel, called directly (python_module.cpp)."""


def new_token():
    """A 0-dim CPU tensor that requires grad, to anchor one checkpoint call's forwards on in place
    of the layer input; what is held under it is released as it is freed (torch_ops/records.h,
    new_token)."""
    return NEW_TOKEN()


def release(record: int) -> bool:
    """Release one forward's reference of record `record` (an id); whether it was held."""
    return _ops.stash_release(record)


def held_ids() -> list:
    """The ids of every record held now."""
    return _ops.stash_held_ids()


# ---- nested (jagged) tensors ----------------------------------------------------------------
# A jagged tensor is a Python tensor subclass, which reaches no C++ kernel: say why instead
# of the dispatcher's bare NotImplementedError. (Strided nested tensors reach the C++
# kernels, which say it when a call would keep.)

def _refuse_jagged(subclass, func, types, args=(), kwargs=None):
    raise KeepError(f"attnstash::{func._opname}: query, key or value is a nested (jagged) tensor, which "
                    "attnstash cannot keep: it keeps dense [batch, heads, seq, head_dim] attention. Pad the batch "
                    "into a dense tensor with an attention mask, or call F.scaled_dot_product_attention for "
                    "nested tensors.")


try:
    from torch.nested._internal.nested_tensor import NestedTensor as _JaggedTensor
except ImportError:  # a torch without jagged nested tensors
    _JaggedTensor = None
if _JaggedTensor is not None and hasattr(torch.library, "register_torch_dispatch"):
    for _name in ("sdpa_fwd_keep", "sdpa_replay"):
        torch.library.register_torch_dispatch(f"attnstash::{_name}", _JaggedTensor, _refuse_jagged)


# ---- fake kernels --------------------------------------------------------------------------
# They let FakeTensor and torch.compile trace the ops. Every output comes from the kept
# backend's own forward or backward for the backend F.sdpa would run for these inputs
# (attnstash/backends.py), so PyTorch's own meta functions give the exact shape, dtype and strides.

def _fake_row(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    backend = backends.chosen_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.device.type == "cpu":  # the fake CPU choice can differ from the real one: CPU keeps one backend
        backend = torch.nn.attention.SDPBackend.FLASH_ATTENTION
    row = backends.kept_backend(query.device, backend)
    if row is None:
        raise NotImplementedError(f"attnstash: SDPA backend {backend.name} on {query.device} is not kept, so it has "
                                  "no fake kernel")
    return row


def _fake_output(query, key, value, anchor, slot, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    # The plain path is F.sdpa itself; the kept and replayed outputs come from the same fused op.
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


torch.library.register_fake("attnstash::sdpa_fwd_keep")(_fake_output)
torch.library.register_fake("attnstash::sdpa_replay")(_fake_output)
torch.library.register_fake("attnstash::_sdpa_compiled")(_fake_output)


@torch.library.register_fake("attnstash::_replay_take")
@torch.library.register_fake("attnstash::_keep_or_take")
def _replay_take_fake(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    row = _fake_row(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out, lse, extra = row.forward(query, key, value, attn_mask, is_causal, scale)
    return out, lse, torch.empty(4, dtype=torch.long, device="cpu"), extra


@torch.library.register_fake("attnstash::_replay_backward")
def _replay_backward_fake(grad, query, key, value, attn_mask, output, logsumexp, info, extra, dropout_p, is_causal,
                          scale, enable_gqa):
    row = _fake_row(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return row.backward(grad, query, key, value, attn_mask, output, logsumexp, extra, is_causal, scale)
