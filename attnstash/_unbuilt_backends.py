"""The kept backends' forwards for the planner where the compiled ops cannot load (a checkout
without a build, a build for another torch): the one place Python states a backend's call, for
the shapes of what it returns on meta tensors. Everything else takes them from the C++ backends
(attnstash/backends.py); tests/python/test_package.py checks these rows against them (the same
rows, shapes, dtypes, strides and refusals), so a change there that is not made here fails."""
import torch
from torch.nn.attention import SDPBackend

_aten = torch.ops.aten


def _fused(mask, query):
    # A boolean mask made additive in the query's dtype (torch_ops/keep_replay.cpp, fused_attn_mask):
    # its shape and dtype are all the shapes of the outputs depend on.
    return mask if mask is None or mask.dtype != torch.bool else torch.zeros_like(mask, dtype=query.dtype)


def _cpu_flash(q, k, v, mask, causal, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, []


def _cudnn(q, k, v, mask, causal, scale):
    r = _aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, causal, False, scale=scale)
    return r[0], r[1], [r[6], r[7]]


def _cuda_flash(q, k, v, mask, causal, scale):
    if q.shape[-1] % 8 or v.shape[-1] % 8:
        raise RuntimeError(f"attnstash: flash attention with head_dim {q.shape[-1]} (not a multiple of 8) is not kept: "
                           "F.sdpa pads and slices it around the kernel.")
    r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], [r[6], r[7]]


def _efficient(q, k, v, mask, causal, scale):
    bias = None if mask is None else mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    r = _aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return r[0], r[1], [r[2], r[3]]


def forward(call, query, key, value, attn_mask, is_causal, scale):
    """One of ROWS' calls on these tensors (meta ones: the planner), the caller's mask."""
    return call(query, key, value, _fused(attn_mask, query), is_causal, scale)


ROWS = (  # (device, SDPBackend, PyTorch's name, the aten forward op, its call)
    ("cpu", SDPBackend.FLASH_ATTENTION, "flash_attention (CPU)", "_scaled_dot_product_flash_attention_for_cpu",
     _cpu_flash),
    ("cuda", SDPBackend.CUDNN_ATTENTION, "cudnn_attention", "_scaled_dot_product_cudnn_attention", _cudnn),
    ("cuda", SDPBackend.FLASH_ATTENTION, "flash_attention", "_scaled_dot_product_flash_attention", _cuda_flash),
    ("cuda", SDPBackend.EFFICIENT_ATTENTION, "efficient_attention", "_scaled_dot_product_efficient_attention",
     _efficient),
)
