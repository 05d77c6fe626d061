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
        the fused forward op called as the C++ backend calls it (log-sum-exp always
        computed; attn_mask already as F.sdpa hands it to this backend); `extras` are the
        further outputs its backward takes, in the C++ backend's order (KeptAttention.extra).
    backward(grad, query, key, value, attn_mask, output, logsumexp, extras, is_causal, scale)
        -> (grad_query, grad_key, grad_value): the call PyTorch's derivative makes.
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


def _flash_scale(query, scale):
    # F.sdpa passes flash the scale of the unpadded head_dim explicitly.
    return scale if scale is not None else 1.0 / query.shape[-1] ** 0.5


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
    r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=_flash_scale(q, scale))
    return r[0], r[1], [r[6], r[7]]


def _cuda_flash_backward(grad, q, k, v, mask, out, lse, extras, causal, scale):
    return _aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, None, None, q.shape[2],
                                                              k.shape[2], 0.0, causal, extras[0], extras[1],
                                                              scale=_flash_scale(q, scale))


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


def fused_mask(mask, query, row):
    """The mask as F.sdpa hands it to this backend's forward (shapes and dtypes only matter
    here: values are the C++ side's). A boolean mask becomes additive in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)


def kept_bytes(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The bytes the stash keeps for one call with tensors shaped like these (meta tensors
    will do: nothing is computed), for the backend F.sdpa would run on their device: output,
    log-sum-exp and the backend's extras, as torch_ops/stash_entries.cpp counts them.
    Returns (bytes, row); (None, None) for a backend attnstash does not keep."""
    backend = chosen_backend(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    row = kept_backend(query.device, backend)
    if row is None:
        return None, None

    def meta(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    q, k, v = meta(query), meta(key), meta(value)
    out, lse, extras = row.forward(q, k, v, meta(fused_mask(attn_mask, query, row)), is_causal, scale)
    total = sum(t.numel() * t.element_size() for t in [out, lse, *extras] if isinstance(t, torch.Tensor))
    return total, row


# ---- for the planner (attnstash/plan.py): kept bytes and the backend choice without a device ----

def kept_bytes_of(row, query, key, value, attn_mask=None, is_causal=False, scale=None):
    """(output, logsumexp, extras) bytes the stash keeps for one call of this row's forward with
    tensors shaped like these (meta tensors will do: nothing is computed, and the device
    does not matter), counted as torch_ops/stash_entries.cpp counts them (numel * itemsize)."""
    def meta(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    q, k, v = meta(query), meta(key), meta(value)
    out, lse, extras = row.forward(q, k, v, meta(fused_mask(attn_mask, query, row)), is_causal, scale)

    def size(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    return size(out), size(lse), sum(size(t) for t in extras)


# Note: which backend F.sdpa picks on a CUDA device, for a machine that has none.
# torch decides in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (compiled into
# libtorch_cuda, not shipped as source). These rules restate it for dense 4-D inputs, from:
# ../shared/notes/pytorch.md "Which backend F.sdpa picks" (the order, cuDNN's preconditions);
# the checks shared with the CPU, which every torch wheel ships in
# torch/include/ATen/native/transformers/sdp_utils_cpp.h (check_tensor_shapes,
# check_batch_size_and_num_heads_dense, check_attn_mask_shape, check_last_dim_stride_equals_1_dense,
# check_nonzero_sequence_lengths_dense, check_for_attn_mask); and PyTorch's sdp_utils.cpp
# as of 2.5 to 2.11 (flash: no mask, equal head dims <= 256, fp16/bf16, sm80+, is_causal only
# with seq_q == seq_k, grouped K/V; memory-efficient: head dims aligned to the GEMM alignment,
# query/key head dims equal, fp32/fp16/bf16 on sm80+, NO grouped K/V, which is why
# Hugging Face repeats K/V whenever it passes a mask). A CUDA machine decides for itself:
# the planner asks torch._fused_sdp_choice there, and tests/python/test_plan.py compares
# these rules with it on the GPU.

_F = SDPBackend.FLASH_ATTENTION
_E = SDPBackend.EFFICIENT_ATTENTION
_C = SDPBackend.CUDNN_ATTENTION
_M = SDPBackend.MATH
_HALF = (torch.float16, torch.bfloat16)
_NAMES = {_F: "flash", _E: "memory-efficient attention", _C: "cuDNN", _M: "math"}


def _heads(query, key, value, enable_gqa, grouped):
    q, k, v = query.shape[-3], key.shape[-3], value.shape[-3]
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "query, key and value have different batch sizes"
    if enable_gqa and grouped:
        if k != v or q % k:
            return f"{k} key / {v} value heads do not divide {q} query heads"
        return None
    if not q == k == v:
        return (f"it needs as many key/value heads as query heads (got {q} query, {k} key/value heads"
                + (", enable_gqa" if enable_gqa else "") + ")")
    return None


def _first_failed(checks):
    """The reason of the first (reason, failed) pair that failed, or None."""
    return next((why for why, failed in checks if failed), None)


def _dense(query, key, value, attn_mask):
    if not query.dim() == key.dim() == value.dim() == 4:
        return "it needs 4-D query, key and value"
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return "a sequence length is 0"
    if any(t.stride(-1) != 1 for t in (query, key, value)) or (attn_mask is not None and attn_mask.stride(-1) != 1):
        return "the last dimension of an input has a stride other than 1"
    return None


def _mask_shape(query, key, attn_mask):
    # sdp_utils_cpp.h check_attn_mask_shape: 2-D, or 4-D broadcastable to [batch, heads, seq_q, seq_k]
    if attn_mask is None:
        return None
    m, want = attn_mask.shape, (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if attn_mask.dim() not in (2, 4) or any(a not in (b, 1) for a, b in zip(reversed(m), reversed(want))):
        return f"the mask's shape {list(m)} is not 2-D or 4-D broadcastable to {list(want)}"
    return None


def _why_not_flash(query, key, value, attn_mask, is_causal, enable_gqa, capability):
    d = (query.shape[-1], key.shape[-1], value.shape[-1])
    checks = [
        ("flash is disabled (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)",
         not torch.backends.cuda.flash_sdp_enabled()),
        (_dense(query, key, value, attn_mask), _dense(query, key, value, attn_mask) is not None),
        ("flash takes no attention mask", attn_mask is not None),
        (f"flash needs equal head dims <= 256 (got query/key/value {d[0]}/{d[1]}/{d[2]})",
         not (d[0] == d[1] == d[2] and d[0] <= 256)),
        (f"flash needs sm80 or newer (sm{capability[0]}{capability[1]})", tuple(capability) < (8, 0)),
        ("flash's is_causal needs seq_q == seq_k", is_causal and query.shape[-2] != key.shape[-2]),
        (f"flash takes float16/bfloat16, not {str(query.dtype).replace('torch.', '')}",
         query.dtype not in _HALF or not query.dtype == key.dtype == value.dtype),
    ]
    return _first_failed(checks) or _heads(query, key, value, enable_gqa, grouped=True)


def _why_not_efficient(query, key, value, attn_mask, is_causal, enable_gqa, capability):
    half = query.dtype in _HALF
    tensor_cores = tuple(capability) >= ((7, 0) if half else (8, 0))
    align = max(4 if tuple(capability) >= (8, 0) else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if tuple(capability) >= (8, 0) else (torch.float32,
                                                                                                 torch.float16)
    dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
    checks = [
        ("memory-efficient attention is disabled (torch.backends.cuda.enable_mem_efficient_sdp / sdpa_kernel)",
         not torch.backends.cuda.mem_efficient_sdp_enabled()),
        (f"memory-efficient attention needs sm50 or newer (sm{capability[0]}{capability[1]})",
         tuple(capability) < (5, 0)),
        (_dense(query, key, value, attn_mask), _dense(query, key, value, attn_mask) is not None),
        (f"memory-efficient attention needs query/key head dims equal and head dims multiples of {align} "
         f"(got {dq}/{dk}/{dv})", not (dq == dk and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0)),
        (f"memory-efficient attention does not take {str(query.dtype).replace('torch.', '')} here",
         query.dtype not in dtypes or not query.dtype == key.dtype == value.dtype),
    ]
    why = _first_failed(checks)
    if why:
        return why
    heads = _heads(query, key, value, enable_gqa, grouped=False)
    return None if heads is None else heads + " (it takes no grouped K/V)"


def _why_not_cudnn(query, key, value, attn_mask, is_causal, enable_gqa, capability, cudnn_version):
    dq, dv = query.shape[-1], value.shape[-1]
    limit = 256 if tuple(capability) == (9, 0) and (cudnn_version is None or cudnn_version >= 90501) else 128
    checks = [
        ("cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp / sdpa_kernel)",
         not torch.backends.cuda.cudnn_sdp_enabled()),
        ("cuDNN attention needs cuDNN 9", cudnn_version is not None and cudnn_version < 90000),
        (f"cuDNN attention needs sm80 or newer (sm{capability[0]}{capability[1]})", tuple(capability) < (8, 0)),
        (_dense(query, key, value, attn_mask), _dense(query, key, value, attn_mask) is not None),
        (f"cuDNN attention needs head dims that are multiples of 8 and <= {limit} here (got {dq}/{dv})",
         not (dq % 8 == 0 and dv % 8 == 0 and max(dq, dv) <= limit)),
        ("cuDNN attention is not used under torch.use_deterministic_algorithms(True)",
         torch.are_deterministic_algorithms_enabled()),
        (f"cuDNN attention takes float16/bfloat16, not {str(query.dtype).replace('torch.', '')}",
         query.dtype not in _HALF or not query.dtype == key.dtype == value.dtype),
        (_mask_shape(query, key, attn_mask), _mask_shape(query, key, attn_mask) is not None),
    ]
    return _first_failed(checks) or _heads(query, key, value, enable_gqa, grouped=True)


_ENV_TRUE = ("1", "true", "TRUE", "True", "y", "yes", "YES", "on", "ON")


def cuda_backend_order(capability=(9, 0), cudnn_version=None, torch_version=None):
    """(the order F.sdpa tries the CUDA backends in, why) on a device of this compute
    capability, decided without one. cudnn_version: an int as torch.backends.cudnn.version()
    gives it (91900 for 9.19.0); None: the installed torch's, else assumed from its version
    (CUDA wheels of torch >= 2.11 bundle a cuDNN newer than 9.15). torch_version: (major,
    minor), default the installed torch's. Honours a priority set with
    sdpa_kernel(..., set_priority=True) and TORCH_CUDNN_SDPA_DEPRIORITIZED."""
    import os
    torch_version = _torch_version(torch_version)
    version = f"torch {torch_version[0]}.{torch_version[1]}"
    default = [int(_F), int(_E), int(_M), int(_C)]
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    current = [b for b in get_order() if b in default] if get_order is not None else default
    if current != default:
        return [SDPBackend(b) for b in current], "the priority set with sdpa_kernel(..., set_priority=True)"
    cudnn_version, assumed = _cudnn_version(cudnn_version, torch_version)
    sm = f"sm{capability[0]}{capability[1]}"
    cudnn = f"cuDNN {_cudnn_str(cudnn_version)}" + (f" ({assumed})" if assumed else "")
    last = "tries flash, memory-efficient, math, then cuDNN"
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") in _ENV_TRUE:
        why = f"TORCH_CUDNN_SDPA_DEPRIORITIZED is set: {version} {last}"
    elif torch_version < (2, 9):
        why = f"{version} {last}"
    elif tuple(capability) not in ((9, 0), (10, 0)):
        why = f"{version} on {sm} (not sm90/sm100) {last}"
    elif cudnn_version is not None and cudnn_version <= 91500:
        why = f"{version} with {cudnn} (not newer than 9.15.0) {last}"
    else:
        return ([_C, _F, _E, _M], f"{version} on {sm} with {cudnn} tries cuDNN first "
                                   "(TORCH_CUDNN_SDPA_DEPRIORITIZED is not set)")
    return [_F, _E, _M, _C], why


def _torch_version(torch_version=None):
    if torch_version is not None:
        return tuple(torch_version)[:2]
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _cudnn_version(cudnn_version, torch_version):
    if cudnn_version is not None:
        return cudnn_version, ""
    try:
        found = torch.backends.cudnn.version()
    except Exception:
        found = None
    if found:
        return found, ""
    if torch_version >= (2, 11):
        return None, "assumed: the CUDA wheels of torch >= 2.11 bundle one"
    return 91000, "assumed: the CUDA wheels of torch < 2.11 bundle one older than 9.15"


def _cudnn_str(version):
    if version is None:
        return "newer than 9.15.0"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def cuda_backend_without_device(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                enable_gqa=False, *, capability=(9, 0), cudnn_version=None, torch_version=None):
    """The backend F.sdpa would pick for a call shaped like this on a CUDA device of this
    compute capability, decided by the rules above, without a device (meta tensors will do).
    Honours the enabled backends (sdpa_kernel(...), torch.backends.cuda.enable_*_sdp) and
    torch.use_deterministic_algorithms. Returns (SDPBackend, why: one line saying why)."""
    order, why_order = cuda_backend_order(capability, cudnn_version, torch_version)
    cudnn_version, _ = _cudnn_version(cudnn_version, _torch_version(torch_version))
    not_used = []
    for backend in order:
        if backend == _M:
            if torch.backends.cuda.math_sdp_enabled():
                return _M, "; ".join([why_order] + not_used + ["math runs it"])
            not_used.append("math is disabled")
            continue
        if backend == _F:
            reason = _why_not_flash(query, key, value, attn_mask, is_causal, enable_gqa, capability)
        elif backend == _E:
            reason = _why_not_efficient(query, key, value, attn_mask, is_causal, enable_gqa, capability)
        else:
            reason = _why_not_cudnn(query, key, value, attn_mask, is_causal, enable_gqa, capability, cudnn_version)
        if reason is None:
            return backend, "; ".join([why_order] + not_used + [f"{_NAMES[backend]} takes this call"])
        not_used.append(f"not {_NAMES[backend]}: {reason}")
    return SDPBackend.ERROR, "; ".join([why_order] + not_used + ["no backend is enabled that can run it"])
