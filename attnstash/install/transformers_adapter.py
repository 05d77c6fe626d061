"""What the installer needs to know of Hugging Face transformers (the releases of SUPPORTED, below).

Layers: the model's GradientCheckpointingLayers, in the order of model.modules(); a layer
has attention if a module class of its own (not of a layer nested in it) calls
ALL_ATTENTION_FUNCTIONS or F.scaled_dot_product_attention (read from its code: found.calls_any).
Its checkpointed forward is reached through its checkpoint function: every release in the
range calls `self._gradient_checkpointing_func(fn, *args)` with the layer's forward as fn
(4.57 to 5.22 from GradientCheckpointingLayer.__call__, 5.23 from the `forward` that
__init_subclass__ wraps). While a transformers layer is stashed, GradientCheckpointingLayer
carries a descriptor for that attribute, so that whatever sets it (gradient_checkpointing_enable
before or after the install, Trainer, PEFT) a stashed layer reads attnstash's stand-in for it.
"""
import functools
import os
import re
import sys

import torch

from ..errors import InstallError, UnsupportedVersionError
from .found import CHECKPOINT_FUNCTION, Found, calls_any

SUPPORTED = ((4, 57), (5, 25))
"""The transformers releases attnstash was checked on, oldest and newest (major, minor):
`make test` runs the Hugging Face suite on the pinned release (tests/requirements.txt) and on
the Makefile's HF_ALSO, `make transformers-matrix` on every minor between (README.md,
Compatibility). pyproject.toml's `transformers` extra says the same."""
UNTESTED = "ATTNSTASH_ALLOW_UNTESTED_TRANSFORMERS"
NAME = "_gradient_checkpointing_func"


def _release(version):
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def installed_version():
    import transformers
    return transformers.__version__


def check_version():
    """Raises UnsupportedVersionError for a transformers outside SUPPORTED (unless UNTESTED=1
    is set in the environment) or one that lacks what attnstash reaches."""
    version = installed_version()
    (lo, hi), release = SUPPORTED, _release(version)
    if (release is None or not lo <= release <= hi) and os.environ.get(UNTESTED) != "1":
        raise UnsupportedVersionError(
            f"attnstash: transformers {version} is not supported: attnstash was checked on "
            f"transformers {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, where it reaches each checkpointed layer through "
            f"its {NAME} (how a release checkpoints its layers changes between releases). Install one of those "
            f"(pip install 'transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'), or set {UNTESTED}=1 to try this "
            "one: a layer this release checkpoints another way then fails clearly at its first training forward.")
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        raise UnsupportedVersionError(
            f"attnstash: transformers {version} has no "
            "transformers.modeling_layers.GradientCheckpointingLayer, the class of the layers it checkpoints, "
            f"which attnstash reaches; it supports transformers {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.") from None
    return GradientCheckpointingLayer


def _check_layer(module):
    """A layer class that defines the checkpoint function's name itself would hide the stand-in."""
    for klass in type(module).__mro__:
        if NAME in vars(klass) and not isinstance(vars(klass)[NAME], _CheckpointFunctionSlot):
            raise UnsupportedVersionError(
                f"attnstash: {klass.__name__} (transformers {installed_version()}) defines {NAME} on the class, "
                "where attnstash needs to stand in for each layer's checkpoint function; it supports transformers "
                f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}.{SUPPORTED[1][1]}.")


def _layer_class():
    module = sys.modules.get("transformers.modeling_layers")
    return getattr(module, "GradientCheckpointingLayer", None) if module is not None else None


# ---- which layers ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def class_has_attention(cls):
    """Whether a module class (or a transformers base class of it) calls attention: the
    registry ALL_ATTENTION_FUNCTIONS or F.scaled_dot_product_attention."""
    for klass in cls.__mro__:
        if klass is torch.nn.Module or not klass.__module__.startswith("transformers"):
            continue
        if calls_any(klass, ("ALL_ATTENTION_FUNCTIONS", "scaled_dot_product_attention")):
            return True
    return False


def _own_modules(layer, layer_class):
    """The layer and its submodules that are not inside another layer nested in it."""
    yield layer
    stack = list(layer.children())
    while stack:
        module = stack.pop()
        if isinstance(module, layer_class):
            continue
        yield module
        stack.extend(module.children())


