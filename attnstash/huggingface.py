"""The Hugging Face installer: stash the attention of a model's last decoder layers.

    layers = attnstash.install_attention_stash(model, num_layers=8)
    ...train with model.gradient_checkpointing_enable(
           gradient_checkpointing_kwargs={"use_reentrant": True})   # or False...
    attnstash.uninstall_attention_stash(model)

It wraps the "sdpa" entry of transformers' ALL_ATTENTION_FUNCTIONS once. For a stashed
layer the wrapper runs Hugging Face's own sdpa function, with its one call of
F.scaled_dot_product_attention routed to attnstash::sdpa_fwd_keep (anchored on the
layer's input), so every detail of that function (grouped K/V, is_causal rules, mask
slicing, output layout) is Hugging Face's, on any transformers version. The op decides
whether a call keeps, replays or is a plain SDPA call, under reentrant or non-reentrant
checkpointing; this module only refuses the training set-ups in which a kept output
could not be replayed.
"""
import itertools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import ops

_ATTR = "_attnstash"  # a _LayerStash, on each stashed decoder layer and on its self_attn
_slots = itertools.count(1)
_lock = threading.Lock()
_models = weakref.WeakKeyDictionary()  # model -> [_LayerStash]
_wrapped = None  # (ALL_ATTENTION_FUNCTIONS, original "sdpa" entry, whether it was a local override)


class _LayerStash:
    """What one stashed decoder layer needs: its slot in the stash, its name for error
    messages, its hooks, and the anchor of the forward in progress."""

    def __init__(self, index, name, slot):
        self.index, self.name, self.slot = index, name, slot
        self.anchor = None  # the layer input while its forward runs, else None
        self.handles = []


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _RouteSdpaToStash(TorchFunctionMode):
    """Inside one stashed attention call, route F.scaled_dot_product_attention to
    attnstash::sdpa_fwd_keep; every other function runs unchanged."""

    def __init__(self, stash):
        super().__init__()
        self.stash, self.calls = stash, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(f"attnstash: {self.stash.name} called scaled_dot_product_attention more than once "
                               "in one attention call; the stash keeps one output per layer and forward.")
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        return ops.sdpa_fwd_keep(q, k, v, self.stash.anchor, self.stash.slot, mask, dropout_p, is_causal, scale, gqa)


def _stashed_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    original = _wrapped[1]
    stash = getattr(module, _ATTR, None)
    if stash is None or stash.anchor is None:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    try:
        with _RouteSdpaToStash(stash):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
    except RuntimeError as e:
        if str(e).startswith("attnstash"):
            raise RuntimeError(f"attnstash: {stash.name}: {e}") from e
        raise


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _before_layer(stash, layer, args, kwargs):
    """Forward pre-hook: record the anchor, or refuse a forward that could not be replayed.
    Reentrant checkpointing runs the first forward with grad off, non-reentrant with grad
    on under its saved-tensor hooks; the op tells the two apart and keeps for either."""
    stash.anchor = None
    if not layer.training:  # eval and generation: the original attention, untouched
        return
    checkpointed = bool(getattr(layer, "gradient_checkpointing", False))
    first_forward_with_grad = torch.is_grad_enabled() and not _in_backward()
    if first_forward_with_grad and not checkpointed:
        raise RuntimeError(
            f"attnstash: {stash.name} is stashed but runs a training forward without activation checkpointing, "
            "so the stash could only cost memory. Enable checkpointing on every stashed layer: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True}) "
            "(or False; with every_n_layers=1), or uninstall the stash.")
    if not checkpointed and not _in_backward():  # a no-grad training forward: nothing will be recomputed
        return
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError(f"attnstash: {stash.name} was called without a hidden_states tensor (got "
                           f"{type(hidden).__name__}); the stash anchors on the decoder layer's input.")
    reentrant_first_forward = not torch.is_grad_enabled() and not _in_backward()
    if reentrant_first_forward and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise RuntimeError(
            f"attnstash: {stash.name} runs a reentrant checkpoint under saved-tensor hooks (offloaded "
            "checkpointing: gradient_checkpointing_enable(offload=True), or torch.autograd.graph.save_on_cpu): "
            "they give the recompute a copy of the layer input, so it could not find its kept output. Use "
            "non-reentrant checkpointing with offloading (use_reentrant=False), or turn offloading off.")
    stash.anchor = hidden
    if not _in_backward() and hidden.requires_grad:
        # Release what this forward keeps as soon as its input is freed (its graph was
        # dropped without a backward), not only at the next keep or replay.
        weakref.finalize(hidden, ops.release_anchor, hidden.data_ptr())


