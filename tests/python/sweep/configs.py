"""Tiny configs: any config class of transformers, shrunk field by field.

Every field a config has under one of the names below is set (CORE) or lowered to the value
here (SHRINK: never raised, so num_key_value_heads=1 stays multi-query); sub-configs
(text_config, vision_config, audio_config, encoder, ...) are shrunk the same way; every
dropout, layer drop and SpecAugment probability is 0 (a kept attention output cannot stand in
for attention dropout, and layers that are dropped at random do not recompute); special token
ids (image, video, vision start, ...) are small distinct ids inside the vocabulary, the same
for a name everywhere in the config. ARCH holds what one type needs besides.
"""
import inspect

import transformers

VOCAB = 97
LAYERS = 4      # decoder-only and encoder-only models
ENC_DEC = 2     # each of the encoder and the decoder of an encoder-decoder model
IMAGE = 32      # image side, pixels
PATCH = 8
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
FIRST_SPECIAL = 3  # special token ids: 3, 4, ... (SPECIAL_ORDER first, then by name); text ids from TEXT
TEXT = 32

CORE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            use_cache=False, tie_word_embeddings=False)
SHRINK = dict(
    # encoder-decoder and other names for layers, widths and heads
    encoder_layers=ENC_DEC, decoder_layers=ENC_DEC, num_decoder_layers=ENC_DEC, num_encoder_layers=ENC_DEC,
    num_layers=LAYERS, depth=2, vision_layers=2, text_layers=2, d_model=64, embed_dim=64, hidden_dim=64,
    encoder_attention_heads=4, decoder_attention_heads=4, num_heads=4, n_heads=4, d_kv=16,
    encoder_hidden_size=64, text_embed_dim=64, vision_embed_dim=64, out_hidden_size=64,
    # feed-forward widths under other names
    ffn_dim=96, n_inner=96, d_ff=96, ffn_hidden_size=96, decoder_ffn_dim=96, encoder_ffn_dim=96, mlp_dim=96,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
    moe_ffn_hidden_size=32, shared_intermediate_size=32, ffn_intermediate_size=96,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, top_k=2, moe_k=2, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1,
    # partial rotary (GPT-J, CodeGen): within the head
    rotary_dim=16,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # Mamba, linear attention
    mamba_d_state=16, state_size=16, mamba_n_groups=1, n_groups=1, mamba_d_head=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_head_dim=16, index_head_dim=16, projection_intermediate_size=96,
    # sliding-window layers with heads of their own (Inkling)
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    # sliding windows shorter than the batch, so that the window masks something
    sliding_window=16, attention_window_size=16,
    # per-layer embeddings (Gemma 3n, Gemma 4)
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    # vision
    image_size=IMAGE, patch_size=PATCH,
    # audio: mel bins, frames (Whisper's encoder takes 2 * max_source_positions frames), convolutions
    num_mel_bins=16, max_source_positions=16, max_target_positions=64, input_feat_per_channel=16,
    num_conv_pos_embeddings=16, max_length=32,
)
# SHRINK fields set even where the default is None (MoE configs whose defaults leave them unset).
NEEDED = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")
# Lists of widths, each lowered to this (wav2vec2's feature encoder).
SHRINK_LISTS = dict(conv_dim=32)
SET = dict(image_grid_pinpoints=[[IMAGE, IMAGE]])  # set where the config has the field (not None)
OFF = dict(mask_time_prob=0.0, mask_feature_prob=0.0, use_pretrained_backbone=False, use_timm_backbone=False)
SPECIAL_ORDER = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "audio_token_id")
VISION_START = FIRST_SPECIAL + SPECIAL_ORDER.index("vision_start_token_id")

# Per type: config fields set after the generic ones ("config"), per sub-config ("sub":
# {name: {...}}), "keep_sub": sub-configs left as the config class makes them, "keep_layers":
# layer-kind lists left as they are, "why": a note for a row that is not buildable, "skip":
# the reason a type is skipped without building it, "head": the head swept instead of the
# first of models.HEADS.
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, mamba_expand=2)
_QWEN4 = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
              hc_lowrank=8, split_ngram_parts=4, ngram_vocab_size_base=VOCAB)
