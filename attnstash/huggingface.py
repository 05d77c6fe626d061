"""The Hugging Face installer: stash the attention of a model's last attention layers.

    layers = attnstash.install_attention_stash(model)        # every attention layer
    ... train with gradient checkpointing, reentrant or not ...
    attnstash.uninstall_attention_stash(model)

What it stashes. A decoder layer is a transformers GradientCheckpointingLayer (whatever it
is called and wherever it sits); its attention is each submodule whose class calls the
attention registry ALL_ATTENTION_FUNCTIONS (found from the class's source, so that
`self_attn`, `attn`, `attention`, several attentions per layer and one attention shared by
several layers are all found, and Mamba, linear-attention and other layers are skipped).
An attention layer is a decoder layer with at least one such attention; `num_layers`
counts attention layers, from the last.

How. It wraps the "sdpa" entry of ALL_ATTENTION_FUNCTIONS and GradientCheckpointingLayer's
__call__ once, while any model has the stash; both pass everything else through. For a
stashed layer, the wrapper runs Hugging Face's own sdpa function with its one call of
F.scaled_dot_product_attention routed to attnstash::sdpa_fwd_keep, anchored on the layer's
input, so every detail of that function (grouped K/V, is_causal rules, mask slicing,
output layout) is Hugging Face's own. The op decides whether a call keeps, replays or is a
plain SDPA call. This module adds what only the layer can know: the grad mode outside the
checkpoint (a forward no backward can reach keeps nothing), the graph that owns what a
reentrant forward kept (dropped or interrupted forwards release it at once), one anchor
per thread and call (several threads may train one model), and a clear error for every
set-up in which a kept output could not be replayed or nothing would be kept.
"""
import copy
import functools
import gc
import inspect
import itertools
import operator
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import ops

_ATTR = "_attnstash"  # a _LayerStash, on each stashed decoder layer
_SLOTS = "_attnstash_slots"  # {stash token: slot}, on each stashed attention module
_slots = itertools.count(1)
_lock = threading.RLock()
_live = weakref.WeakSet()  # every _LayerStash in use (deep copies of models included)
_patched = None  # (ALL_ATTENTION_FUNCTIONS, the sdpa function wrapped, the class-wide entry, the local one, GCL __call__)
_tls = threading.local()  # .frames: the stashed layers this thread is running, innermost last


class _LayerStash:
    """One stashed decoder layer: its index and name (for messages), and a stash slot for
    each of its attention modules. Each attention module carries its slot too, under this
    stash's token (an attention module shared by several layers has one per layer), so that
    the copies of a module that torch.nn.DataParallel makes (which share its __dict__'s
    contents) find it as well."""

    def __init__(self, index, name, attentions):
        self.index, self.name, self.token = index, name, next(_slots)
        self.slots = {}
        for module in attentions:
            self._give_slot(module)
        _live.add(self)

    def _give_slot(self, module):
        self.slots[module] = next(_slots)
        module.__dict__.setdefault(_SLOTS, {})[self.token] = self.slots[module]

    def forget(self):
        for module in self.slots:
            tokens = module.__dict__.get(_SLOTS, {})
            tokens.pop(self.token, None)
            if not tokens:
                module.__dict__.pop(_SLOTS, None)
        _live.discard(self)

    def __deepcopy__(self, memo):
        # A deep copy of a stashed model carries a working install of its own: the copied
        # attention modules, with slots of their own, so that it never shares records with
        # the original.
        twin = _LayerStash.__new__(_LayerStash)
        memo[id(self)] = twin
        twin.index, twin.name, twin.token = self.index, self.name, next(_slots)
        twin.slots = {}
        for module in self.slots:
            copied = copy.deepcopy(module, memo)
            copied.__dict__.get(_SLOTS, {}).pop(self.token, None)
            twin._give_slot(copied)
        _live.add(twin)
        return twin


