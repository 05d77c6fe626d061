"""Inputs and the loss, per head and modality.

batch(model, head, kind) -> {forward argument: tensor}, the same on every call; kind
"unpadded" (2 rows of one length) or "left-padded" (3 rows, the first 0, 4 and 9 positions
masked out with attention_mask; only for a model that takes text and an attention_mask).
The main input: input_ids for a vision-language model, else the first required argument of
INPUTS, else the model's main_input_name.

  text          input_ids of ids TEXT..VOCAB-1 (below TEXT: pad, bos, eos and special tokens);
                a model that also takes pixel_values and has a vision config (a dual encoder,
                or a vision-language model without placeholder tokens) gets images beside them
  images        pixel_values (rows, channels, side, side) of the config's image size; vision
                towers that take grid_thw get flattened patches (as below), SigLIP 2 patches per
                image with their spatial_shapes
  vision-language
                each row: 4 text tokens, [vision start], one image's placeholder tokens (as many
                as the model makes features of it: get_image_features, asked once), [vision end],
                text; models that take image_grid_thw (Qwen2-VL and its kin) get one image per row
                of a different size (grids 1 x 2m x 2m, 1 x 2m x 3m, 1 x 3m x 2m patches, m the
                spatial merge) as flattened patches, and mm_token_type_ids where they take it
  speech        input_features (rows, mel bins, 2 * max_source_positions) for Whisper and its kin
                (whose first Conv1d takes the mel bins as channels), else (rows, frames, features);
                input_values: raw audio of 4000 samples (a spectrogram (rows, max_length, mel
                bins) where the config has mel bins); CTC heads get an attention_mask of ones
  seq2seq       decoder_input_ids of 12 tokens, labels the next 12 (any encoder-decoder)

labels: the tokens (causal LM, masked LM, vision-language: pads and image tokens -100), a class
per row (classification), per token (token classification), two tokens per row (CTC).
loss(out): the model's loss where it made one, else the mean square of its first output
(logits, last_hidden_state, or its first floating tensor).
"""
import inspect

import torch

from .configs import IMAGE, PATCH, TEXT, VOCAB

SEQ = 24
PADS = (0, 4, 9)  # left padding per row of the padded batch: rows of different lengths
DECODER = 12
SAMPLES = 4000
KINDS = ("unpadded", "left-padded")


class NoInputs(Exception):
    """The sweep does not know how to feed this model."""


def parameters(model):
    return set(inspect.signature(model.forward).parameters)


def takes_mask(model, head):
    """Whether the model takes text with an attention_mask (then it runs left-padded too)."""
    return "attention_mask" in parameters(model) and _main(model, head) == "input_ids"


INPUTS = ("input_ids", "pixel_values", "input_features", "input_values", "hidden_states")


def _main(model, head):
    """The input the batch is made of: input_ids for a vision-language model, else the first
    required argument the sweep knows, else the model's main_input_name."""
    signature = inspect.signature(model.forward).parameters
    if head == "image-text-to-text" and "input_ids" in signature:
        return "input_ids"  # (BLIP-2 and its kin name pixel_values as their main input)
    required = [n for n, p in signature.items() if p.default is inspect.Parameter.empty and n in INPUTS]
    main = required[0] if required else getattr(model, "main_input_name", "input_ids")
    return "input_ids" if main in ("input_ids", "inputs_embeds") else main


def _generator(seed=1):
    return torch.Generator().manual_seed(seed)


def _sub(config, *names):
    for name in names:
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    return config


def _get(configs, *names, default=None):
    for config in configs:
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return value
    return default


