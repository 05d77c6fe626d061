"""What the attention stash would keep, per attention layer, before any training run.

    p = attnstash.plan("examples/configs/Qwen3-30B-A3B.json", batch_size=4, seq_len=4096,
                       dtype="bf16", budget="8GiB")
    print(p)                     # the table below
    p.per_layer_bytes            # {decoder layer index: bytes one micro-batch keeps}
    p.total_bytes, p.layers_that_fit

    python -m attnstash.plan CONFIG_JSON --batch 4 --seq 4096 [--dtype bf16] [--budget 8GiB]
                             [--device cuda|cpu] [--backend cudnn|flash|efficient] [--padded] [--sm 90]

How. The model is built from its Hugging Face config on the meta device (no weights, no
memory) and runs one training-mode forward of input_ids [batch, seq] (and, with padded=True,
an attention mask with padding) on shape-only tensors: every tensor derived from the
weights has a shape, dtype and strides but no data (the small integer bookkeeping derived
from the ids and the mask, such as positions, runs for real, so Hugging Face takes the
branches it takes in training). Hugging Face's ALL_ATTENTION_FUNCTIONS["sdpa"] entry is
intercepted, as the installer intercepts it, and inside it the one
F.scaled_dot_product_attention call: so each attention module's exact query, key, value,
mask, is_causal, scale and enable_gqa are known (grouped K/V, MLA's different head dims,
sliding-window masks and hybrids, whose non-attention layers do not count, included). For
each call the backend F.sdpa would pick is decided (below), and that backend's fused forward
runs on meta tensors: the bytes are those of its output, log-sum-exp and extras, exactly what
the stash keeps (torch_ops/stash_entries.cpp counts them the same way).

Which backend. On CPU: torch._fused_sdp_choice, asked on this machine (CPU flash, or math,
which the stash refuses). On CUDA with a CUDA device here: torch._fused_sdp_choice on that
device. On CUDA without one: the rules in attnstash.backends (cuda_backend_without_device),
for a device of compute capability `cuda_capability` (default sm90, H100/H200), and the table
says which backend they assumed and why. `backend=` forces one (as sdpa_kernel([backend])
would); a call that backend cannot run is reported as refused.

Budget. The installer stashes the LAST n attention layers, and the stash's budget declines
any keep that would pass it; so the layers that fit are counted from the last attention
layer: the largest n whose last n layers' bytes sum to at most the budget.
install_attention_stash(model, num_layers=n, max_bytes=budget) then keeps every one of them
(one micro-batch in flight: its forward, then its backward).
"""
import argparse
import contextlib
import copy
import dataclasses
import json
import operator
import os
import re
import sys
import threading
import types
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import backends

_aten = torch.ops.aten

# ---- results ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One attention call (one attention module's F.scaled_dot_product_attention) of one
    micro-batch, and what the stash keeps for it.

    module: the attention module's class name.
    query, key, value: shapes, [batch, heads, seq, head_dim], as F.sdpa receives them.
    mask: (shape, dtype name) of the attention mask F.sdpa receives, or None (is_causal).
    is_causal, enable_gqa, dropout_p: as passed to F.sdpa.
    backend: the SDPBackend F.sdpa would run (SDPBackend.ERROR: none can).
    why: how the backend was decided (asked torch, or the rules and what they found).
    output_bytes, logsumexp_bytes, extra_bytes: what the stash keeps, by part (0 if refused).
    refused: None, or why the stash would refuse this call (training would raise).
    """
    module: str
    query: Tuple[int, ...]
    key: Tuple[int, ...]
    value: Tuple[int, ...]
    mask: Optional[Tuple[Tuple[int, ...], str]]
    is_causal: bool
    enable_gqa: bool
    dropout_p: float
    backend: SDPBackend
    why: str
    output_bytes: int
    logsumexp_bytes: int
    extra_bytes: int
    refused: Optional[str]

    @property
    def bytes(self) -> int:
        return self.output_bytes + self.logsumexp_bytes + self.extra_bytes


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One attention layer: a decoder layer with attention through ALL_ATTENTION_FUNCTIONS.

    index: its index among the model's decoder layers (as install_attention_stash returns it).
    layer: the decoder layer's class name.
    calls: its attention calls (one per attention module, usually one).
    bytes: what one micro-batch keeps for it (the sum over its calls), or None if refused.
    refused: None, or why the stash would refuse this layer.
    """
    index: int
    layer: str
    calls: Tuple[CallPlan, ...]
    refused: Optional[str]

    @property
    def bytes(self) -> Optional[int]:
        return None if self.refused else sum(c.bytes for c in self.calls)