class _Frame:
    """One forward (first or recompute) of a stashed layer in this thread. It holds its
    layer and anchor weakly: a forward interrupted before its frame ends (Ctrl-C is no
    Exception, so forward hooks do not run for it) leaves nothing held behind."""
    __slots__ = ("_stash", "anchor", "keep", "first", "routed", "rng", "kept", "__weakref__")

    def __init__(self, stash, hidden, keep, first):
        self._stash, self.anchor = weakref.ref(stash), weakref.ref(hidden)
        self.keep, self.first = keep, first
        self.routed = {}  # id(attention module) -> calls routed to the op
        self.rng = None   # the RNG state at the layer's start, when the recompute would not restore it
        self.kept = []    # records a reentrant first forward kept (for its graph to own)

    @property
    def stash(self):
        return self._stash()


def _frames():
    frames = getattr(_tls, "frames", None)
    if frames is None:
        frames = _tls.frames = []
    return frames


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


# ---- which modules are attention --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _class_calls_registry(cls):
    """Whether a module class (or a transformers base class of it) calls ALL_ATTENTION_FUNCTIONS."""
    for klass in cls.__mro__:
        if klass is torch.nn.Module or not klass.__module__.startswith("transformers"):
            continue
        try:
            if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(klass):
                return True
        except (OSError, TypeError):
            continue
    return False


@functools.lru_cache(maxsize=None)
def _class_calls_sdpa_directly(cls):
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def _own_modules(layer, layer_class):
    """The layer's submodules that are not inside another decoder layer nested in it."""
    stack = list(layer.children())
    while stack:
        module = stack.pop()
        if isinstance(module, layer_class):
            continue
        yield module
        stack.extend(module.children())


def decoder_layers(model):
    """The model's decoder layers: its transformers GradientCheckpointingLayers, in order."""
    layer_class, _ = _entry_points()
    return [m for m in model.modules() if isinstance(m, layer_class)]


def attention_layers(model):
    """[(index, layer, [attention modules])] for the model's decoder layers that have
    attention through ALL_ATTENTION_FUNCTIONS; index counts all decoder layers."""
    layer_class, _ = _entry_points()
    found = []
    for index, layer in enumerate(decoder_layers(model)):
        attentions = []
        for module in _own_modules(layer, layer_class):
            if _class_calls_registry(type(module)) and module not in attentions:
                attentions.append(module)
        if attentions:
            found.append((index, layer, attentions))
    return found


def _describe_missing_attention(model, layers):
    """What a model without stashable attention has instead, for the error."""
    from transformers import PreTrainedModel
    registry = sorted({type(m).__name__ for m in model.modules() if _class_calls_registry(type(m))
                       and not isinstance(m, PreTrainedModel)})
    direct = sorted({type(m).__name__ for m in model.modules() if _class_calls_sdpa_directly(type(m))
                     and "Attention" in type(m).__name__})
    named = sorted({type(m).__name__ for m in model.modules() if ("Attention" in type(m).__name__
                    or "Attn" in type(m).__name__) and type(m).__name__ not in registry + direct})
    parts = [f"{len(layers)} decoder layers (GradientCheckpointingLayer)"]
    if registry:
        parts.append("attention that calls ALL_ATTENTION_FUNCTIONS (" + ", ".join(registry) + ") outside any "
                     "GradientCheckpointingLayer, whose layers transformers checkpoints its own way here")
    if direct:
        parts.append("attention that calls F.scaled_dot_product_attention directly (" + ", ".join(direct) + "), "
                     "which attnstash cannot reach: it routes ALL_ATTENTION_FUNCTIONS['sdpa'] only")
    if named:
        parts.append("modules named like attention that do neither (" + ", ".join(named) + ")")
    if not (registry or direct or named):
        parts.append("no attention modules")
    return "; ".join(parts)


# ---- the two wrappers ---------------------------------------------------------------------

