"""Which model types there are, the one head each is swept under, and the tiny model.

A model type is any type in transformers' auto model mappings. Its head is the first of
HEADS whose mapping lists it (configs.ARCH may name another; for a type in none of them:
the first other mapping, in alphabetical order): a vision-language model runs with its images, an encoder-decoder as
one, an encoder under its masked-LM head, and a type no head of HEADS lists as its base
model.
"""
import functools

import torch
import transformers

from .configs import ARCH, tiny_config

SEED = 0
# (mapping, the head's name in the rows): in order of priority.
HEADS = (
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "image-text-to-text"),
    ("MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", "image-text-to-text"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq LM"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech seq2seq"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked LM"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal LM"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image classification"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio classification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence classification"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "CTC"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token classification"),
    ("MODEL_MAPPING_NAMES", "base model"),
)
# Heads whose model computes its own loss from `labels` (how the labels look: inputs.labels).
WITH_LABELS = ("image-text-to-text", "seq2seq LM", "speech seq2seq", "masked LM", "causal LM", "image classification",
               "audio classification", "sequence classification", "CTC", "token classification")


def _mappings():
    from transformers.models.auto import modeling_auto
    return {name: getattr(modeling_auto, name) for name in dir(modeling_auto)
            if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")}


@functools.lru_cache(maxsize=None)
def model_types():
    """{model type: (head, model class name)} for every type of the installed transformers."""
    mappings = _mappings()
    types = sorted({arch for mapping in mappings.values() for arch in mapping})
    out = {}
    for arch in types:
        wanted = ARCH.get(arch, {}).get("head")
        for mapping, head in HEADS:
            if arch in mappings.get(mapping, {}) and wanted in (None, head):
                out[arch] = head, _class_name(mappings[mapping][arch])
                break
        else:
            mapping = min(m for m, names in mappings.items() if arch in names)
            out[arch] = mapping[len("MODEL_FOR_"):-len("_MAPPING_NAMES")].lower().replace("_", " "), \
                _class_name(mappings[mapping][arch])
    return out


def _class_name(names):
    return names[0] if isinstance(names, (list, tuple)) else names


def model_class(arch):
    head, name = model_types()[arch]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers has no class {name} (a library it needs is missing)")
    return head, cls


def _text_config(config):
    try:
        return config.get_text_config()
    except ValueError:  # several text configs (MusicGen: text encoder and decoder)
        return None


class Skip(Exception):
    """A type the sweep cannot run here, with the reason."""


def build(arch, seed=SEED):
    """(head, the tiny model of `arch`: random weights from `seed`, SDPA, in train mode).
    Raises Skip for a type that cannot run here, and any error of the build itself."""
    head, cls = model_class(arch)
    if getattr(cls, "_supports_sdpa", None) is False:
        raise Skip(f"no SDPA attention in transformers' {cls.__name__}")
    why = ARCH.get(arch, {}).get("skip")
    if why:
        raise Skip(why)
    config = tiny_config(arch)
    text = _text_config(config)
    if not isinstance(config, cls.config_class) and isinstance(text, cls.config_class):
        config = text  # a class of the text model, mapped from a composite config (4.57)
    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, attn_implementation="sdpa")
    except ValueError as e:
        if "does not support an attention implementation through torch.nn.functional.scaled_dot_product_" \
                "attention" in str(e):
            raise Skip(f"no SDPA attention in transformers' {str(e).split()[0]}") from None
        raise
    model.train()
    return head, model


def skip_reason(error):
    """The reason a build error means the type cannot run here (a GPU, a download, a missing
    package), or None."""
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    if isinstance(error, ImportError) or "requires the" in low and "library" in low or "pip install" in low:
        return f"needs a package that is not installed: {_line(text)}"
    if "cuda" in low or "gpu" in low or "triton" in low:
        return f"needs a GPU: {_line(text)}"
    if "huggingface.co" in low or "offline" in low or "from_pretrained" in low or "hub" in low:
        return f"needs a hub download: {_line(text)}"
    return None


def _line(text, limit=200):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
