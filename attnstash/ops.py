"""The one Python module that names the attnstash ops (torch.ops.attnstash.*).

Typed wrappers, the stash's Python API, and the fake kernels that let
torch.compile and FakeTensor trace the ops.
"""
from typing import Optional

import torch
import torch.nn.functional as F

_ops = torch.ops.attnstash

STATS_FIELDS = ("entries", "bytes", "peak_bytes", "keeps", "replays", "misses", "released_unused")


def sdpa_fwd_keep(query, key, value, anchor, slot: int, attn_mask=None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False):
    """F.scaled_dot_product_attention that keeps its output for a reentrant recompute.

    query: (batch, heads, seq_q, head_dim); key, value: (batch, kv_heads, seq_k, head_dim).
    anchor: the tensor that identifies this forward (the decoder layer's input); slot: which
    attention call on that anchor. In a reentrant checkpoint's first forward (grad off,
    anchor.requires_grad) it keeps output and log-sum-exp; in the recompute (grad on, inside
    backward) it returns them through a node whose backward is PyTorch's own; anywhere else it
    is exactly F.scaled_dot_product_attention and keeps nothing.
    """
    return _ops.sdpa_fwd_keep(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def sdpa_replay(query, key, value, anchor, slot: int, attn_mask=None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False):
    """Take what sdpa_fwd_keep kept for (anchor, slot); fails if nothing is kept. Never runs attention."""
    return _ops.sdpa_replay(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def stash_stats() -> dict:
    """Counters of the process-wide stash: entries and bytes held now, peak bytes, keeps,
    replays, misses, and entries released without being replayed."""
    return dict(zip(STATS_FIELDS, _ops.stash_stats()))


def clear_stash() -> int:
    """Release everything kept; returns the number of entries released."""
    return _ops.stash_clear()


def release_anchor(data_ptr: int) -> int:
    """Release every entry kept for the anchor at this data pointer (it has been freed)."""
    return _ops.stash_release_anchor(data_ptr)


def held_by_slot() -> dict:
    """{slot: (entries, bytes)} for every slot that holds something."""
    flat = _ops.stash_held_by_slot()
    return {flat[i]: (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}


def reset_peak() -> None:
    """Set peak_bytes to the bytes held now."""
    _ops.stash_reset_peak()


# ---- fake kernels --------------------------------------------------------------------------
# They let FakeTensor and torch.compile trace the ops. Every output comes from the fused
# SDPA op F.sdpa would run for these inputs, so PyTorch's own meta functions give the
# exact shape, dtype and strides. One branch per kept backend (torch_ops/backends/).
_aten = torch.ops.aten
_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3  # torch.nn.attention.SDPBackend values


def _fake_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if query.device.type == "cpu":
        return "cpu_flash"
    choice = int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa))
    if query.device.type == "cuda" and choice in (_FLASH, _EFFICIENT, _CUDNN):
        return {_FLASH: "flash", _EFFICIENT: "efficient", _CUDNN: "cudnn"}[choice]
    raise NotImplementedError(f"attnstash: SDPA backend {choice} on {query.device} is not kept, so it has no fake kernel")


def _fake_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """(output, logsumexp, extra) of the fused forward, on fake tensors."""
    backend = _fake_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out, lse, []
    if backend == "flash":
        r = _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                      scale=_flash_scale(query, scale))
        return r[0], r[1], [r[6], r[7]]
    if backend == "efficient":
        r = _aten._scaled_dot_product_efficient_attention(query, key, value, _efficient_bias(attn_mask, query, key),
                                                          True, dropout_p, is_causal, scale=scale)
        return r[0], r[1], [r[2], r[3]]
    r = _aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, True, dropout_p, is_causal, False,
                                                  scale=scale)
    return r[0], r[1], [r[6], r[7]]


def _flash_scale(query, scale):
    return scale if scale is not None else 1.0 / query.shape[-1] ** 0.5


def _efficient_bias(mask, query, key):
    # Layout only matters to the real kernel; the fake needs the expanded shape.
    return None if mask is None else mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _fake_output(query, key, value, anchor, slot, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    # The plain path is F.sdpa itself; the kept and replayed outputs come from the same fused op.
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


torch.library.register_fake("attnstash::sdpa_fwd_keep")(_fake_output)
torch.library.register_fake("attnstash::sdpa_replay")(_fake_output)


@torch.library.register_fake("attnstash::_replay_take")
def _replay_take_fake(query, key, value, anchor, slot, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    out, lse, extra = _fake_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out, lse, torch.empty(4, dtype=torch.long, device="cpu"), extra


@torch.library.register_fake("attnstash::_replay_backward")
def _replay_backward_fake(grad, query, key, value, attn_mask, output, logsumexp, info, extra, dropout_p, is_causal,
                          scale, enable_gqa):
    backend = _fake_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, output, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    if backend == "flash":
        return _aten._scaled_dot_product_flash_attention_backward(
            grad, query, key, value, output, logsumexp, None, None, query.shape[2], key.shape[2], dropout_p,
            is_causal, extra[0], extra[1], scale=_flash_scale(query, scale))
    if backend == "efficient":
        return _aten._scaled_dot_product_efficient_attention_backward(
            grad, query, key, value, _efficient_bias(attn_mask, query, key), output, logsumexp, extra[0], extra[1],
            dropout_p, [True, True, True, False], is_causal, scale=scale)[:3]
    return _aten._scaled_dot_product_cudnn_attention_backward(
        grad, query, key, value, output, logsumexp, extra[0], extra[1], attn_mask, None, None,
        query.shape[2], key.shape[2], dropout_p, is_causal, scale=scale)