class _RouteSdpaToStash(TorchFunctionMode):
    """Inside one stashed attention call, route F.scaled_dot_product_attention to
    attnstash::sdpa_fwd_keep; every other function runs unchanged."""

    def __init__(self, anchor, slot, name):
        super().__init__()
        self.anchor, self.slot, self.name, self.calls = anchor, slot, name, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(f"attnstash: {self.name} called scaled_dot_product_attention more than once in one "
                               "attention call; the stash keeps one output per attention call. Do not stash this "
                               "layer.")
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
        return ops.sdpa_fwd_keep(q, k, v, self.anchor, self.slot, mask, dropout_p, is_causal, scale, gqa)


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _stashed_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """ALL_ATTENTION_FUNCTIONS["sdpa"] while the stash is installed."""
    original = _patched[1]
    frames = _frames()
    frame = frames[-1] if frames and isinstance(frames[-1], _Frame) else None
    stash = frame.stash if frame is not None else None
    slot = module.__dict__.get(_SLOTS, {}).get(stash.token) if stash is not None else None
    if slot is None or not frame.keep:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    anchor = frame.anchor()
    name = f"{stash.name}, {type(module).__name__}"
    if frame.rng is not None and not _same_rng(frame.rng, _rng_state(anchor.device)):
        raise RuntimeError(
            f"attnstash: {stash.name} draws random numbers before its attention (dropout, LoRA dropout, ...) "
            "and its checkpoint does not restore the random state for the recompute (preserve_rng_state=False): "
            "the recompute's query, key and value would differ from the first forward's, and the kept output would "
            "not match them. Checkpoint with preserve_rng_state=True (the default), or do not stash this layer.")
    frame.routed[id(module)] = frame.routed.get(id(module), 0) + 1
    if frame.routed[id(module)] > 1:
        raise RuntimeError(f"attnstash: {name} called ALL_ATTENTION_FUNCTIONS['sdpa'] twice in one forward of the "
                           "layer; the stash keeps one output per attention module and forward, so it cannot stash "
                           "this layer. Install on the layers after it (num_layers), or use another model.")
    try:
        with _RouteSdpaToStash(anchor, slot, name):
            out = original(module, query, key, value, attention_mask, *args, **kwargs)
    except RuntimeError as e:
        if str(e).startswith("attnstash"):
            raise RuntimeError(f"attnstash: {name}: {e}") from e
        raise
    if frame.first and not torch.is_grad_enabled():  # a reentrant first forward: its graph will own the record
        record = ops.entry_id(anchor, slot)
        if record:
            frame.kept.append(record)
    return out


class _Owner:
    """Owns what one reentrant first forward of a layer kept, for the life of its
    checkpoint's graph node: registered as a hook of that node, it learns that the node's
    backward ran (its recompute took the records); destroyed with the node before that, it
    releases them (a forward dropped without a backward)."""
    __slots__ = ("records", "done")

    def __init__(self, records):
        self.records, self.done = records, False

    def __call__(self, grad_inputs, grad_outputs):
        self.done = True

    def __del__(self):
        if not self.done:
            _release(self.records)


def _release(records):
    for record in records:
        try:
            ops.release(record)
        except Exception:  # interpreter shutdown: nothing left to release into
            pass


def _layer_call(layer, *args, **kwargs):
    """GradientCheckpointingLayer.__call__ while the stash is installed: for a training
    forward of a stashed layer, the grad mode outside its checkpoint, and what it kept."""
    stash = layer.__dict__.get(_ATTR)
    original = _patched[4]
    if stash is None or not layer.training or _in_backward():
        return original(layer, *args, **kwargs)
    outer = _Outer(torch.is_grad_enabled())
    _frames().append(outer)
    try:
        out = original(layer, *args, **kwargs)
    except BaseException:
        _release(outer.kept())  # an interrupted forward (an error, Ctrl-C) keeps nothing
        raise
    finally:
        frames = _frames()
        while frames and frames.pop() is not outer:
            pass  # frames an interrupted forward left behind
    outer.finish(stash, out)
    return out