_GEMMA3N = dict(num_kv_shared_layers=2, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4)
_TINY_IMAGE_TOKENS = dict(mm_tokens_per_image=4)  # (IMAGE / PATCH)**2 = 16 patches pooled 2 x 2
_VOCABULARY_MAP = "needs a hub download: its vocabulary_map (the image tokens of its tokenizer) comes with a checkpoint"
ARCH = {
    "bamba": dict(keep_layers=True, config=dict(_MAMBA, attn_layer_indices=[1, 3])),
    "granitemoehybrid": dict(config=dict(_MAMBA, layer_types=["mamba", "attention", "mamba", "attention"])),
    "falcon_h1": dict(keep_layers=True, config=dict(_MAMBA, mamba_d_ssm=128)),
    "nemotron_h": dict(config=dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=8,
                                   moe_shared_expert_intermediate_size=32)),
    "mamba2": dict(config=dict(num_heads=8, head_dim=16, state_size=16, chunk_size=8)),
    "jamba": dict(config=dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                              mamba_dt_rank=8, use_mamba_kernels=False)),
    "zamba": dict(config=dict(attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=8,
                              attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False)),
    "zamba2": dict(config=dict(attention_hidden_size=128, attention_head_dim=32, mamba_headdim=16, n_mamba_heads=8,
                               mamba_d_state=16, chunk_size=8, use_mamba_kernels=False, adapter_rank=8,
                               kv_channels=16, num_query_groups=4, hybrid_layer_ids=[1, 3],
                               layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])),
    "kimi_linear": dict(config=dict(linear_num_heads=4, linear_head_dim=16, num_experts_per_token=2,
                                    num_expert_group=1)),
    "lfm2": dict(config=dict(layer_types=["conv", "full_attention", "conv", "full_attention"],
                             full_attn_idxs=[1, 3], block_multiple_of=16)),
    "lfm2_moe": dict(config=dict(layer_types=["conv", "full_attention", "conv", "full_attention"],
                                 num_dense_layers=1)),
    "longcat_flash": dict(config=dict(num_layers=2, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                                      expert_ffn_hidden_size=32)),
    "gpt_neo": dict(config=dict(attention_types=[[["global", "local"], 2]], num_layers=4, window_size=16)),
    "recurrent_gemma": dict(config=dict(block_types=["recurrent", "attention"], lru_width=64)),
    "gemma3n_text": dict(config=_GEMMA3N),
    "gemma3n": dict(sub=dict(text_config=_GEMMA3N)),
    "blt": dict(config=dict(encoder_hash_byte_group_vocab=VOCAB),
                sub=dict(encoder_config=dict(hidden_size_global=64), decoder_config=dict(hidden_size_global=64))),
    "qwen4_exp_text": dict(config=_QWEN4),
    "qwen4_exp": dict(sub=dict(text_config=_QWEN4)),
    "gemma3": dict(config=_TINY_IMAGE_TOKENS),
    "shieldgemma2": dict(config=_TINY_IMAGE_TOKENS),
    "cohere_compass_text": dict(why="its default config has no RoPE parameters for its layer types "
                                    "(rope_parameters['full_attention'] is read and missing)"),
    "gemma4_assistant": dict(why="a drafter for Gemma 4 speculative decoding, built with its target model"),
    "gemma4_unified_assistant": dict(why="a drafter for Gemma 4 speculative decoding, built with its target model"),
    "dbrx": dict(keep_sub=True, config=dict(d_model=64, n_heads=4, n_layers=4, max_seq_len=128,
                                            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                            ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2))),
    "chameleon": dict(skip=_VOCABULARY_MAP),
    # (their image-text-to-text path needs a checkpoint's vocabulary_map, or cross-attention
    # inputs (tiles, aspect ratios) the sweep does not make: swept as causal LMs, text only)
    "emu3": dict(head="causal LM"),
    "mllama": dict(head="causal LM", **({"sub": dict(text_config=dict(rope_scaling={
        "rope_type": "default", "rope_theta": 10000.0}))} if transformers.__version__.startswith("4.") else {})),
    "paligemma": dict(config=dict(projection_dim=64)),
    "florence2": dict(sub=dict(vision_config=dict(projection_dim=64))),
    "vipllava": dict(config=dict(vision_feature_layers=[-2, -5, -4, -3, 4])),
    # (their configs lack the vision start token their position ids look for)
    "qwen2_5_omni_thinker": dict(config=dict(vision_start_token_id=VISION_START)),
    "qwen3_omni_moe_thinker": dict(config=dict(vision_start_token_id=VISION_START)),
}
# Layer counts that are ENC_DEC in an encoder-decoder config (one each for its encoder and decoder).
ENC_DEC_LAYERS = ("num_hidden_layers", "num_layers")


