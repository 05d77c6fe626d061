"""Reading the planner's arguments, each with an error that says what it takes."""
import operator

import torch
from torch.nn.attention import SDPBackend

from ..errors import ArgumentError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "cudnn_attention": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "flash_attention": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "efficient_attention": SDPBackend.EFFICIENT_ATTENTION,
            "mem_efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def dtype_of(dtype):
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in DTYPES:
        return DTYPES[dtype.lower().replace("torch.", "")]
    raise ArgumentError(f"attnstash.plan: dtype must be one of {', '.join(DTYPES)} (or the torch dtype), "
                        f"got {dtype!r}.")


def positive(name, value):
    if isinstance(value, bool):
        raise ArgumentError(f"attnstash.plan: {name} must be a positive int, got the bool {value!r}.")
    if value is None:
        raise ArgumentError(f"attnstash.plan: {name} must be a positive int, got None.")
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentError(f"attnstash.plan: {name} must be a positive int, got {type(value).__name__} "
                            f"{value!r}.") from None
    if value < 1:
        raise ArgumentError(f"attnstash.plan: {name} must be a positive int, got {value}.")
    return value


def backend_of(backend):
    if backend is None or isinstance(backend, SDPBackend):
        return backend
    if isinstance(backend, str) and backend.lower() in BACKENDS:
        return BACKENDS[backend.lower()]
    raise ArgumentError(f"attnstash.plan: backend must be an SDPBackend or one of {', '.join(BACKENDS)}, got "
                        f"{backend!r}.")


def capability_of(value):
    """(major, minor) from (9, 0), "sm90", "90", 90 or "9.0"."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return tuple(value)
    text = str(value).lower().removeprefix("sm").replace(".", "").replace("_", "")
    if isinstance(value, bool) or not text.isdigit() or len(text) < 2:
        raise ArgumentError(f"attnstash.plan: --sm (cuda_capability) must be a compute capability such as 80, 90 or "
                            f"100 (or (9, 0)), got {value!r}.")
    return int(text[:-1]), int(text[-1])
