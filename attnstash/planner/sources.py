"""What the planner runs: a model and the inputs of one micro-batch, from what it is given.

  - a model and example inputs (any model the installer serves): the model itself, its
    parameters and buffers swapped for shape-only stand-ins for the one forward;
  - a transformers model, or a transformers config (an object, a dict of config.json's values,
    the path of a config.json or of a folder with one), with batch_size and seq_len: input_ids
    [batch_size, seq_len] (with padded=True, an attention mask with padding); a config is built
    on the meta device, without weights;
  - a diffusers transformer config (its config.json has "_class_name") with batch_size, the
    latent's frames (video models), height and width (as the transformer receives the latent:
    Flux and QwenImage pack its 2 x 2 patches), and text_len: the inputs its pipelines pass, for
    the classes in DIFFUSERS_INPUTS.
"""
import contextlib
import copy
import json
import os
import re
from typing import NamedTuple, Optional

import torch

from ..errors import ArgumentError
from .quiet import others_silenced
from .shape_only import ShapeOnly


class Source(NamedTuple):
    model: torch.nn.Module
    stand_ins: Optional[dict]  # {name: shape-only parameter or buffer}, for a model with real ones (None: a
                               # model built here from a config, on the meta device)
    args: tuple
    kwargs: dict
    name: str                  # the model's class (and model_type)
    inputs: str                # the micro-batch, in words
    dtype: Optional[torch.dtype]