def _side(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def _float(shape, g):
    return torch.randn(shape, generator=g)


def _mask(rows, length, pads):
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


def batch(model, head, kind):
    """The batch of `kind` for `model` under `head` (see the module's docstring)."""
    g = _generator()
    config = model.config
    params = parameters(model)
    main = _main(model, head)
    rows = 2 if kind == "unpadded" else len(PADS)
    pads = (0,) * rows if kind == "unpadded" else PADS
    out, ignore = {}, None
    if main == "input_ids":
        if "pixel_values" in params and _image_token(config) is not None and hasattr(model, "get_image_features"):
            out, ignore = vision_language(model, params, rows, pads, g)
        else:
            ids = torch.randint(TEXT, VOCAB, (rows, SEQ), generator=g)
            out["input_ids"] = ids
            if "pixel_values" in params and (head == "image-text-to-text" or hasattr(config, "vision_config")):
                out.update(image_arguments(config, params, rows, g))  # a dual encoder, or no placeholders
            if "qformer_input_ids" in params:
                out["qformer_input_ids"] = ids
        if kind != "unpadded":
            length = out["input_ids"].shape[1]
            out["attention_mask"] = mask = _mask(rows, length, pads)
            out["input_ids"] = out["input_ids"].masked_fill(mask == 0, 0)  # the pad token
            if "qformer_input_ids" in out:
                out["qformer_input_ids"], out["qformer_attention_mask"] = out["input_ids"], mask
    elif main in ("pixel_values", "hidden_states"):
        out.update(image_arguments(config, params, rows, g, main))
    elif main in ("input_features", "input_values"):
        out[main] = _audio(model, main, rows, g)
        if head == "CTC" and "attention_mask" in params:  # (the loss takes the input lengths from it)
            out["attention_mask"] = torch.ones(out[main].shape[:2], dtype=torch.long)
    else:
        raise NoInputs(f"the sweep has no inputs for a model whose main input is {main}")
    if "decoder_input_ids" in params and _encoder_decoder(config):
        tokens = torch.randint(TEXT, VOCAB, (rows, DECODER + 1), generator=g)
        out["decoder_input_ids"] = tokens[:, :-1].contiguous()
        if "labels" in params and head != "base model":
            out["labels"] = tokens[:, 1:].contiguous()
    if "labels" in params and "labels" not in out:
        labels = _labels(config, head, out, rows, ignore, g)
        if labels is not None:
            out["labels"] = labels
    return out


def _encoder_decoder(config):
    try:
        text = config.get_text_config()
    except ValueError:  # several text configs (MusicGen)
        text = config
    return bool(getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False))


def _labels(config, head, out, rows, ignore, g):
    if head in ("causal LM", "masked LM", "image-text-to-text") and "input_ids" in out:
        labels = out["input_ids"].clone()
        if "attention_mask" in out:
            labels = labels.masked_fill(out["attention_mask"] == 0, -100)
        if ignore is not None:
            labels = labels.masked_fill(ignore, -100)
        return labels
    classes = getattr(config, "num_labels", 2)
    if head in ("image classification", "audio classification", "sequence classification"):
        return torch.arange(rows) % classes
    if head == "token classification" and "input_ids" in out:
        labels = torch.randint(0, classes, out["input_ids"].shape, generator=g)
        return labels.masked_fill(out["attention_mask"] == 0, -100) if "attention_mask" in out else labels
    if head == "CTC":
        return torch.randint(TEXT, min(VOCAB, getattr(config, "vocab_size", VOCAB)), (rows, 2), generator=g)
    return None


def _images(config, rows, g, side=None):
    vision = _sub(config, "vision_config", "vision_encoder_config")
    channels = _get((vision, config), "num_channels", "in_channels", "in_chans", default=3)
    side = side or _side(_get((vision, config), "image_size", default=IMAGE))
    frames = _get((vision, config), "num_frames")
    if frames:  # video models: (rows, frames, channels, side, side)
        return _float((rows, frames, channels, side, side), g)
    return _float((rows, channels, side, side), g)


def _audio(model, main, rows, g):
    config = model.config
    audio = _sub(config, "audio_config", "encoder_config")
    mels = _get((audio, config), "num_mel_bins")
    if main == "input_features":
        conv = next((m for m in model.modules() if isinstance(m, torch.nn.Conv1d)), None)
        if mels and conv is not None and conv.in_channels == mels:  # Whisper's encoder and its kin
            positions = _get((audio, config), "max_source_positions", default=16)
            return _float((rows, mels, 2 * positions), g)
        if mels:
            return _float((rows, 32, mels), g)
        per_channel = _get((audio, config), "input_feat_per_channel")
        if per_channel:
            return _float((rows, 32, per_channel * _get((audio, config), "input_channels", default=1)), g)
        return _float((rows, 32, _get((audio, config), "feature_size", default=80)), g)
    if mels:
        return _float((rows, _get((audio, config), "max_length", default=32), mels), g)
    return _float((rows, SAMPLES), g)


# ---- vision-language ---------------------------------------------------------------------------

def _image_token(config):
    return _get((config, _sub(config, "text_config")), "image_token_id", "image_token_index")


def _grids(config, rows):
    vision = _sub(config, "vision_config")
    m = _get((vision,), "spatial_merge_size", default=2)
    return torch.tensor([[1, 2 * m, 2 * m], [1, 2 * m, 3 * m], [1, 3 * m, 2 * m]][:rows])


def _patches(config, grids, g):
    vision = _sub(config, "vision_config")
    channels = _get((vision,), "in_channels", "in_chans", "num_channels", default=3)
    temporal = _get((vision,), "temporal_patch_size", default=1)
    patch = _get((vision,), "patch_size", default=PATCH)
    count = int(grids.prod(-1).sum())
    return _float((count, channels * temporal * patch * patch), g)