class _Outer:
    """Marks a stashed layer's call from outside its checkpoint on this thread's frames; the
    pre-hook below it finds the grad mode the call was made in."""
    __slots__ = ("grad", "frame")

    def __init__(self, grad):
        self.grad, self.frame = grad, None

    def kept(self):
        return self.frame.kept if self.frame is not None else []

    def finish(self, stash, out):
        frame = self.frame
        if frame is None or not frame.keep:
            return
        if not frame.routed:
            _release(frame.kept)
            raise RuntimeError(
                f"attnstash: {stash.name} is stashed, but its training forward did not call its attention through "
                "ALL_ATTENTION_FUNCTIONS['sdpa'], so nothing was kept and the stash would save nothing. The model's "
                "attention implementation may have been switched after install (model.set_attn_implementation), or "
                "its attention calls F.scaled_dot_product_attention directly. Load the model with "
                "attn_implementation=\"sdpa\" and keep it, or uninstall the stash.")
        if not frame.kept:
            return
        tensor = out[0] if isinstance(out, (tuple, list)) and out else out
        node = tensor.grad_fn if isinstance(tensor, torch.Tensor) and tensor.requires_grad else None
        if node is None:  # no backward can reach this forward: nothing will be recomputed
            _release(frame.kept)
        else:
            node.register_hook(_Owner(list(frame.kept)))


class _AnchorHook:
    """Forward pre-hook of a stashed layer (first forward and recompute alike): records the
    layer input as this thread's anchor, or refuses a forward that could not be replayed.
    Stateless, so that deep copies of the model carry it harmlessly."""

    def __call__(self, layer, args, kwargs):
        stash = layer.__dict__.get(_ATTR)
        if stash is None or not layer.training:  # eval and generation: the original attention, untouched
            return
        frames = _frames()
        outer = frames[-1] if frames and isinstance(frames[-1], _Outer) else None
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise RuntimeError(f"attnstash: {stash.name} was called without a hidden_states tensor (got "
                               f"{type(hidden).__name__}); the stash anchors on the decoder layer's input.")
        # A layer never runs inside itself: frames of it still here were left by an
        # interrupted forward.
        frames[:] = [f for f in frames if not (isinstance(f, _Frame) and f.stash in (stash, None))]
        grad = torch.is_grad_enabled()
        if _in_backward():  # a recompute: the op takes what its first forward kept
            frames.append(_Frame(stash, hidden, keep=grad, first=False))
            return
        hooks = _saved_tensor_hooks()
        if grad and not hooks:
            raise RuntimeError(
                f"attnstash: {stash.name} is stashed but runs a training forward without activation checkpointing, "
                "so the stash could only cost memory. Enable checkpointing on every stashed layer: "
                "model.gradient_checkpointing_enable() (non-reentrant, transformers 5's default, or "
                "gradient_checkpointing_kwargs={'use_reentrant': True}), or uninstall the stash.")
        # Grad off: a reentrant checkpoint's first forward, or a forward under no_grad, which
        # no backward can reach: the call outside the checkpoint tells them apart.
        reachable = grad or outer is None or outer.grad
        if not grad and hooks and reachable:
            raise RuntimeError(
                f"attnstash: {stash.name} runs a reentrant checkpoint under saved-tensor hooks (offloaded "
                "checkpointing: gradient_checkpointing_enable(offload=True), or torch.autograd.graph.save_on_cpu): "
                "they give the recompute a copy of the layer input, so it could not find its kept output. Use "
                "non-reentrant checkpointing with offloading (use_reentrant=False), or turn offloading off.")
        frame = _Frame(stash, hidden, keep=reachable, first=True)
        if reachable and not _preserves_rng(layer):
            frame.rng = _rng_state(hidden.device)
        if outer is not None:
            outer.frame = frame
        frames.append(frame)