def _has(config, name):
    """Whether the config has a field `name` that can be set."""
    attr = getattr(type(config), name, None)
    if isinstance(attr, property) and attr.fset is None:
        return False
    try:
        getattr(config, name)
        return True
    except Exception:  # AttributeError, or transformers' per-layer attribute errors
        return False


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _canonical(name):
    return name[:-len("_token_index")] + "_token_id" if name.endswith("_token_index") else name


def special_ids(config_dict):
    """{field name: id} for the special token ids anywhere in a config (as a dict; those of
    SPECIAL_ORDER also where None): small distinct ids, the same for a name (and for its
    _token_index spelling) in every sub-config."""
    names = set()

    def walk(d):
        for name, value in d.items():
            if isinstance(value, dict):
                walk(value)
            elif (_is_int(value) and _canonical(name).endswith("_token_id") and name not in TOKEN_IDS
                  or value is None and _canonical(name) in SPECIAL_ORDER):
                names.add(name)
    walk(config_dict)
    rest = sorted({_canonical(n) for n in names} - set(SPECIAL_ORDER))
    if len(SPECIAL_ORDER) + len(rest) > TEXT - FIRST_SPECIAL:
        raise ValueError(f"{len(rest)} special token ids do not fit below the text ids")
    order = list(SPECIAL_ORDER) + rest
    return {n: FIRST_SPECIAL + order.index(_canonical(n)) for n in names}


def _alias(config_class, name):
    return (getattr(config_class, "attribute_map", {}) or {}).get(name, name)


def _tiny_kwargs(config_class, default, spec, ids):
    from transformers import PretrainedConfig
    kwargs = {}
    enc_dec = _has(default, "encoder_layers") or _has(default, "num_decoder_layers")
    for name, value in CORE.items():
        if _has(default, name):
            kwargs[name] = ENC_DEC if enc_dec and name in ENC_DEC_LAYERS else value
    for name, value in SHRINK.items():
        if _has(default, name):
            old = getattr(default, name)
            if old is None and name in NEEDED:
                kwargs[name] = value
            elif _is_int(old) and name not in kwargs:
                kwargs[name] = min(old, ENC_DEC if enc_dec and name in ENC_DEC_LAYERS else value)
    for name, width in SHRINK_LISTS.items():
        old = getattr(default, name, None)
        if isinstance(old, (list, tuple)) and all(_is_int(v) for v in old):
            kwargs[name] = [min(v, width) for v in old]
    for name, value in vars(default).items():
        if isinstance(value, float) and value and ("drop" in name or name in OFF):
            kwargs[name] = 0.0
    for name, value in OFF.items():
        if name in vars(default) and getattr(default, name) and isinstance(value, bool):
            kwargs[name] = value
    for name, value in SET.items():
        if getattr(default, name, None) is not None:
            kwargs[name] = value
    for name, value in TOKEN_IDS.items():
        if _has(default, name) and (_is_int(getattr(default, name)) or getattr(default, name) is None):
            kwargs[name] = value
    kwargs.update({n: i for n, i in ids.items() if n in vars(default)})
    if "kv_lora_rank" in kwargs:  # multi-head latent attention: one key per query head, rotary on part of it
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    _shrink_mrope(config_class, default, kwargs)
    declared = getattr(config_class, "sub_configs", None)
    subs = {} if spec.get("keep_sub") else dict(declared if isinstance(declared, dict) else {},
                                                 **{n: type(v) for n, v in vars(default).items()
                                                    if isinstance(v, PretrainedConfig)})
    for name in subs:  # (4.57's T5Gemma names its encoder and decoder in no sub_configs)
        sub = getattr(default, name, None)
        sub_class = type(sub) if isinstance(sub, PretrainedConfig) else subs[name]
        if isinstance(sub_class, type) and issubclass(sub_class, PretrainedConfig) and sub_class is not PretrainedConfig:
            kwargs[name] = _tiny(sub_class, {"config": spec.get("sub", {}).get(name, {})}, ids).to_dict()
    kwargs.update(spec.get("config", {}))
    return kwargs