@contextlib.contextmanager
def eager_experts(model):
    """transformers' mixtures of experts run their eager experts for the forward: the grouped
    matrix multiply's meta kernel takes bf16 only (the shapes are the same)."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if hasattr(c, "_experts_implementation")}
    before = {key: c._experts_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation = "eager"
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = before[key]


def _error(message):
    return ArgumentError(f"attnstash.plan: {message}")


def _shape_only(t, dtype=None):
    if not isinstance(t, torch.Tensor):
        return t
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return ShapeOnly(torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta"))


def _meta(shape, dtype):
    return ShapeOnly(torch.empty(shape, dtype=dtype, device="meta"))


def _describe(args, kwargs):
    def one(v):
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        return type(v).__name__ if isinstance(v, (list, tuple, dict)) else repr(v)
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def from_model(model, args, kwargs, dtype):
    """A model of any kind with example inputs."""
    stand_ins = {name: _shape_only(t, dtype)
                 for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    return Source(model, stand_ins, tuple(args), dict(kwargs), type(model).__name__, _describe(args, kwargs), dtype)


def token_inputs(batch_size, seq_len, padded):
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    kwargs = {"input_ids": ids}
    if padded:
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[0, 0] = 0  # the first row left-padded by one token: any padding makes transformers build a 4-D mask
        kwargs["attention_mask"] = mask
    return kwargs, f"input_ids [{batch_size}, {seq_len}], " + ("padded (a 4-D attention mask)" if padded else
                                                             "unpadded")


def from_transformers_model(model, batch_size, seq_len, padded, dtype):
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        raise _error(f"the model uses attn_implementation={impl!r}; the stash keeps SDPA attention only. Load it "
                     "with attn_implementation=\"sdpa\".")
    kwargs, words = token_inputs(batch_size, seq_len, padded)
    param = next(iter(model.parameters()), None)
    dtype = dtype or (param.dtype if param is not None and param.is_floating_point() else None)
    source = from_model(model, (), kwargs, dtype)
    return source._replace(name=f"{type(base).__name__} ({getattr(config, 'model_type', '?')})", inputs=words)


# ---- configs ---------------------------------------------------------------------------------

def read_config(source):
    """(a dict of config.json's values or a transformers config, where it came from), from what
    plan() was given."""
    if not isinstance(source, (str, os.PathLike, dict)):
        import transformers
        if isinstance(source, transformers.PretrainedConfig):
            return copy.deepcopy(source), "the config"
        raise _error("expected a model, a transformers config, a dict of config.json values or the path of a "
                     f"config.json; got {type(source).__name__}.")
    if isinstance(source, dict):
        return dict(source), "the config"
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f), path
    except FileNotFoundError:
        raise _error(f"no such config file: {path}") from None
    except json.JSONDecodeError as e:
        raise _error(f"{path} is not valid JSON: {e}") from None


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def from_transformers_config(config, where, batch_size, seq_len, padded, dtype):
    import transformers
    with others_silenced():
        return _from_transformers_config(transformers, config, where, batch_size, seq_len, padded, dtype)


def _current_names(transformers, values):
    """config.json's values under the names the installed transformers takes: "torch_dtype" (as
    configs saved before 4.56 name it) is "dtype" where torch_dtype is a deprecated alias of it."""
    if "torch_dtype" in values and isinstance(getattr(transformers.PretrainedConfig, "torch_dtype", None), property):
        value = values.pop("torch_dtype")
        if values.get("dtype") is None:
            values["dtype"] = value
    return values


def _from_transformers_config(transformers, config, where, batch_size, seq_len, padded, dtype):
    if not isinstance(config, transformers.PretrainedConfig):
        values = _current_names(transformers, dict(config))
        model_type = values.pop("model_type", None)
        if not model_type:
            raise _error(f"{where} has no \"model_type\" (a transformers config.json) and no \"_class_name\" (a "
                         "diffusers one).")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        if model_type in CONFIG_MAPPING:
            check_value_types(where, CONFIG_MAPPING[model_type], values)
        try:
            config = transformers.AutoConfig.for_model(model_type, **values)
        except Exception as e:  # a value of the wrong type or out of range: transformers' own words, on one line
            raise _error(f"{where}: transformers {transformers.__version__} cannot build a config for model_type "
                         f"{model_type!r} from it: {' '.join(str(e).split())}") from None
    dtype = dtype or config_dtype(config) or torch.bfloat16
    config.use_cache = False
    try:
        with torch.device("meta"), _no_init_weights():
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
            except ValueError as e:
                if "Unrecognized configuration class" not in str(e):
                    raise
                model = transformers.AutoModel.from_config(config, attn_implementation="sdpa", dtype=dtype)
    except Exception as e:  # a config value transformers' model code cannot use: its own words, on one line
        raise _error(f"transformers {transformers.__version__} cannot build {getattr(config, 'model_type', '?')} "
                     f"with attn_implementation=\"sdpa\": {type(e).__name__}: {' '.join(str(e).split())}") from None
    kwargs, words = token_inputs(batch_size, seq_len, padded)
    return Source(model.train(), None, (), kwargs, f"{type(model).__name__} ({config.model_type})", words, dtype)


def config_dtype(config):
    value = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
            value.replace("torch.", ""))
    return value if isinstance(value, torch.dtype) else None


_COUNT = re.compile(r"^num_|^n_|_size$|_heads$|_layers$|_dim$")  # sizes and counts, which are positive


def check_value_types(where, config_class, values):
    """A number the config class defaults to, given as something else (or a size not positive),
    named before transformers trips over it somewhere deeper (4.x has no typed configs)."""
    try:
        default = config_class()
    except Exception:
        return
    for name, value in values.items():
        expected = getattr(default, name, None)
        if not isinstance(expected, (int, float)) or isinstance(expected, bool) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _error(f"{where}: \"{name}\" must be a number (like {expected!r}), got {value!r}.")
        if value <= 0 < expected and _COUNT.search(name):
            raise _error(f"{where}: \"{name}\" must be positive (like {expected!r}), got {value!r}.")


# ---- diffusers ---------------------------------------------------------------------------------

def _flux(c, b, f, h, w, t, dtype):
    tokens = (h // 2) * (w // 2)  # 2x2 patches of the latent, packed by the pipeline
    kw = dict(hidden_states=_meta((b, tokens, c["in_channels"]), dtype),
              encoder_hidden_states=_meta((b, t, c["joint_attention_dim"]), dtype),
              pooled_projections=_meta((b, c["pooled_projection_dim"]), dtype), timestep=torch.ones(b),
              img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(t, 3))
    if c.get("guidance_embeds"):
        kw["guidance"] = torch.ones(b)
    return kw


def _qwen_image(c, b, f, h, w, t, dtype):
    return dict(hidden_states=_meta((b, (h // 2) * (w // 2), c["in_channels"]), dtype),
                encoder_hidden_states=_meta((b, t, c["joint_attention_dim"]), dtype),
                encoder_hidden_states_mask=torch.ones(b, t, dtype=torch.long), timestep=torch.ones(b),
                img_shapes=[[(1, h // 2, w // 2)]] * b)


def _video(c, b, f, h, w, t, dtype, text="text_dim"):
    return dict(hidden_states=_meta((b, c["in_channels"], f, h, w), dtype),
                encoder_hidden_states=_meta((b, t, c[text]), dtype), timestep=torch.ones(b, dtype=torch.long))


def _hunyuan_video(c, b, f, h, w, t, dtype):
    kw = dict(_video(c, b, f, h, w, t, dtype, "text_embed_dim"),
              encoder_attention_mask=torch.ones(b, t), pooled_projections=_meta((b, c["pooled_projection_dim"]), dtype),
              timestep=torch.ones(b))
    if c.get("guidance_embeds", True):
        kw["guidance"] = torch.ones(b) * 1000.0
    return kw


DIFFUSERS_INPUTS = {  # class name -> (config values, batch, frames, height, width, text_len, dtype) -> kwargs
    "FluxTransformer2DModel": _flux,
    "QwenImageTransformer2DModel": _qwen_image,
    "WanTransformer3DModel": _video,
    "SD3Transformer2DModel": lambda c, b, f, h, w, t, dtype: dict(
        hidden_states=_meta((b, c["in_channels"], h, w), dtype),
        encoder_hidden_states=_meta((b, t, c["joint_attention_dim"]), dtype),
        pooled_projections=_meta((b, c["pooled_projection_dim"]), dtype), timestep=torch.ones(b, dtype=torch.long)),
    "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "LTXVideoTransformer3DModel": lambda c, b, f, h, w, t, dtype: dict(
        hidden_states=_meta((b, f * h * w, c["in_channels"]), dtype),
        encoder_hidden_states=_meta((b, t, c["caption_channels"]), dtype),
        encoder_attention_mask=torch.ones(b, t, dtype=torch.bool), timestep=torch.ones(b, dtype=torch.long),
        num_frames=f, height=h, width=w),
    "CogVideoXTransformer3DModel": lambda c, b, f, h, w, t, dtype: dict(
        hidden_states=_meta((b, f, c["in_channels"], h, w), dtype),
        encoder_hidden_states=_meta((b, t, c["text_embed_dim"]), dtype), timestep=torch.ones(b, dtype=torch.long)),
}
_VIDEO = {"WanTransformer3DModel", "HunyuanVideoTransformer3DModel", "LTXVideoTransformer3DModel",
          "CogVideoXTransformer3DModel"}


def from_diffusers_config(values, where, batch_size, frames, height, width, text_len, dtype):
    import diffusers
    name = values["_class_name"]
    if name not in DIFFUSERS_INPUTS:
        raise _error(f"{where}: the planner knows the inputs of {', '.join(sorted(DIFFUSERS_INPUTS))} from a config; "
                     f"for {name}, pass the model and example inputs: attnstash.plan(model, example_kwargs=inputs).")
    missing = [n for n, v in (("latent_height", height), ("latent_width", width), ("text_len", text_len))
               if v is None]
    if name in _VIDEO and frames is None:
        missing.insert(0, "latent_frames")
    if missing:
        raise _error(f"{where}: planning {name} needs the latent's size (as the transformer receives it) and the "
                     f"text's length: {', '.join(missing)}.")
    dtype = dtype or torch.bfloat16
    model_class = getattr(diffusers, name)
    try:
        with others_silenced(), torch.device("meta"):
            model = model_class.from_config({k: v for k, v in values.items() if not k.startswith("_")})
    except Exception as e:
        raise _error(f"{where}: diffusers {diffusers.__version__} cannot build {name} from it: "
                     f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    # Every floating tensor in `dtype`, by torch's Module.to (diffusers' own to() adds a warning only:
    # that the modules its from_pretrained keeps in float32 are cast too).
    model = torch.nn.Module.to(model, dtype).train()
    config = dict(model.config)
    kwargs = DIFFUSERS_INPUTS[name](config, batch_size, frames or 1, height, width, text_len, dtype)
    size = f"{frames} x {height} x {width}" if name in _VIDEO else f"{height} x {width}"
    return Source(model, None, (), kwargs, name, f"batch {batch_size}, latent {size}, text {text_len} tokens", dtype)