class _FrameEndHook:
    """Forward hook of a stashed layer (always called, errors included): ends its frame."""

    def __call__(self, layer, args, kwargs, output):
        frames = _frames()
        if frames and isinstance(frames[-1], _Frame) and frames[-1].stash is layer.__dict__.get(_ATTR):
            frames.pop()


def _preserves_rng(layer):
    """Whether the layer's checkpoint restores the random state for its recompute (as far
    as can be seen: torch.utils.checkpoint's preserve_rng_state, default True)."""
    fn = layer.__dict__.get("_gradient_checkpointing_func")
    if isinstance(fn, functools.partial):
        return bool(fn.keywords.get("preserve_rng_state", True))
    return True


def _rng_state(device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _same_rng(a, b):
    return torch.equal(a, b)


# ---- install and uninstall ----------------------------------------------------------------

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
                         "or 5.x.")
    return GradientCheckpointingLayer, ALL_ATTENTION_FUNCTIONS


def _stashes_of(model):
    return [(layer, layer.__dict__[_ATTR]) for layer in decoder_layers(model) if _ATTR in layer.__dict__]


def _patch_globals(interface, layer_class):
    """Route "sdpa" to the stash for every attention interface: the class-wide mapping
    (which models with an AttentionInterface of their own read, e.g. Doge) and the shared
    instance's local override, if it has one (the function then wrapped)."""
    global _patched
    if _patched is None:
        shared = type(interface)._global_mapping
        local = getattr(interface, "_local_mapping", {})
        original = local["sdpa"] if "sdpa" in local else shared["sdpa"]
        _patched = (interface, original, shared["sdpa"], dict(local).get("sdpa"), layer_class.__call__)
        shared["sdpa"] = _stashed_sdpa
        if "sdpa" in local:
            interface["sdpa"] = _stashed_sdpa
        layer_class.__call__ = _layer_call


def _unpatch_globals(layer_class):
    global _patched
    if _live:
        gc.collect()  # stashes of models that are garbage but not yet collected
    if _patched is not None and not _live:
        interface, _, shared_original, local_original, call = _patched
        type(interface)._global_mapping["sdpa"] = shared_original
        if local_original is not None:
            interface["sdpa"] = local_original
        layer_class.__call__ = call
        _patched = None