@dataclasses.dataclass(frozen=True)
class StashPlan:
    """What the stash keeps for one micro-batch of this shape. str() prints the table that
    `python -m attnstash.plan` prints.

    model: the model's class and model_type.  decoder_layers: how many decoder layers it has.
    batch_size, seq_len, dtype, padded: the micro-batch (padded: with a padding attention mask).
    device: "cpu" or "cuda" (the device type planned for).
    decided_by: how the backends were decided: "torch on <device>", "the rules in
        attnstash.backends (no CUDA device here)", or "backend=<name>" (plus which of these).
    layers: one LayerPlan per attention layer, in order.
    budget_bytes: the budget asked about, or None.
    """
    model: str
    decoder_layers: int
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    padded: bool
    device: str
    decided_by: str
    layers: Tuple[LayerPlan, ...]
    budget_bytes: Optional[int] = None

    @property
    def per_layer_bytes(self) -> Dict[int, Optional[int]]:
        """{decoder layer index: bytes one micro-batch keeps (None: refused)}, as
        attnstash.layer_stash_stats(model) reports them after that micro-batch's forward."""
        return {layer.index: layer.bytes for layer in self.layers}

    @property
    def total_bytes(self) -> int:
        """The bytes one micro-batch keeps with every attention layer stashed (refused layers
        count 0)."""
        return sum(layer.bytes or 0 for layer in self.layers)

    @property
    def layers_that_fit(self) -> Optional[int]:
        """How many attention layers, counted from the last, the budget holds (None without a
        budget): install_attention_stash(model, num_layers=this, max_bytes=budget)."""
        return None if self.budget_bytes is None else self.layers_within(self.budget_bytes)

    def layers_within(self, budget) -> int:
        """The largest n whose last n attention layers keep at most `budget` bytes (an int or
        a string such as "8GiB", as attnstash.parse_bytes reads it) for one micro-batch; a
        refused layer ends the count."""
        budget = _parse_bytes(budget)
        held, n = 0, 0
        for layer in reversed(self.layers):
            if layer.bytes is None or held + layer.bytes > budget:
                break
            held += layer.bytes
            n += 1
        return n

    def __str__(self):
        return _table(self)


# ---- the shape-only forward ----------------------------------------------------------------

# Results of real computations (no weights involved) larger than this become shape-only too,
# so that a [batch, 1, seq, seq] mask at a long sequence costs no memory. Views are exempt
# (they allocate nothing): an expanded [batch, seq] of positions keeps its values.
_REAL_LIMIT = 1 << 24