def image_arguments(config, params, rows, g, name="pixel_values"):
    """One image per row, as the model takes them: flattened patches with their grids
    (image_grid_thw, grid_thw), patches per image with their shapes (spatial_shapes:
    SigLIP 2), or (rows, channels, side, side)."""
    grid = next((n for n in ("image_grid_thw", "grid_thw") if n in params), None)
    if grid:
        grids = _grids(config, rows)
        return {name: _patches(config, grids, g), grid: grids}
    if "spatial_shapes" in params:
        vision = _sub(config, "vision_config")
        channels, patch = _get((vision,), "num_channels", default=3), _get((vision,), "patch_size", default=PATCH)
        side = IMAGE // patch
        return {name: _float((rows, side * side, channels * patch * patch), g),
                "pixel_attention_mask": torch.ones(rows, side * side, dtype=torch.long),
                "spatial_shapes": torch.tensor([[side, side]] * rows)}
    return {name: _images(config, rows, g)}


def _image_candidates(model, params, rows, g):
    """The shapes image arguments come in: image_arguments, else one or two crops per image
    (rows, crops, channels, side, side); each without, then with image_sizes where the model
    takes them."""
    config = model.config
    images = image_arguments(config, params, rows, g)
    yield images
    images = images["pixel_values"]
    if images.dim() != 4:
        return
    side = images.shape[-1]
    sizes = [{}] + ([{"image_sizes": torch.tensor([[side, side]] * rows)}] if "image_sizes" in params else [])
    for crops in (None, 1, 2):
        pixels = images if crops is None else images[:, None].expand(-1, crops, -1, -1, -1).contiguous()
        for extra in sizes:
            if crops or extra:
                yield {"pixel_values": pixels, **extra}


def image_inputs(model, params, rows, g):
    """(image arguments for `rows` images, one per row; placeholder tokens per image: as many
    as the features get_image_features makes of it)."""
    if not hasattr(model, "get_image_features"):
        raise NoInputs(f"{type(model).__name__} has no get_image_features, which tells the sweep how many "
                       "placeholder tokens an image needs")
    first = None
    extra = {"qformer_input_ids": torch.randint(TEXT, VOCAB, (rows, 8), generator=g)} \
        if "qformer_input_ids" in params else {}
    for images in _image_candidates(model, params, rows, g):
        images.update(extra)
        try:
            counts = image_token_counts(model, images)
        except Exception as e:  # noqa: BLE001 - the next shape, or the first error
            first = first or e
            continue
        if len(counts) == rows:
            return images, counts
        first = first or NoInputs(f"{len(counts)} images' features for {rows} images")
    raise first


def image_token_counts(model, images):
    """How many placeholder tokens each image needs: the features the model makes of it."""
    with torch.no_grad():
        features = model.get_image_features(**images)
    if not torch.is_tensor(features) and hasattr(features, "pooler_output"):
        features = features.pooler_output
    while isinstance(features, (tuple, list)) and features and isinstance(features[0], (tuple, list)):
        features = features[0]  # (features per image, deepstack features): Qwen3-VL on 4.57
    if features is None:
        raise NoInputs("get_image_features gave no features")
    if torch.is_tensor(features):
        if features.dim() == 3:
            return [features.shape[1]] * features.shape[0]
        rows = images["pixel_values"].shape[0]
        return [features.shape[0] // rows] * rows
    return [int(torch.tensor(f.shape[:-1]).prod()) if f.dim() > 1 else 1 for f in features]


def vision_language(model, params, rows, pads, g):
    """(inputs, a mask of the positions whose labels are ignored: image tokens and markers)."""
    config = model.config
    image = _image_token(config)
    images, counts = image_inputs(model, params, rows, g)
    start = _get((config,), "vision_start_token_id", "boi_token_id", "boi_token_index")
    end = _get((config,), "vision_end_token_id", "eoi_token_id", "eoi_token_index")
    before, after = [start] if start is not None else [], [end] if end is not None else []
    length = max(counts) + len(before) + len(after) + 16 + max(pads)
    ids = torch.randint(TEXT, VOCAB, (rows, length), generator=g)
    special = torch.zeros(rows, length, dtype=torch.bool)
    types = torch.zeros(rows, length, dtype=torch.long)
    for row, (count, pad) in enumerate(zip(counts, pads)):
        block = before + [image] * count + after
        at = pad + 4
        ids[row, at:at + len(block)] = torch.tensor(block)
        special[row, at:at + len(block)] = True
        types[row, at + len(before):at + len(before) + count] = 1
    out = dict(input_ids=ids, **images)
    if "mm_token_type_ids" in params:
        out["mm_token_type_ids"] = types
    return out, special


def loss(out):
    """The model's loss, else the mean square of its first output."""
    value = getattr(out, "loss", None)
    if value is not None:
        return value
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if torch.is_tensor(value):
            return value.float().square().mean()
    items = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else [out]
    for value in items:
        if torch.is_tensor(value) and value.is_floating_point() and value.requires_grad:
            return value.float().square().mean()
    raise NoInputs(f"no floating output that requires grad in {type(out).__name__}")