def _remove_hooks(layer):
    for hooks, extras in ((layer._forward_pre_hooks, ("_forward_pre_hooks_with_kwargs",)),
                          (layer._forward_hooks, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"))):
        for key in [k for k, hook in hooks.items() if isinstance(hook, (_AnchorHook, _FrameEndHook))]:
            del hooks[key]
            for extra in extras:
                getattr(layer, extra, {}).pop(key, None)


def _detach(layer):
    stash = layer.__dict__.pop(_ATTR, None)
    _remove_hooks(layer)
    if stash is not None:
        stash.forget()


def layer_count(num_layers):
    """num_layers as an int (what operator.index accepts, bools refused) or None; ValueError
    otherwise. Whether it fits the model is install_attention_stash's to check."""
    if num_layers is None:
        return None
    if isinstance(num_layers, bool):
        raise ValueError(f"attnstash: num_layers must be an int or None, got the bool {num_layers!r}.")
    try:
        return operator.index(num_layers)
    except TypeError:
        raise ValueError(f"attnstash: num_layers must be an int or None, got {type(num_layers).__name__} "
                         f"{num_layers!r}.") from None


def install_attention_stash(model, num_layers=None, *, max_bytes=None):
    """Stash the attention of a Hugging Face model's last `num_layers` attention layers.

    Args:
        model: a transformers model loaded with attn_implementation="sdpa" (a PEFT wrapper
            of one will do), trained with gradient checkpointing, reentrant or not
            (model.gradient_checkpointing_enable(), before or after this call).
        num_layers: how many attention layers to stash, counted from the last (decoder
            layers without attention, such as Mamba layers, are not counted); None: all.
            An int or anything operator.index accepts, between 1 and the number of
            attention layers.
        max_bytes: the stash's budget, the most bytes it holds at any moment in this
            process (all devices together: with one GPU per process, that GPU's): an int
            or a string such as "8GiB" or "512MB" (attnstash.parse_bytes);
            None leaves the budget as it is. A keep that would pass it is declined: that
            layer's recompute runs attention as usual. The budget is the stash's
            (process-wide, see attnstash.stash_set_max_bytes); it stays after uninstall.

    Returns:
        The indices, among the model's decoder layers (model.model.layers), of the layers
        whose attention is stashed: exactly the layers that keep.

    Raises:
        ValueError: for a model or argument it cannot serve (not SDPA, no attention layers
            that go through ALL_ATTENTION_FUNCTIONS, a bad num_layers or max_bytes, a layer
            that already has the stash, missing transformers or torch entry points). On any
            error nothing is installed.
    """
    layer_class, interface = _entry_points()
    budget = ops.parse_bytes(max_bytes)
    num_layers = layer_count(num_layers)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"attnstash: the model uses attn_implementation={impl!r}; the stash replaces SDPA "
                         "attention only. Load it with attn_implementation=\"sdpa\".")
    found = attention_layers(model)
    if not found:
        raise ValueError(f"attnstash: {type(model).__name__} has no attention layers to stash: looked for decoder "
                         "layers (transformers GradientCheckpointingLayer modules) with attention that calls "
                         "ALL_ATTENTION_FUNCTIONS, and found " + _describe_missing_attention(model, decoder_layers(model))
                         + ".")
    count = len(found) if num_layers is None else num_layers
    if not 1 <= count <= len(found):
        raise ValueError(f"attnstash: num_layers must be between 1 and the {len(found)} attention layers of "
                         f"{type(model).__name__} (or None for all), got {num_layers}.")
    chosen = found[len(found) - count:]
    for index, layer, _ in chosen:
        if _ATTR in layer.__dict__:
            raise ValueError(f"attnstash: decoder layer {index} of {type(model).__name__} already has the stash; "
                             "call uninstall_attention_stash(model) before installing again.")
    with _lock:
        done = []
        try:
            _patch_globals(interface, layer_class)
            for index, layer, attentions in chosen:
                done.append(layer)
                layer.__dict__[_ATTR] = _LayerStash(index, f"decoder layer {index} ({type(layer).__name__})",
                                                    attentions)
                layer.register_forward_pre_hook(_AnchorHook(), with_kwargs=True)
                layer.register_forward_hook(_FrameEndHook(), with_kwargs=True, always_call=True)
            if budget is not None:
                ops.stash_set_max_bytes(budget)
            ops.stash_reset_peak()  # so that peak_bytes tells about the installed run
        except BaseException:
            for layer in done:
                _detach(layer)
            _unpatch_globals(layer_class)
            raise
    return [index for index, _, _ in chosen]


def uninstall_attention_stash(model):
    """Undo install_attention_stash for this model (or a deep copy of one): its hooks and
    attributes go, other models keep theirs, and once no model has the stash the original
    "sdpa" entry and GradientCheckpointingLayer.__call__ are back. Records the model's
    forwards still hold are released with their graphs. Raises ValueError if the model has
    no stash."""
    layer_class, _ = _entry_points()
    with _lock:
        stashed = _stashes_of(model)
        if not stashed:
            raise ValueError(f"attnstash: {type(model).__name__} has no attention stash installed.")
        for layer, _ in stashed:
            _detach(layer)
        _unpatch_globals(layer_class)


def layer_stash_stats(model):
    """{decoder layer index: Held(entries, bytes, declined)} held now for this model's
    stashed layers: records (kept or declined) and bytes, and how many of those records
    the budget declined (their recompute runs attention)."""
    held = ops.held_by_slot()
    stats = {}
    for _, stash in _stashes_of(model):
        slots = [held.get(slot, ops.Held(0, 0, 0)) for slot in stash.slots.values()]
        stats[stash.index] = ops.Held(*(sum(column) for column in zip(*slots)))
    return stats