def find(model):
    """[Found] for a transformers model (a PEFT wrapper of one will do), or None if it has
    no GradientCheckpointingLayer."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    if any(isinstance(m, transformers.PreTrainedModel) for m in model.modules()):
        check_version()  # a transformers model: this transformers must be one attnstash reaches
    layer_class = _layer_class()
    if layer_class is None:
        return None
    found = [Found(module, name, any(class_has_attention(type(m)) for m in _own_modules(module, layer_class)),
                        CHECKPOINT_FUNCTION)
             for name, module in model.named_modules() if isinstance(module, layer_class)]
    if not found:
        return None
    check_version()
    for f in found:
        _check_layer(f.module)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        raise InstallError(f"attnstash: the model uses attn_implementation={impl!r}; the stash keeps SDPA attention "
                           "only. Load it with attn_implementation=\"sdpa\".")
    checkpointed = {id(f.module) for f in found if getattr(f.module, "gradient_checkpointing", False)}
    if checkpointed:  # checkpointing enabled with every_n_layers > 1 leaves some layers out: not those
        found = [f if id(f.module) in checkpointed else f._replace(stashable=False) for f in found]
    return found


_DROPOUT_FIELD = re.compile(r"(attn|attention).*drop|drop.*(attn|attention)")


def _config_class():
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)


def attention_dropout(model, layer, name):
    """(where, field, value) for a layer (`name` in the model) whose attention the model's
    config sets to drop out: a nonzero float field whose name speaks of attention and dropout
    (attention_dropout, attention_probs_dropout_prob, attn_pdrop, ...) of the layer's config, read
    as the layer's attention reads it when the model is built. The layer's config: the one its
    own modules carry, else (releases whose modules carry none) that of the innermost
    transformers model holding the layer. `where` says how to set it (the config's path from the
    model's own, "" for the model's). None if no config of the layer names one (the ops refuse a
    dropout_p > 0 at the first step all the same)."""
    config_class, layer_class = _config_class(), _layer_class()
    if config_class is None or layer_class is None:
        return None
    config = next((m.config for m in _own_modules(layer, layer_class)
                   if isinstance(getattr(m, "config", None), config_class)), None)
    if config is None:
        holders = [(n, m.config) for n, m in model.named_modules()
                   if isinstance(getattr(m, "config", None), config_class) and (not n or name.startswith(n + "."))]
        config = max(holders, key=lambda h: len(h[0]))[1] if holders else None
    if config is None:
        return None
    for field, value in vars(config).items():
        if isinstance(value, float) and value > 0 and _DROPOUT_FIELD.search(field):
            return _config_path(model, config, config_class), field, value
    return None


def _top(model, config_class):
    """The outermost module of the model that carries a transformers config (the model, or the
    one a PEFT wrapper holds), or None."""
    return next((m for m in model.modules() if isinstance(getattr(m, "config", None), config_class)), None)


def _config_path(model, config, config_class):
    """The attribute path from a model's config to `config` ("" for the model's own)."""
    top = _top(model, config_class)
    stack = [] if top is None else [("", top.config)]
    while stack:
        path, node = stack.pop()
        if node is config:
            return path
        stack.extend((f"{path}.{k}" if path else k, v) for k, v in vars(node).items() if isinstance(v, config_class))
    return ""


def dropout_refusal(model, layers):
    """InstallError for the layers (index, Found) whose config gives their attention a dropout
    (attention_dropout above), naming the first, the field, its value and the fix; None if none."""
    hits = [(i, f, hit) for i, f in layers for hit in [attention_dropout(model, f.module, f.name)] if hit is not None]
    if not hits:
        return None
    index, f, (where, field, value) = hits[0]
    top = _top(model, _config_class()) or model
    others = f" and {len(hits) - 1} more of the layers to stash" if len(hits) > 1 else ""
    if where:
        fix = (f"config = AutoConfig.from_pretrained(...); config.{where}.{field} = 0.0; "
               f"{type(top).__name__}.from_pretrained(..., config=config)")
    else:
        fix = f"{type(top).__name__}.from_pretrained(..., {field}=0.0)"
    return InstallError(
        f"attnstash: layer {index} ({f.name}, {type(f.module).__name__}){others} would train with attention dropout: "
        f"the model's config{'.' + where if where else ''} has {field}={value}, and a kept attention output cannot "
        "stand in for a recompute that draws a new dropout mask. Load the model with it at 0.0: "
        f"{fix} (or set it in the config before building the model: the layers read it then); or do not stash "
        "these layers (num_layers=, layers=).")


def reach(module):
    """How a layer the user names (layers=) is reached: through its checkpoint function if it
    is a transformers layer, else as a module call."""
    layer_class = _layer_class()
    if layer_class is not None and isinstance(module, layer_class):
        check_version()
        _check_layer(module)
        return CHECKPOINT_FUNCTION
    return None


def describe(model):
    """What a model without stashable layers has instead, for the error."""
    named = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__
                    or "Attn" in type(m).__name__})
    return ("transformers GradientCheckpointingLayers with attention (modules that call ALL_ATTENTION_FUNCTIONS or "
            "F.scaled_dot_product_attention)" + (f"; it has attention modules ({', '.join(named)}) outside any such "
                                                "layer" if named else ""))


# ---- the checkpoint function's stand-in ----------------------------------------------------------

class _CheckpointFunctionSlot:
    """GradientCheckpointingLayer._gradient_checkpointing_func while a transformers layer is
    stashed: each layer keeps its own value in its __dict__, as without it, and reads
    stand_in(layer, value): the installer's stand-in for a stashed layer, the value itself for
    any other."""

    def __init__(self, stand_in):
        self.stand_in = stand_in

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        try:
            value = layer.__dict__[NAME]
        except KeyError:
            raise AttributeError(f"'{type(layer).__name__}' object has no attribute '{NAME}'") from None
        return value if value is None else self.stand_in(layer, value)

    def __set__(self, layer, value):
        layer.__dict__[NAME] = value

    def __delete__(self, layer):
        try:
            del layer.__dict__[NAME]
        except KeyError:
            raise AttributeError(NAME) from None


def patch(stand_in):
    """Layers read their checkpoint function through stand_in(layer, value) (core.stand_in)."""
    layer_class = check_version()
    if not isinstance(vars(layer_class).get(NAME), _CheckpointFunctionSlot):
        setattr(layer_class, NAME, _CheckpointFunctionSlot(stand_in))


def unpatch():
    layer_class = _layer_class()
    if layer_class is not None and isinstance(vars(layer_class).get(NAME), _CheckpointFunctionSlot):
        delattr(layer_class, NAME)
