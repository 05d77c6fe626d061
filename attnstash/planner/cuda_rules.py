"""Which backend F.sdpa would pick on a CUDA device, for the planner on a machine that has
none (where there is one, the planner asks torch._fused_sdp_choice there instead, and
tests/python/test_plan_cuda.py compares these rules with it on the GPU).

torch decides in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (compiled into
libtorch_cuda, not shipped as source). These rules restate it for dense 4-D inputs, for the
supported torch releases (attnstash/_library.py SUPPORTED_TORCH): the order (cuDNN first on
sm90/sm100 with a cuDNN newer than 9.15, which their CUDA wheels bundle; then flash,
memory-efficient, math), the checks shared with the CPU that every wheel ships in
torch/include/ATen/native/transformers/sdp_utils_cpp.h (check_tensor_shapes,
check_batch_size_and_num_heads_dense, check_attn_mask_shape, check_last_dim_stride_equals_1_dense,
check_nonzero_sequence_lengths_dense, check_for_attn_mask), and each backend's own: flash takes
no mask, equal head dims <= 256, fp16/bf16, sm80+, is_causal only with seq_q == seq_k, grouped
K/V; memory-efficient attention takes head dims aligned to its GEMM, query/key head dims equal,
fp32/fp16/bf16 on sm80+, no grouped K/V (which is why Hugging Face repeats K/V whenever it passes
a mask); cuDNN takes fp16/bf16 and head dims that are multiples of 8 up to 128 (256 on sm90).
"""
import os

import torch
from torch.nn.attention import SDPBackend

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


def cuda_backend_order(capability=(9, 0), cudnn_version=None):
    """(the order F.sdpa tries the CUDA backends in, why) on a device of this compute
    capability, decided without one. cudnn_version: an int as torch.backends.cudnn.version()
    gives it (91900 for 9.19.0); None: the installed torch's, else assumed (the CUDA wheels of
    the supported torch releases bundle one newer than 9.15). Honours a priority set with
    sdpa_kernel(..., set_priority=True) and TORCH_CUDNN_SDPA_DEPRIORITIZED."""
    version = "torch " + ".".join(torch.__version__.split("+")[0].split(".")[:2])
    default = [int(_F), int(_E), int(_M), int(_C)]
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    current = [b for b in get_order() if b in default] if get_order is not None else default
    if current != default:
        return [SDPBackend(b) for b in current], "the priority set with sdpa_kernel(..., set_priority=True)"
    cudnn_version, assumed = _cudnn_version(cudnn_version)
    sm = f"sm{capability[0]}{capability[1]}"
    cudnn = f"cuDNN {_cudnn_str(cudnn_version)}" + (f" ({assumed})" if assumed else "")
    last = "tries flash, memory-efficient, math, then cuDNN"
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") in _ENV_TRUE:
        why = f"TORCH_CUDNN_SDPA_DEPRIORITIZED is set: {version} {last}"
    elif tuple(capability) not in ((9, 0), (10, 0)):
        why = f"{version} on {sm} (not sm90/sm100) {last}"
    elif cudnn_version is not None and cudnn_version <= 91500:
        why = f"{version} with {cudnn} (not newer than 9.15.0) {last}"
    else:
        return ([_C, _F, _E, _M], f"{version} on {sm} with {cudnn} tries cuDNN first "
                                   "(TORCH_CUDNN_SDPA_DEPRIORITIZED is not set)")
    return [_F, _E, _M, _C], why


def _cudnn_version(cudnn_version):
    if cudnn_version is not None:
        return cudnn_version, ""
    try:
        found = torch.backends.cudnn.version()
    except Exception:
        found = None
    if found:
        return found, ""
    return None, "assumed: the CUDA wheels of torch 2.11 to 2.15 bundle one"


def _cudnn_str(version):
    if version is None:
        return "newer than 9.15.0"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def cuda_backend_without_device(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                enable_gqa=False, *, capability=(9, 0), cudnn_version=None):
    """The backend F.sdpa would pick for a call shaped like this on a CUDA device of this
    compute capability, decided by the rules above, without a device (meta tensors will do).
    Honours the enabled backends (sdpa_kernel(...), torch.backends.cuda.enable_*_sdp) and
    torch.use_deterministic_algorithms. Returns (SDPBackend, why: one line saying why)."""
    order, why_order = cuda_backend_order(capability, cudnn_version)
    cudnn_version, _ = _cudnn_version(cudnn_version)
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
        elif backend == _C:
            reason = _why_not_cudnn(query, key, value, attn_mask, is_causal, enable_gqa, capability, cudnn_version)
        else:  # a backend added to torch_ops/backends/ without its rule here (its README, step 3)
            raise NotImplementedError(f"attnstash.plan: attnstash/planner/cuda_rules.py has no rule for {backend}")
        if reason is None:
            return backend, "; ".join([why_order] + not_used + [f"{_NAMES[backend]} takes this call"])
        not_used.append(f"not {_NAMES[backend]}: {reason}")
    return SDPBackend.ERROR, "; ".join([why_order] + not_used + ["no backend is enabled that can run it"])
