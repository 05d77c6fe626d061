"""The SDPA backends attnstash keeps, as Python sees them: one row each, keyed by torch's
own torch.nn.attention.SDPBackend. The C++ side of each backend is one file in
torch_ops/backends/ (its forward and backward calls); this table is everything Python
needs of it: the fused forward and backward ops it calls (for the fake kernels that let
torch.compile trace the ops, for selective activation checkpointing in the benchmark, and
for the planner's kept-bytes prediction). Adding a backend: torch_ops/backends/README.md.
"""
import dataclasses
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class KeptBackend:
    """One kept backend.

    forward(query, key, value, attn_mask, is_causal, scale) -> (output, logsumexp, extras):
        the fused forward op the C++ backend calls, with the log-sum-exp always computed, for
        the shapes of what it returns (fake kernels, the planner; the exact arguments, masks
        and scales included, are the C++ backend's); `extras` are the further outputs its
        backward takes, in the C++ backend's order (KeptAttention.extra).
    backward(grad, query, key, value, attn_mask, output, logsumexp, extras, is_causal, scale)
        -> (grad_query, grad_key, grad_value): the backward op PyTorch's derivative calls, for
        the shapes (fake kernels).
    forward_op: the aten op of the forward (what selective activation checkpointing saves).
    extra_names: a name for each of `extras`, in order (for printed predictions).
    refuses(query, key, value) -> None, or why the C++ backend refuses such inputs (where
        F.sdpa pads or slices around the fused op, which the kept path cannot replay).
    """
    device: str
    backend: SDPBackend
    name: str
    forward: Callable
    backward: Callable
    forward_op: Optional[object]
    extra_names: tuple = ()
    refuses: Callable = lambda query, key, value: None


def _efficient_bias(mask, query, key):
    # Layout only matters to the real kernel (torch_ops/backends/efficient.cpp); shapes need the expansion.
    return None if mask is None else mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _op(name):
    return getattr(_aten, name).default if hasattr(_aten, name) else None


def _cpu_flash_forward(q, k, v, mask, causal, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, []


def _cpu_flash_backward(grad, q, k, v, mask, out, lse, extras, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                      attn_mask=mask, scale=scale)


def _cudnn_forward(q, k, v, mask, causal, scale):
    r = _aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, causal, False, scale=scale)
    return r[0], r[1], [r[6], r[7]]


def _cudnn_backward(grad, q, k, v, mask, out, lse, extras, causal, scale):
    return _aten._scaled_dot_product_cudnn_attention_backward(grad, q, k, v, out, lse, extras[0], extras[1], mask,
                                                              None, None, q.shape[2], k.shape[2], 0.0, causal,
                                                              scale=scale)


def _cuda_flash_forward(q, k, v, mask, causal, scale):
    r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], [r[6], r[7]]


def _cuda_flash_backward(grad, q, k, v, mask, out, lse, extras, causal, scale):
    return _aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, None, None, q.shape[2],
                                                              k.shape[2], 0.0, causal, extras[0], extras[1],
                                                              scale=scale)


def _cuda_flash_refuses(q, k, v):
    # torch_ops/backends/cuda_flash.cpp refuses the same: F.sdpa pads such a head_dim around the kernel.
    if q.shape[-1] % 8 or v.shape[-1] % 8:
        return f"CUDA flash attention with head_dim {q.shape[-1]} (not a multiple of 8) is not kept"
    return None


def _efficient_forward(q, k, v, mask, causal, scale):
    r = _aten._scaled_dot_product_efficient_attention(q, k, v, _efficient_bias(mask, q, k), True, 0.0, causal,
                                                      scale=scale)
    return r[0], r[1], [r[2], r[3]]


def _efficient_backward(grad, q, k, v, mask, out, lse, extras, causal, scale):
    return _aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, _efficient_bias(mask, q, k), out,
                                                                  lse, extras[0], extras[1], 0.0,
                                                                  [True, True, True, False], causal, scale=scale)[:3]


KEPT_BACKENDS = (
    KeptBackend("cpu", SDPBackend.FLASH_ATTENTION, "flash_attention (CPU)", _cpu_flash_forward, _cpu_flash_backward,
                _op("_scaled_dot_product_flash_attention_for_cpu")),
    KeptBackend("cuda", SDPBackend.CUDNN_ATTENTION, "cudnn_attention", _cudnn_forward, _cudnn_backward,
                _op("_scaled_dot_product_cudnn_attention"), ("philox seed", "philox offset")),
    KeptBackend("cuda", SDPBackend.FLASH_ATTENTION, "flash_attention", _cuda_flash_forward, _cuda_flash_backward,
                _op("_scaled_dot_product_flash_attention"), ("rng state", "unused"), _cuda_flash_refuses),
    KeptBackend("cuda", SDPBackend.EFFICIENT_ATTENTION, "efficient_attention", _efficient_forward,
                _efficient_backward, _op("_scaled_dot_product_efficient_attention"), ("philox seed", "philox offset")),
)


def kept_backend(device, backend) -> Optional[KeptBackend]:
    """The row for this device type ("cpu", "cuda") and SDPBackend (or its int), or None."""
    for row in KEPT_BACKENDS:
        if row.device == torch.device(device).type and row.backend == SDPBackend(int(backend)):
            return row
    return None


def chosen_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False) -> SDPBackend:
    """The backend F.sdpa would run for this call (honouring sdpa_kernel(...) contexts)."""
    return SDPBackend(int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)))


def as_fused_mask(mask, query):
    """The mask's shape and dtype as F.sdpa hands it to a fused forward: a boolean mask becomes
    additive in the query's dtype (its values are the C++ side's: torch_ops/keep_replay.cpp,
    fused_attn_mask); shapes and dtypes are all the fake kernels and the planner need."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)


def kept_bytes(row, query, key, value, attn_mask=None, is_causal=False, scale=None):
    """(output, logsumexp, extras) bytes the stash keeps for one call of this row's forward with
    tensors shaped like these (meta tensors will do: nothing is computed, and the device does not
    matter), counted as torch_ops/records.cpp counts them (numel * itemsize)."""
    def meta(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    out, lse, extras = row.forward(meta(query), meta(key), meta(value), meta(as_fused_mask(attn_mask, query)),
                                   is_causal, scale)

    def size(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    return size(out), size(lse), sum(size(t) for t in extras)


def kept_bytes_of_call(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The bytes the stash keeps for one call on these tensors' device, for the backend F.sdpa
    would run there (the sum of kept_bytes), or None for a backend attnstash does not keep."""
    row = kept_backend(query.device, chosen_backend(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa))
    return None if row is None else sum(kept_bytes(row, query, key, value, attn_mask, is_causal, scale))
