"""The planner's forward: shape-only (every tensor derived from the weights has a shape, dtype
and strides but no data; the small integer bookkeeping derived from the inputs, such as
positions and masks, runs for real, so that models take the branches they take in training),
with every F.scaled_dot_product_attention call recorded, and which layer it ran in."""
import contextlib
import dataclasses
import threading
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from ..errors import PlanError
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..install.layers import class_has_attention

_aten = torch.ops.aten

# Results of real computations (no weights involved) larger than this become shape-only too,
# so that a [batch, 1, seq, seq] mask at a long sequence costs no memory. Views are exempt
# (they allocate nothing): an expanded [batch, seq] of positions keeps its values.
_REAL_LIMIT = 1 << 24


class ShapeOnly(torch.Tensor):
    """A tensor with a shape, dtype and strides but no data, that says it is on the CPU (so
    that Hugging Face takes its CPU paths: autocast and the like); a meta tensor inside.
    Reading a value gives 0 (False), and nonzero() finds nothing: shapes that depend on
    values (a mixture of experts' routing) come out empty, which changes no attention call."""

    @staticmethod
    def __new__(cls, meta):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                device="cpu", requires_grad=False)
        t.meta = meta
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"ShapeOnly({list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class ShapeOnlyMode(TorchDispatchMode):
    """Runs every op of the planner's forward: on meta tensors when a weight or a shape-only
    tensor is involved, for real otherwise (small integer bookkeeping: positions, masks)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _is_shaped(x):
    return (isinstance(x, ShapeOnly) or (isinstance(x, torch.Tensor) and x.device.type == "meta")
            or (isinstance(x, torch.device) and x.type == "meta"))


def _any(x, test):
    if isinstance(x, (list, tuple)):
        return any(_any(y, test) for y in x)
    if isinstance(x, dict):
        return any(_any(y, test) for y in x.values())
    return test(x)


def _map(x, fn):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x) if not hasattr(x, "_fields") else type(x)(*(_map(y, fn) for y in x))
    if isinstance(x, dict):
        return {k: _map(y, fn) for k, y in x.items()}
    return fn(x)


def _to_meta(x):
    if isinstance(x, ShapeOnly):
        return x.meta
    if isinstance(x, torch.Tensor):
        return x if x.device.type == "meta" else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                     device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def _on_meta(func, args, kwargs):
    args, kwargs = _map(args, _to_meta), _map(kwargs, _to_meta)
    if "device" in kwargs:
        kwargs["device"] = torch.device("meta")
    return func(*args, **kwargs)


def _wrap(t):
    return ShapeOnly(t) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t


_VALUE_OPS = {_aten._local_scalar_dense.default, _aten.nonzero.default}


def _run(func, args, kwargs):
    if not (_any(args, _is_shaped) or _any(kwargs, _is_shaped)):
        if func in _VALUE_OPS or any(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **kwargs)
        try:
            out = _on_meta(func, args, kwargs)
        except (NotImplementedError, RuntimeError):  # no meta kernel, or a result that depends on values
            return func(*args, **kwargs)  # real inputs (no weights involved): run it

        if not _any(out, lambda t: isinstance(t, torch.Tensor) and t.numel() > _REAL_LIMIT):
            return func(*args, **kwargs)
    elif func is _aten._local_scalar_dense.default:
        return False if args[0].dtype == torch.bool else 0
    elif func is _aten.nonzero.default:
        out = torch.empty((0, args[0].dim()), dtype=torch.long, device="meta")
    else:
        try:
            out = _on_meta(func, args, kwargs)
        except (NotImplementedError, RuntimeError) as e:
            raise PlanError(f"attnstash.plan: the shape-only forward cannot run {func} ({e}). The model computes "
                            "something from values the planner does not have; pass example inputs that make it "
                            "take another path, or report it with the model.") from e
    if func._schema.name.endswith("_") and args:  # in place: the caller keeps its own tensor
        return args[0]
    if "out" in kwargs:
        return kwargs["out"]
    return _map(out, _wrap)


def meta_copy(t):
    if t is None:
        return None
    if isinstance(t, ShapeOnly):
        return t.meta
    with _disable_current_modes():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@dataclasses.dataclass
class Call:
    layer: torch.nn.Module   # the innermost layer it ran in (None: outside every layer)
    module: torch.nn.Module  # the innermost module that calls attention (or the layer)
    query: torch.Tensor  # meta tensors with the call's shapes and strides
    key: torch.Tensor
    value: torch.Tensor
    mask: Optional[torch.Tensor]
    dropout_p: float
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool


def is_sdpa(func):
    """Whether a torch function mode's `func` is F.scaled_dot_product_attention (the builtin
    torch/nn/functional.py binds from torch._C._nn, read there at each call)."""
    return func is torch._C._nn.scaled_dot_product_attention


def sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
    """F.scaled_dot_product_attention's arguments, positional or keyword, as one tuple."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _RecordSdpa(TorchFunctionMode):
    """Records every F.sdpa call of the planned forward, with the modules it ran in, and
    returns a shape-only output in its place."""

    def __init__(self, calls, layers, stack):
        super().__init__()
        self.calls, self.layers, self.stack = calls, layers, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_sdpa(func):
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale, gqa = sdpa_arguments(*args, **kwargs)
        layer = next((m for m in reversed(self.stack) if id(m) in self.layers), None)
        module = next((m for m in reversed(self.stack) if class_has_attention(type(m))), layer)
        self.calls.append(Call(layer, module, meta_copy(q), meta_copy(k), meta_copy(v), meta_copy(mask),
                                float(dropout_p), bool(is_causal), scale, bool(gqa)))
        with _disable_current_modes():
            out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device="meta")
        return ShapeOnly(out)


@contextlib.contextmanager
def recording(calls, layers):
    """Record the F.sdpa calls of this thread's forward, and which of `layers` each ran in."""
    stack = []
    mine = threading.get_ident()

    def enter(module, args):
        if threading.get_ident() == mine:
            stack.append(module)

    def leave(module, args, out):
        if threading.get_ident() == mine and stack and stack[-1] is module:
            stack.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with _RecordSdpa(calls, {id(m) for m in layers}, stack):
            yield
    finally:
        for h in handles:
            h.remove()