class _ShapeOnly(torch.Tensor):
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
        return f"_ShapeOnly({list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _ShapeOnlyMode(TorchDispatchMode):
    """Runs every op of the planner's forward: on meta tensors when a weight or a shape-only
    tensor is involved, for real otherwise (small integer bookkeeping: positions, masks)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _is_shaped(x):
    return (isinstance(x, _ShapeOnly) or (isinstance(x, torch.Tensor) and x.device.type == "meta")
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
    if isinstance(x, _ShapeOnly):
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
    return _ShapeOnly(t) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t


_VALUE_OPS = {_aten._local_scalar_dense.default, _aten.nonzero.default}


def _run(func, args, kwargs):
    if not (_any(args, _is_shaped) or _any(kwargs, _is_shaped)):
        if func in _VALUE_OPS or any(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **kwargs)
        try:
            out = _on_meta(func, args, kwargs)
        except Exception:  # an op whose result depends on values: run it
            return func(*args, **kwargs)
        if not _any(out, lambda t: isinstance(t, torch.Tensor) and t.numel() > _REAL_LIMIT):
            return func(*args, **kwargs)
    elif func is _aten._local_scalar_dense.default:
        return False if args[0].dtype == torch.bool else 0
    elif func is _aten.nonzero.default:
        out = torch.empty((0, args[0].dim()), dtype=torch.long, device="meta")
    else:
        try:
            out = _on_meta(func, args, kwargs)
        except Exception as e:
            raise RuntimeError(f"attnstash.plan: the shape-only forward cannot run {func} ({e}). The model computes "
                               "something from values the planner does not have; please report it with the "
                               "config.") from e
    if func._schema.name.endswith("_") and args:  # in place: the caller keeps its own tensor
        return args[0]
    if "out" in kwargs:
        return kwargs["out"]
    return _map(out, _wrap)


def _meta_copy(t):
    if t is None:
        return None
    if isinstance(t, _ShapeOnly):
        return t.meta
    with _disable_current_modes():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@dataclasses.dataclass
class _Call:
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


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _RecordSdpa(TorchFunctionMode):
    """Records every F.sdpa call of the planned forward, with the modules it ran in, and
    returns a shape-only output in its place."""

    def __init__(self, calls, layers, stack):
        super().__init__()
        self.calls, self.layers, self.stack = calls, layers, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        layer = next((m for m in reversed(self.stack) if id(m) in self.layers), None)
        module = next((m for m in reversed(self.stack) if _calls_attention(type(m))), layer)
        self.calls.append(_Call(layer, module, _meta_copy(q), _meta_copy(k), _meta_copy(v), _meta_copy(mask),
                                float(dropout_p), bool(is_causal), scale, bool(gqa)))
        with _disable_current_modes():
            out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device="meta")
        return _ShapeOnly(out)


def _calls_attention(cls):
    from .install import torch_adapter, transformers_adapter
    return transformers_adapter._class_has_attention(cls) or torch_adapter.class_calls_sdpa(cls)


@contextlib.contextmanager
def _recording(calls, layers):
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


# ---- inputs --------------------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def _parse_dtype(dtype):
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.lower().replace("torch.", "")]
    raise ValueError(f"attnstash.plan: dtype must be one of {', '.join(_DTYPES)} (or the torch dtype), got "
                     f"{dtype!r}.")


def _parse_bytes(value):
    from .budget import parse_bytes
    count = parse_bytes(value)
    if count is None:
        raise ValueError("attnstash.plan: a budget must be a byte count, got None.")
    return count


def _positive(name, value):
    if isinstance(value, bool):
        raise ValueError(f"attnstash.plan: {name} must be a positive int, got the bool {value!r}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"attnstash.plan: {name} must be a positive int, got {type(value).__name__} "
                         f"{value!r}.") from None
    if value < 1:
        raise ValueError(f"attnstash.plan: {name} must be a positive int, got {value}.")
    return value


def _parse_backend(backend):
    if backend is None:
        return None
    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "cudnn_attention": SDPBackend.CUDNN_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION, "flash_attention": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "efficient_attention": SDPBackend.EFFICIENT_ATTENTION,
             "mem_efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if isinstance(backend, SDPBackend):
        return backend
    if isinstance(backend, str) and backend.lower() in names:
        return names[backend.lower()]
    raise ValueError(f"attnstash.plan: backend must be an SDPBackend or one of {', '.join(names)}, got {backend!r}.")


def load_config(source):
    """A transformers config from a PretrainedConfig, a dict of config.json's values, or the
    path of a config.json (or of a folder that has one). Raises ValueError, saying what is
    wrong, for anything else."""
    import transformers
    if isinstance(source, transformers.PretrainedConfig):
        return copy.deepcopy(source)
    where = "the config"
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        where = path
        try:
            with open(path) as f:
                source = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"attnstash.plan: no such config file: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"attnstash.plan: {path} is not valid JSON: {e}") from None
    if not isinstance(source, dict):
        raise ValueError("attnstash.plan: expected a transformers config, a model, a dict of config.json values or "
                         f"the path of a config.json; got {type(source).__name__}.")
    values = dict(source)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ValueError(f"attnstash.plan: {where} has no \"model_type\": it must be a Hugging Face config.json "
                         "(model_type, num_hidden_layers, hidden_size, num_attention_heads, ...).")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type in CONFIG_MAPPING:
        _check_value_types(where, CONFIG_MAPPING[model_type], values)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # a value of the wrong type or out of range: transformers' own words, on one line
        detail = " ".join(str(e).split())
        raise ValueError(f"attnstash.plan: {where}: transformers {transformers.__version__} cannot build a config "
                         f"for model_type {model_type!r} from it: {detail}") from None


_COUNT = re.compile(r"^num_|^n_|_size$|_heads$|_layers$|_dim$")  # sizes and counts, which are positive


def _check_value_types(where, config_class, values):
    """A number the config class defaults to, given as something else, named before transformers
    trips over it somewhere deeper (transformers 4.x has no typed configs)."""
    try:
        default = config_class()
    except Exception:
        return
    for name, value in values.items():
        expected = getattr(default, name, None)
        numeric = isinstance(expected, (int, float)) and not isinstance(expected, bool) and value is not None
        if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"attnstash.plan: {where}: \"{name}\" must be a number (like {expected!r}), got "
                             f"{value!r}.")
        if numeric and value <= 0 < expected and _COUNT.search(name):
            raise ValueError(f"attnstash.plan: {where}: \"{name}\" must be positive (like {expected!r}), got "
                             f"{value!r}.")


def _from_model(model):
    """(config, model class, dtype, device type) of a Hugging Face model (or a PEFT wrapper)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(f"attnstash.plan: {type(model).__name__} has no Hugging Face config.")
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"attnstash.plan: the model uses attn_implementation={impl!r}; the stash replaces SDPA "
                         "attention only. Load it with attn_implementation=\"sdpa\".")
    param = next(iter(base.parameters()), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else None
    device = param.device.type if param is not None and param.device.type != "meta" else None
    return copy.deepcopy(config), type(base), dtype, device


def _config_dtype(config):
    # (transformers 5 warns on reading torch_dtype; both versions have dtype)
    value = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value.lower().replace("torch.", ""))
    return value if value in _DTYPES.values() else None


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _meta_model(config, model_class, dtype):
    """The model on the meta device, in train mode, with SDPA attention."""
    import transformers
    config.use_cache = False
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm's meta kernel takes bf16 only; shapes are the same
    try:
        with torch.device("meta"), _no_init_weights():
            if model_class is not None:
                model = model_class._from_config(config, attn_implementation="sdpa", dtype=dtype)
            else:
                try:
                    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                          dtype=dtype)
                except ValueError as e:
                    if "Unrecognized configuration class" not in str(e):
                        raise
                    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa", dtype=dtype)
    except Exception as e:  # (a config value transformers' model code cannot use: its own words, on one line)
        detail = " ".join(str(e).split())
        raise ValueError(f"attnstash.plan: transformers {transformers.__version__} cannot build "
                         f"{getattr(config, 'model_type', type(config).__name__)} with attn_implementation=\"sdpa\": "
                         f"{type(e).__name__}: {detail}") from None
    return model.train()