def _after_layer(stash, layer, args, kwargs, output):
    stash.anchor = None  # never keep the layer input alive past its forward


def _entry_points():
    missing = []
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        GradientCheckpointingLayer = None
        missing.append("transformers.modeling_layers.GradientCheckpointingLayer")
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        if "sdpa" not in ALL_ATTENTION_FUNCTIONS:
            missing.append('ALL_ATTENTION_FUNCTIONS["sdpa"]')
    except ImportError:
        ALL_ATTENTION_FUNCTIONS = None
        missing.append("transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS")
    for name in ("_current_graph_task_id", "_autograd"):
        if not hasattr(torch._C, name):
            missing.append(f"torch._C.{name}")
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        missing.append("torch._C._autograd._top_saved_tensors_default_hooks")
    if missing:
        import transformers
        raise ValueError(f"attnstash: install_attention_stash needs {', '.join(missing)}, which transformers "
                         f"{transformers.__version__} with torch {torch.__version__} lacks. Use transformers 4.57 "
                         "or 5.x with torch 2.5 or newer.")
    return GradientCheckpointingLayer, ALL_ATTENTION_FUNCTIONS


def decoder_layers(model):
    """The model's decoder layers: Hugging Face GradientCheckpointingLayers with a self_attn."""
    layer_class, _ = _entry_points()
    return [m for m in model.modules() if isinstance(m, layer_class) and hasattr(m, "self_attn")]


def install_attention_stash(model, num_layers):
    """Stash the attention of the last `num_layers` decoder layers of a Hugging Face model
    trained with reentrant gradient checkpointing. Returns their indices among the
    model's decoder layers. Raises ValueError for a model or argument it cannot serve."""
    _, interface = _entry_points()
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise ValueError(f"attnstash: num_layers must be an int, got {type(num_layers).__name__} {num_layers!r}.")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"attnstash: the model uses attn_implementation={impl!r}; the stash replaces SDPA "
                         "attention only. Load it with attn_implementation=\"sdpa\".")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"attnstash: {type(model).__name__} has no decoder layers (Hugging Face "
                         "GradientCheckpointingLayer modules with a self_attn) to stash.")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"attnstash: num_layers must be between 1 and the {len(layers)} decoder layers of "
                         f"{type(model).__name__}, got {num_layers}.")
    first = len(layers) - num_layers
    for index in range(first, len(layers)):
        if hasattr(layers[index], _ATTR):
            raise ValueError(f"attnstash: decoder layer {index} of {type(model).__name__} already has the stash; "
                             "call uninstall_attention_stash(model) before installing again.")
    global _wrapped
    with _lock:
        if _wrapped is None:
            had_local = "sdpa" in getattr(interface, "_local_mapping", {})
            _wrapped = (interface, interface["sdpa"], had_local)
            interface["sdpa"] = _stashed_sdpa
        stashes = _models.setdefault(model, [])
        for index in range(first, len(layers)):
            layer = layers[index]
            stash = _LayerStash(index, f"decoder layer {index} ({type(layer).__name__})", next(_slots))
            stash.handles = [
                layer.register_forward_pre_hook(lambda m, a, k, s=stash: _before_layer(s, m, a, k), with_kwargs=True),
                layer.register_forward_hook(lambda m, a, k, o, s=stash: _after_layer(s, m, a, k, o),
                                            with_kwargs=True, always_call=True),
            ]
            setattr(layer, _ATTR, stash)
            setattr(layer.self_attn, _ATTR, stash)
            stashes.append(stash)
    return list(range(first, len(layers)))


def uninstall_attention_stash(model):
    """Undo install_attention_stash for this model: its hooks and attributes go, other
    models keep theirs, and once no model has the stash the original "sdpa" entry is back."""
    global _wrapped
    with _lock:
        stashes = _models.pop(model, None)
        if stashes is None:
            raise ValueError(f"attnstash: {type(model).__name__} has no attention stash installed.")
        for layer in decoder_layers(model):
            if getattr(layer, _ATTR, None) in stashes:
                delattr(layer, _ATTR)
                delattr(layer.self_attn, _ATTR)
        for stash in stashes:
            for handle in stash.handles:
                handle.remove()
            stash.anchor = None
        if not _models and _wrapped is not None:
            interface, original, had_local = _wrapped
            if had_local:
                interface["sdpa"] = original
            else:
                del interface["sdpa"]  # the local override goes; the global entry shows again
            _wrapped = None


def layer_stash_stats(model):
    """{decoder layer index: (entries, bytes)} held now for this model's stashed layers."""
    held = ops.held_by_slot()
    return {s.index: held.get(s.slot, (0, 0)) for s in _models.get(model, [])}