def _uses_mrope(config_class):
    try:
        return "mrope_section" in inspect.getsource(config_class)
    except (OSError, TypeError):
        return False


def _shrink_mrope(config_class, default, kwargs):
    """Multimodal RoPE sections (Qwen2-VL and its kin; 16, 24, 24 where the config gives none)
    sum to half the rotary part of a head: scaled down with it."""
    heads = kwargs.get("num_attention_heads")
    head_dim = kwargs.get("head_dim") or (kwargs["hidden_size"] // heads if heads and "hidden_size" in kwargs
                                          else None)
    name = next((n for n in ("rope_parameters", "rope_scaling") if _has(default, n)), None)
    rope = getattr(default, name, None) if name else None
    if not head_dim or not (_uses_mrope(config_class) or isinstance(rope, dict) and "mrope_section" in rope):
        return
    rope = dict(rope or {"rope_type": "default"})
    section = rope.get("mrope_section") or [16, 24, 24]
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or getattr(default, "partial_rotary_factor", 1) or 1))
    half, full = rotary // 2, sum(section)
    scaled = [max(1, s * half // full) for s in section[:-1]]
    kwargs[name] = dict(rope, mrope_section=scaled + [half - sum(scaled)])


LAYER_LISTS = ("layer_types", "layers_block_type")


def _is_attention_kind(kind):
    kind = str(kind).lower()
    return ("attention" in kind and "linear" not in kind) or kind in ("attention", "hybrid", "global", "local")


def layer_pattern(kinds):
    """A short list of layer kinds with every kind, at least two attention layers where there
    are other layers, and attention after each other kind: [other, attention, other, attention]."""
    attention = [k for k in kinds if _is_attention_kind(k)]
    other = [k for k in kinds if not _is_attention_kind(k)]
    if not attention or not other:
        kinds = attention or other
        return [kinds[i % len(kinds)] for i in range(max(LAYERS, len(kinds)))]
    n = max(LAYERS // 2, len(other), len(attention))
    return [k for i in range(n) for k in (other[i % len(other)], attention[i % len(attention)])]


def _is_kind_list(value):
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(k, str) for k in value)


def _kinds(values):
    return list(dict.fromkeys(values))


def tiny_config(arch):
    """The tiny config of model type `arch`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[arch]
    return _tiny(config_class, ARCH.get(arch, {}), special_ids(config_class().to_dict()))


def _tiny(config_class, spec, ids):
    default = config_class()
    kwargs = _tiny_kwargs(config_class, default, spec, ids)
    # Layer-kind lists (hybrids, sliding/full patterns): every kind of the full-size default
    # in a few layers, with at least two attention layers.
    given = {_alias(config_class, n) for n in spec.get("config", {})}
    lists = [] if spec.get("keep_layers") else list(dict.fromkeys(
        _alias(config_class, n) for n in LAYER_LISTS if _has(default, _alias(config_class, n))))
    lists = [n for n in lists if n not in given]
    for name in lists:
        full = getattr(default, name, None)
        if _is_kind_list(full):
            kwargs[name] = layer_pattern(_kinds(full))
            if "num_hidden_layers" in kwargs:
                kwargs["num_hidden_layers"] = len(kwargs[name])
            break
    config = config_class(**kwargs)
    for name in lists:  # a default of None: the kinds the config makes for the tiny model
        now = getattr(config, name, None)
        if name not in kwargs and _is_kind_list(now) and list(now) != layer_pattern(_kinds(now)):
            kwargs[name] = layer_pattern(_kinds(now))
            if "num_hidden_layers" in kwargs:
                kwargs["num_hidden_layers"] = len(kwargs[name])
            config = config_class(**kwargs)
            break
    return config