def _shape_only_forward(model, layers, batch_size, seq_len, padded):
    """The model's F.sdpa calls in one training forward of [batch_size, seq_len] ids, in order."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    kwargs = {}
    if padded:
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[0, 0] = 0  # the first row left-padded by one token: any padding makes Hugging Face build a 4-D mask
        kwargs["attention_mask"] = mask
    calls = []
    try:
        with _recording(calls, layers), torch.no_grad(), _ShapeOnlyMode():
            model(input_ids=ids, **kwargs)
    except Exception as e:
        raise RuntimeError(f"attnstash.plan: the shape-only training forward of {type(model).__name__} with "
                           f"input_ids [{batch_size}, {seq_len}] failed: {e}") from e
    return calls


# ---- the backend and the bytes -------------------------------------------------------------

def _expanded(t, device):
    """A real tensor on `device` shaped like t with one row of storage (what the backend
    choice looks at: shapes, dtypes, the last stride)."""
    if t is None:
        return None
    return torch.empty((1,) * (t.dim() - 1) + (t.shape[-1],), dtype=t.dtype, device=device).expand(t.shape)


def _decide(call, device, forced, capability):
    """(SDPBackend, why) for one call."""
    sdpa_args = (call.query, call.key, call.value, call.mask, call.dropout_p, call.is_causal)
    if device.type == "cuda" and not torch.cuda.is_available():
        if forced is not None:
            with sdpa_kernel([forced]):
                chosen, why = backends.cuda_backend_without_device(*sdpa_args, enable_gqa=call.enable_gqa,
                                                                   capability=capability)
            return chosen, f"backend={forced.name.lower()}; " + why
        return backends.cuda_backend_without_device(*sdpa_args, enable_gqa=call.enable_gqa, capability=capability)
    q, k, v, mask = (_expanded(t, device) for t in (call.query, call.key, call.value, call.mask))
    with sdpa_kernel([forced]) if forced is not None else contextlib.nullcontext():
        try:
            chosen = backends.chosen_backend(q, k, v, mask, call.dropout_p, call.is_causal, call.scale,
                                             call.enable_gqa)
        except RuntimeError as e:
            chosen = SDPBackend.ERROR
            return chosen, f"torch on {device} refuses the call: {e}"
    prefix = f"backend={forced.name.lower()}; " if forced is not None else ""
    return chosen, prefix + f"torch._fused_sdp_choice on {device}"


def _plan_call(call, device, forced, capability):
    chosen, why = _decide(call, device, forced, capability)
    row = backends.kept_backend(device, chosen) if chosen not in (SDPBackend.ERROR,) else None
    refused = None
    if call.dropout_p > 0:
        refused = (f"attention dropout ({call.dropout_p}): the recompute could not reproduce its random mask "
                   "(set the config's attention_dropout to 0)")
    elif chosen == SDPBackend.ERROR:
        refused = (f"no enabled SDPA backend can run it on {device.type} (F.sdpa raises; see why above)")
    elif row is None:
        refused = (f"F.sdpa would run {chosen.name.lower()} on {device.type}, which the stash cannot keep "
                   "(training with this layer stashed raises; see why above)")
    else:
        refused = row.refuses(call.query, call.key, call.value)
    sizes = (0, 0, 0) if refused else backends.kept_bytes_of(row, call.query, call.key, call.value, call.mask,
                                                             call.is_causal, call.scale)
    return CallPlan(module=type(call.module).__name__, query=tuple(call.query.shape), key=tuple(call.key.shape),
                    value=tuple(call.value.shape),
                    mask=None if call.mask is None else (tuple(call.mask.shape),
                                                         str(call.mask.dtype).replace("torch.", "")),
                    is_causal=call.is_causal, enable_gqa=call.enable_gqa, dropout_p=call.dropout_p, backend=chosen,
                    why=why, output_bytes=sizes[0], logsumexp_bytes=sizes[1], extra_bytes=sizes[2], refused=refused)


def plan(config_or_model, batch_size: int, seq_len: int, dtype=None, device=None, *, budget=None,
         padded: bool = False, backend=None, cuda_capability=(9, 0)) -> StashPlan:
    """What the attention stash keeps per attention layer for one micro-batch of
    [batch_size, seq_len] token ids, without weights and without running attention.

    Args:
        config_or_model: a Hugging Face model (or a PEFT wrapper of one; its config is used,
            the model itself is not run), a transformers config, a dict of config.json's values,
            or the path of a config.json (or of a folder with one).
        batch_size, seq_len: the micro-batch, input_ids [batch_size, seq_len].
        dtype: the dtype attention runs in ("bf16", "fp16", "fp32" or the torch dtype).
            Default: the model's parameters' dtype, else the config's dtype, else bfloat16.
        device: "cpu", "cuda" or "cuda:N" (the device type planned for). Default: the model's
            device, else "cuda".
        budget: a byte budget (an int, or a string such as "8GiB", as attnstash.parse_bytes
            reads it): the result says how many attention layers, from the last, it holds.
        padded: plan for batches with padding (Hugging Face then passes a 4-D mask, which
            changes the backend on CUDA: flash takes no mask).
        backend: force a backend ("cudnn", "flash", "efficient", or an SDPBackend), as
            sdpa_kernel([backend]) would; calls it cannot run are reported as refused.
        cuda_capability: the compute capability planned for on CUDA when this machine has no
            CUDA device, e.g. (9, 0) for H100/H200 (the default), (8, 0) for A100.

    Returns:
        A StashPlan: per_layer_bytes {decoder layer index: bytes}, total_bytes,
        layers_that_fit (with a budget), the layers' calls and backends; print it for the table.

    Raises:
        ValueError: for arguments it cannot read (naming what was expected), a config
            transformers cannot build with SDPA, or a model without attention layers the
            stash can serve (the installer's own message).
        RuntimeError: if the model's shape-only forward fails (it computes something from
            values the planner does not have; the message names the op).
    """
    from . import install
    from .errors import InstallError
    batch_size, seq_len = _positive("batch_size", batch_size), _positive("seq_len", seq_len)
    budget_bytes = None if budget is None else _parse_bytes(budget)
    forced = _parse_backend(backend)
    if isinstance(config_or_model, torch.nn.Module):
        config, model_class, model_dtype, model_device = _from_model(config_or_model)
    else:
        config, model_class, model_dtype, model_device = load_config(config_or_model), None, None, None
    dtype = _parse_dtype(dtype) if dtype is not None else (model_dtype or _config_dtype(config) or torch.bfloat16)
    try:
        device = torch.device(device if device is not None else (model_device or "cuda"))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"attnstash.plan: device must be \"cpu\", \"cuda\" or \"cuda:N\", got {device!r} ({e}).") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attnstash.plan: the stash keeps attention on cpu and cuda; got device {device}.")
    if device.type == "cuda" and torch.cuda.is_available() and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    capability = _capability(cuda_capability)

    model = _meta_model(config, model_class, dtype)
    try:
        found = install.find_layers(model)
    except InstallError as e:
        raise ValueError(f"attnstash.plan: {str(e).removeprefix('attnstash: ')}") from None
    stashable = [(i, f) for i, f in enumerate(found) if f.stashable]
    calls = _shape_only_forward(model, [f.module for _, f in stashable], batch_size, seq_len, padded)

    layers = []
    for index, f in stashable:
        mine = [c for c in calls if c.layer is f.module]
        planned = tuple(_plan_call(c, device, forced, capability) for c in mine)
        refused = next((c.refused for c in planned if c.refused), None)
        if not mine:
            refused = "its forward called no F.scaled_dot_product_attention (training with this layer stashed raises)"
        layers.append(LayerPlan(index=index, layer=type(f.module).__name__, calls=planned, refused=refused))

    if device.type == "cuda" and not torch.cuda.is_available():
        decided_by = (f"the rules in attnstash.backends for sm{capability[0]}{capability[1]} "
                      "(no CUDA device here)")
    else:
        decided_by = f"torch on {device}"
    if forced is not None:
        decided_by = f"backend={forced.name.lower()}, " + decided_by
    name = f"{type(model).__name__} ({getattr(config, 'model_type', '?')})"
    return StashPlan(model=name, decoder_layers=len(found), batch_size=batch_size,
                     seq_len=seq_len, dtype=dtype, padded=padded, device=device.type, decided_by=decided_by,
                     layers=tuple(layers), budget_bytes=budget_bytes)


# ---- the table -----------------------------------------------------------------------------

def _human(n):
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranges(indices):
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts)


def _dims(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _call_key(call):
    return (call.module, call.query, call.key, call.value, call.mask, call.backend, call.bytes, call.refused)


def _table(p):
    dtype = str(p.dtype).replace("torch.", "")
    lines = [f"attnstash plan: {p.model}, {len(p.layers)} attention layers of {p.decoder_layers} decoder layers",
             f"micro-batch: batch {p.batch_size} x seq {p.seq_len}, {dtype}, "
             + ("padded (a 4-D attention mask)" if p.padded else "unpadded"),
             f"device: {p.device}; backend decided by {p.decided_by}",
             "kept per layer and micro-batch in flight: output + log-sum-exp + the backend's extras", ""]
    header = ("layers", "attention", "query", "key / value", "mask", "backend", "output", "log-sum-exp", "extras",
              "bytes per layer")
    rows = []
    groups = []  # consecutive layers with the same calls
    for layer in p.layers:
        key = tuple(_call_key(c) for c in layer.calls) + (layer.refused,)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(layer)
        else:
            groups.append((key, [layer]))
    for _, members in groups:
        first = members[0]
        label = _ranges([m.index for m in members])
        if len(members) > 1:
            label += f" ({len(members)})"
        for i, call in enumerate(first.calls or [None]):
            if call is None:
                rows.append((label, "-", "-", "-", "-", "-", "-", "-", "-", "refused"))
                continue
            kv = _dims(call.key) if call.key == call.value else f"{_dims(call.key)} / {_dims(call.value)}"
            mask = "-" if call.mask is None else f"{_dims(call.mask[0])} {call.mask[1]}"
            if call.is_causal:
                mask = "causal"
            total = "" if i + 1 < len(first.calls) else ("refused" if first.refused else f"{first.bytes:,}")
            rows.append((label if i == 0 else "", call.module, _dims(call.query), kv, mask,
                         call.backend.name.lower(), f"{call.output_bytes:,}", f"{call.logsumexp_bytes:,}",
                         f"{call.extra_bytes:,}", total))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    right = {6, 7, 8, 9}
    for r in [header] + rows:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip())
    lines.append("")
    lines.append(f"total, all {len(p.layers)} attention layers stashed: {p.total_bytes:,} bytes "
                 f"({_human(p.total_bytes)}) per micro-batch in flight")
    if p.budget_bytes is not None:
        n = p.layers_that_fit
        held = sum(layer.bytes for layer in p.layers[len(p.layers) - n:]) if n else 0
        lines.append(f"budget {p.budget_bytes:,} bytes ({_human(p.budget_bytes)}): the last {n} of "
                     f"{len(p.layers)} attention layers fit ({held:,} bytes)")
        if n:
            lines.append(f"    attnstash.install_attention_stash(model, num_layers={n}, max_bytes={p.budget_bytes})")
    reasons = []
    for layer in p.layers:
        for call in layer.calls:
            line = f"{call.backend.name.lower()}: {call.why}"
            if line not in reasons:
                reasons.append(line)
    lines.append("")
    lines.extend("why " + r for r in reasons)
    refused = {}
    for layer in p.layers:
        if layer.refused:
            refused.setdefault(layer.refused, []).append(layer.index)
    for why, indices in refused.items():
        lines.append(f"refused, layers {_ranges(indices)}: {why}")
    return "\n".join(lines)


# ---- the command ---------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser(
        prog="python -m attnstash.plan",
        description="What the attention stash keeps per attention layer for one micro-batch, from a Hugging Face "
                    "config.json alone (no weights), and how many layers fit a budget.")
    p.add_argument("config", help="a Hugging Face config.json (or a folder with one), e.g. "
                                  "examples/configs/Qwen3-30B-A3B.json")
    p.add_argument("--batch", type=int, required=True, help="micro-batch size")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the config's dtype, else bf16)")
    p.add_argument("--budget", default=None, help="a byte budget such as 8GiB, 512MB or 1000000: how many layers "
                                                  "fit, counted from the last")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--backend", default=None, help="force a backend: cudnn, flash or efficient")
    p.add_argument("--padded", action="store_true", help="batches with padding (a 4-D attention mask)")
    p.add_argument("--sm", default="90", help="without a CUDA device: the compute capability planned for, e.g. "
                                              "90 (H100/H200, the default), 80 (A100), 100 (B200)")
    return p


def _capability(value):
    """(major, minor) from (9, 0), "sm90", "90", 90 or "9.0"."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return tuple(value)
    text = str(value).lower().removeprefix("sm").replace(".", "").replace("_", "")
    if isinstance(value, bool) or not text.isdigit() or len(text) < 2:
        raise ValueError(f"attnstash.plan: --sm (cuda_capability) must be a compute capability such as 80, 90 or "
                         f"100 (or (9, 0)), got {value!r}.")
    return int(text[:-1]), int(text[-1])


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result = plan(args.config, args.batch, args.seq, dtype=args.dtype, device=args.device, budget=args.budget,
                      padded=args.padded, backend=args.backend, cuda_capability=_capability(args.sm))
    except (ValueError, RuntimeError) as e:  # a config it cannot read (2), a forward that failed (1): one line
        print(f"{parser.prog}: error: {str(e).removeprefix('attnstash.plan: ')}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    print(result)
    return 0


class _CallableModule(types.ModuleType):
    """`import attnstash.plan` binds the module to attnstash.plan; calling it plans, so that
    attnstash.plan(...) works whichever of the module and the function the name holds."""

    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
