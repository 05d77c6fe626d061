"""The supported-architecture sweep: every decoder-only model type of the installed
transformers, built tiny with SDPA, trained with and without the stash.

    python tests/python/sweep_models.py [--archs llama,gpt2,...] [--out out/sweep] [--jobs N]

For each type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (encoder-decoder models and
encoder models with a causal-LM head are skipped, with the reason), it builds a tiny model
from the config class (hidden 64, 4 layers, 4 heads, 2 KV heads, vocabulary 97, dropout 0,
random weights from a fixed seed, attn_implementation="sdpa"), and for each checkpointing
mode (reentrant, non-reentrant) and batch (unpadded; left-padded rows of different lengths
with an attention_mask):

  1. the baseline is reproducible: two runs without the stash give bitwise the same loss and
     gradients (else "baseline not deterministic", and that combination proves nothing);
  2. with the stash on every attention layer, loss and every gradient are bitwise the
     baseline's, keeps and replays each grow by the number of stashed attention modules that
     ran, and nothing is held after (also after a refusal).

Outcomes: "supported" (all four combinations bitwise), "refused at install: ...",
"refused at run: ..." (an attnstash error in the first training forward, or, for a mask made
from parameters, which a reentrant recompute is the first to show, in its backward), "not buildable:
...", "skipped: ...", "baseline not deterministic (...)" and "FAILED: ..." (a crash, a
timeout, a non-attnstash exception, an attnstash error in the backward, a wrong gradient,
wrong counters, something left in the stash). Each type runs in its own process (forked from a server that imported torch and
transformers once), with a timeout, so that a crash is a FAILED row. The CLI prints a
markdown table and writes sweep.json and sweep.md under --out.

check_arch(arch) runs one type in this process (the pytest subset uses it).
"""
import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

import torch
import transformers

import attnstash
from attnstash.install import find_layers

VOCAB = 97
LAYERS = 4
SEQ = 24
PADS = (0, 4, 9)  # left padding per row of the padded batch: rows of different lengths
MODES = ("reentrant", "non-reentrant")
BATCHES = ("unpadded", "left-padded")
SEED = 0

# Set on every config that has the field (through its attribute_map too: n_embd, n_layer, ...).
CORE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            use_cache=False, tie_word_embeddings=False)
# Set where the config has the field with a value that is not None, never raised above
# the default (num_key_value_heads=1 stays multi-query, n_shared_experts=1 stays 1).
SHRINK = dict(
    # feed-forward widths under other names
    ffn_dim=96, n_inner=96, d_ff=96, ffn_hidden_size=96, decoder_ffn_dim=96, encoder_ffn_dim=96,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, expert_intermediate_size=32,
    moe_ffn_hidden_size=32, shared_intermediate_size=32, ffn_intermediate_size=96,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, top_k=2, moe_k=2, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # Mamba, linear attention
    mamba_d_state=16, state_size=16, mamba_n_groups=1, n_groups=1, mamba_d_head=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    # sliding-window layers with heads of their own (Inkling)
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    # sliding windows shorter than the batch, so that the window masks something
    sliding_window=16, attention_window_size=16,
    # per-layer embeddings (Gemma 3n, Gemma 4)
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
)
# SHRINK fields set even where the default is None (MoE configs whose defaults leave them unset).
NEEDED = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Per type: config fields set after the generic ones ("config"), per sub-config ("sub":
# {name: {...}}), and "keep_sub": sub-configs left as the config class makes them.
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, mamba_expand=2)
_QWEN4 = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
              hc_lowrank=8, split_ngram_parts=4, ngram_vocab_size_base=VOCAB)
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
    "gemma3n_text": dict(config=dict(num_kv_shared_layers=2, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4)),
    "gemma3n": dict(sub=dict(text_config=dict(num_kv_shared_layers=2, laurel_rank=8,
                                              activation_sparsity_pattern=[0.0] * 4))),
    "blt": dict(config=dict(encoder_hash_byte_group_vocab=VOCAB),
                sub=dict(encoder_config=dict(hidden_size_global=64), decoder_config=dict(hidden_size_global=64))),
    "qwen4_exp_text": dict(config=_QWEN4),
    "qwen4_exp": dict(sub=dict(text_config=_QWEN4)),
    "cohere_compass_text": dict(why="its default config has no RoPE parameters for its layer types "
                                    "(rope_parameters['full_attention'] is read and missing)"),
    "gemma4_assistant": dict(why="a drafter for Gemma 4 speculative decoding, built with its target model"),
    "gemma4_unified_assistant": dict(why="a drafter for Gemma 4 speculative decoding, built with its target model"),
    **({"mllama": dict(sub=dict(text_config=dict(rope_scaling={"rope_type": "default", "rope_theta": 10000.0})))}
       if transformers.__version__.startswith("4.") else {}),
    "dbrx": dict(keep_sub=True, config=dict(d_model=64, n_heads=4, n_layers=4, max_seq_len=128,
                                            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                            ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2))),
}

# Encoder-decoder models, and encoder models whose causal-LM class is the encoder run as a
# decoder, are not decoder-only: their CausalLM is not what the stash is for.
ENCODER_ONLY = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                "megatron-bert", "qdqbert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod", "mega", "reformer", "xlnet")
DECODER_OF_ENCODER_DECODER = ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart",
                              "mvp", "pegasus", "plbart", "prophetnet", "xlm-prophetnet", "trocr", "whisper",
                              "speech_to_text_2", "musicgen", "musicgen_melody")


def causal_lm_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def skip_reason(arch):
    if arch in ENCODER_ONLY:
        return "encoder-only model (its causal-LM head runs the encoder as a decoder), not decoder-only"
    if arch in DECODER_OF_ENCODER_DECODER:
        return "the decoder of an encoder-decoder model, not a decoder-only model"
    return None


# ---- building tiny models ----------------------------------------------------------------

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


def _tiny_kwargs(config_class, spec):
    from transformers import PretrainedConfig
    default = config_class()
    kwargs = {}
    for name, value in CORE.items():
        if _has(default, name):
            kwargs[name] = value
    for name, value in SHRINK.items():
        if _has(default, name):
            old = getattr(default, name)
            if old is None and name in NEEDED:
                kwargs[name] = value
            elif isinstance(old, int) and not isinstance(old, bool):
                kwargs[name] = min(old, value)
    for name, value in vars(default).items():
        if isinstance(value, float) and value and ("dropout" in name or "pdrop" in name):
            kwargs[name] = 0.0
    for name, value in TOKEN_IDS.items():
        if _has(default, name) and isinstance(getattr(default, name), int):
            kwargs[name] = value
    if "kv_lora_rank" in kwargs:  # multi-head latent attention: one key per query head, rotary on part of it
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    for name in () if spec.get("keep_sub") else getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        sub_class = type(sub) if isinstance(sub, PretrainedConfig) else config_class.sub_configs[name]
        if isinstance(sub_class, type) and issubclass(sub_class, PretrainedConfig) and sub_class is not PretrainedConfig:
            kwargs[name] = _tiny(sub_class, {"config": spec.get("sub", {}).get(name, {})}).to_dict()
    kwargs.update(spec.get("config", {}))
    return kwargs


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
    return _tiny(CONFIG_MAPPING[arch], ARCH.get(arch, {}))


def _tiny(config_class, spec):
    kwargs = _tiny_kwargs(config_class, spec)
    # Layer-kind lists (hybrids, sliding/full patterns): every kind of the full-size default
    # in a few layers, with at least two attention layers.
    default = config_class()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    given = {aliases.get(n, n) for n in spec.get("config", {})}
    lists = [] if spec.get("keep_layers") else list(dict.fromkeys(
        aliases.get(n, n) for n in LAYER_LISTS if _has(default, aliases.get(n, n))))
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


def build(arch, seed=SEED):
    """The tiny model of `arch`, random weights from `seed`, SDPA, in train mode."""
    config = tiny_config(arch)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = config.get_text_config()
    if not isinstance(config, model_class.config_class) and isinstance(text, model_class.config_class):
        config = text  # a causal-LM class of the text model, mapped from a composite config (4.57)
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def make_batch(kind):
    """(input_ids, attention_mask or None, labels)."""
    g = torch.Generator().manual_seed(1)
    if kind == "unpadded":
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
        return ids, None, ids
    ids = torch.randint(3, VOCAB, (len(PADS), SEQ), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = 0
    ids = ids.masked_fill(mask == 0, 0)  # the pad token
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _copy(base, mode):
    model = copy.deepcopy(base)
    set_mode(model, mode)
    return model


def set_mode(model, mode):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})


class _Phase:
    name = "forward"


def train_step(model, batch, phase=None):
    """One forward and backward: (loss, {parameter name: grad})."""
    phase = phase or _Phase()
    ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED + 1)  # models that draw random numbers in training (router jitter) repeat
    phase.name = "forward"
    kwargs = {} if mask is None else {"attention_mask": mask}
    loss = model(input_ids=ids, labels=labels, **kwargs).loss
    phase.name = "backward"
    loss.backward()
    phase.name = "done"
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(a, b):
    """What differs bitwise between two (loss, grads) results (NaN equals NaN of the same bits)."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    out = []
    if loss_a.dtype != loss_b.dtype or not torch.equal(_bits(loss_a), _bits(loss_b)):
        out.append(f"loss {loss_a.item()!r} vs {loss_b.item()!r}")
    if grads_a.keys() != grads_b.keys():
        out.append(f"gradients of different parameters: {sorted(grads_a.keys() ^ grads_b.keys())[:4]}")
    wrong = [n for n in grads_a.keys() & grads_b.keys()
             if grads_a[n].dtype != grads_b[n].dtype or grads_a[n].shape != grads_b[n].shape
             or not torch.equal(_bits(grads_a[n]), _bits(grads_b[n]))]
    if wrong:
        wrong.sort()
        worst = max(wrong, key=lambda n: (grads_a[n].double() - grads_b[n].double()).abs().nan_to_num(1e30).max().item())
        diff = (grads_a[worst].double() - grads_b[worst].double()).abs().max().item()
        out.append(f"{len(wrong)} gradients differ ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}; "
                   f"largest |diff| {diff:.3g} in {worst})")
    return out


def _short(e, limit=300):
    text = f"{type(e).__name__}: {e}" if not str(e).startswith("attnstash") else str(e)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_line(e, limit=160):
    text = str(e).strip().splitlines()[0].strip() if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _CountSdpa(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.scaled_dot_product_attention:
            self.calls += 1
            self.on_sdpa(args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def on_sdpa(self, args, kwargs):
        pass


def probe(model, batch):
    """One training forward without the stash, under non-reentrant checkpointing (whose first
    forward runs with grad on where a backward can reach it): (F.scaled_dot_product_attention
    calls, {attention layer index: calls in it}, {attention layer index: calls in the autograd
    graph: grad on and a query, key or value that requires grad}) for the layers attnstash
    finds."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    set_mode(model, "non-reentrant")
    index_of = {id(module): index for index, _, module in attnstash.attention_layers(model)}
    stack, ran, grad = [], {}, {}
    counter = _CountSdpa()

    def on_sdpa(args, kwargs):
        layer = next((index_of[id(m)] for m in reversed(stack) if id(m) in index_of), None)
        if layer is None:
            return
        ran[layer] = ran.get(layer, 0) + 1
        tensors = [t for t in list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")]
                   if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            grad[layer] = grad.get(layer, 0) + 1

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    counter.on_sdpa = on_sdpa
    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    ids, mask, labels = batch
    kwargs = {} if mask is None else {"attention_mask": mask}
    try:
        torch.manual_seed(SEED + 1)
        with counter:
            out = model(input_ids=ids, labels=labels, **kwargs)
        del out
    finally:
        for h in handles:
            h.remove()
    return counter.calls, ran, grad


def _stats():
    return attnstash.stash_stats()


def _held():
    s = _stats()
    if s["entries"] or s["bytes"]:  # perhaps only garbage not yet collected holds them
        gc.collect()
        s = _stats()
    return s["entries"], s["bytes"]


def check_arch(arch, modes=MODES, batches=BATCHES):
    """Run the sweep's checks for one model type in this process; never raises. Returns the
    row: {arch, outcome, stashed, attention_layers, decoder_layers, notes, combos, seconds}."""
    start = time.time()
    row = dict(arch=arch, outcome=None, stashed=None, attention_layers=None, decoder_layers=None, notes=[],
               combos={}, seconds=None)
    try:
        _check(arch, row, modes, batches)
    except Exception as e:  # a bug of the sweep itself, or something none of the steps caught
        row["outcome"] = f"FAILED: unexpected {_short(e)}"
        row["notes"].append(traceback.format_exc(limit=6))
    finally:
        entries, nbytes = _held()
        if entries or nbytes:
            attnstash.stash_clear()
            if not row["outcome"].startswith("FAILED"):
                row["outcome"] = f"FAILED: {entries} entries ({nbytes} bytes) left in the stash after the arch"
    row["seconds"] = round(time.time() - start, 1)
    return row


def _check(arch, row, modes, batches):
    reason = skip_reason(arch)
    if reason:
        row["outcome"] = f"skipped: {reason}"
        return
    try:
        base = build(arch)
    except Exception as e:
        text = str(e)
        if "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention" \
                in text:
            row["outcome"] = f"not buildable: transformers has no SDPA attention for {text.split()[0]}"
        else:
            row["outcome"] = f"not buildable: {_first_line(e)}"
        why = ARCH.get(arch, {}).get("why")
        if why:
            row["notes"].append(why)
        return
    if not getattr(base, "supports_gradient_checkpointing", False):
        row["outcome"] = "not buildable: the model does not support gradient checkpointing"
        return
    try:
        decoder = [type(f.module).__name__ for f in find_layers(base)]
        found = attnstash.attention_layers(base)
    except attnstash.InstallError as e:
        row["outcome"] = f"refused at install: {_short(e, 400)}"
        return
    row["decoder_layers"] = len(decoder)
    row["attention_layers"] = [i for i, _, _ in found]

    # The plain model must train in every combination (else: not buildable).
    batch_of = {kind: make_batch(kind) for kind in batches}
    baselines = {}
    for mode in modes:
        for kind in batches:
            try:
                first, second = (train_step(_copy(base, mode), batch_of[kind]) for _ in range(2))
            except Exception as e:
                row["outcome"] = f"not buildable: {mode}/{kind} training step fails without the stash: {_first_line(e)}"
                return
            baselines[mode, kind] = first, differences(first, second)

    # Install (once to see what it does; then per combination on a fresh copy).
    model = copy.deepcopy(base)
    set_mode(model, "reentrant")
    try:
        stashed = attnstash.install_attention_stash(model)
    except ValueError as e:
        if str(e).startswith("attnstash"):
            row["outcome"] = f"refused at install: {_short(e, 400)}"
        else:
            row["outcome"] = f"FAILED: install raised a ValueError that is not attnstash's: {_short(e)}"
        return
    except Exception as e:
        row["outcome"] = f"FAILED: install raised {_short(e)}"
        return
    attnstash.uninstall_attention_stash(model)
    row["stashed"] = stashed
    if stashed != row["attention_layers"]:
        row["outcome"] = f"FAILED: install(None) stashed {stashed}, not the attention layers {row['attention_layers']}"
        return
    layers = len(found)
    sdpa_calls, ran, grad = probe(copy.deepcopy(base), batch_of[batches[0]])
    total, calls = sum(ran.values()), sum(grad.values())  # calls: those a backward reaches (kept)
    row["probe"] = dict(attention_layers=layers, layers_ran=len(ran), attention_calls=total,
                        attention_calls_with_grad=calls, sdpa_calls=sdpa_calls)
    if len(ran) != layers:
        row["notes"].append(f"{layers - len(ran)} of {layers} attention layers called no attention in a text-only "
                            "forward")
    if total > len(ran):
        row["notes"].append(f"{len(ran)} attention layers called attention {total} times per forward")
    if calls < total:
        row["notes"].append(f"{total - calls} of {total} attention calls ran outside the autograd graph "
                            "(no_grad or frozen: nothing to keep)")
    if sdpa_calls != total:
        row["notes"].append(f"{sdpa_calls} F.scaled_dot_product_attention calls per forward, {total} of them in the "
                            "attention layers found")

    failures, refusals, unverified = [], [], []
    for mode in modes:
        for kind in batches:
            combo = f"{mode}/{kind}"
            reference, nondeterministic = baselines[mode, kind]
            result = _stash_combo(base, mode, batch_of[kind], reference, calls)
            if nondeterministic:
                result["baseline"] = "not deterministic: " + "; ".join(nondeterministic)
                if result["status"] == "different":
                    result["status"] = "unverified"
            row["combos"][combo] = result
            if result.get("note") and result["note"] not in row["notes"]:
                row["notes"].append(result["note"])
            status = result["status"]
            if status == "refused":
                refusals.append((combo, result["detail"]))
            elif status == "unverified":
                unverified.append(combo)
            elif status != "bitwise":
                failures.append((combo, result["detail"]))
    if failures:
        causes = {}
        for combo, detail in failures:
            causes.setdefault(detail, []).append(combo)
        row["outcome"] = "FAILED: " + " | ".join(f"{'+'.join(c)}: {d}" for d, c in causes.items())
    elif refusals:
        messages = {d for _, d in refusals}
        combos = [c for c, _ in refusals]
        where = "" if len(combos) == len(modes) * len(batches) else f" ({', '.join(combos)})"
        row["outcome"] = f"refused at run{where}: " + " | ".join(sorted(messages))
    elif unverified:
        row["outcome"] = f"baseline not deterministic ({', '.join(unverified)})"
    else:
        row["outcome"] = "supported"


def _stash_combo(base, mode, batch, reference, expected):
    """One combination with the stash on every attention layer: {status, detail, ...}."""
    result = {"status": None, "detail": ""}
    model = copy.deepcopy(base)
    set_mode(model, mode)
    attnstash.install_attention_stash(model)
    phase = _Phase()
    before = _stats()
    got = error = None
    try:
        got = train_step(model, batch, phase)
    except Exception as e:  # noqa: BLE001 - classified below
        error = e
    finally:
        attnstash.uninstall_attention_stash(model)
    after = _stats()
    del model
    keeps, replays = after["keeps"] - before["keeps"], after["replays"] - before["replays"]
    unused = after["released_unused"] - before["released_unused"]
    result.update(keeps=keeps, replays=replays, expected=expected, declined=after["declined"] - before["declined"],
                  misses=after["misses"] - before["misses"], released_unused=unused)
    if error is not None:
        message = _short(error, 500)
        attn = isinstance(error, (RuntimeError, ValueError)) and str(error).startswith("attnstash")
        error = None
        entries, nbytes = _held()
        if entries or nbytes:
            attnstash.stash_clear()
            result.update(status="failed", detail=f"{entries} entries left in the stash after an error in the "
                                                  f"{phase.name}: {message}")
        elif attn and phase.name == "forward":
            result.update(status="refused", detail=message)
        elif attn and "attn_mask requires grad" in message:
            # A mask made from parameters shows it requires grad only in a reentrant
            # recompute (the first forward runs under no_grad): refused there, clearly.
            result.update(status="refused", detail=f"in the backward: {message}")
        elif attn:
            result.update(status="failed", detail=f"attnstash error in the {phase.name} (after the forward "
                                                  f"kept): {message}")
        else:
            result.update(status="failed", detail=f"{phase.name} raised {message}")
        return result
    entries, nbytes = _held()
    if entries or nbytes:
        attnstash.stash_clear()
        result.update(status="failed", detail=f"{entries} entries ({nbytes} bytes) left in the stash")
        return result
    diff = differences(got, reference)
    if diff:
        result.update(status="different", detail="not bitwise: " + "; ".join(diff))
        return result
    if keeps != expected or replays + unused != keeps or result["misses"] or result["declined"]:
        result.update(status="failed", detail=f"keeps +{keeps}, replays +{replays}, released unused +{unused}, "
                                              f"misses +{result['misses']}, declined +{result['declined']} for "
                                              f"{expected} stashed attention calls per forward")
        return result
    result["status"] = "bitwise"
    if unused:  # kept by a forward whose output no backward reaches: released with its graph
        result["note"] = (f"{unused} of {keeps} kept outputs never replayed (no backward reached those layers; "
                          "released with the graph)")
    return result


# ---- running every type, isolated ------------------------------------------------------------

def _worker(arch, conn, threads):
    torch.set_num_threads(threads)
    try:
        import warnings
        warnings.filterwarnings("ignore")
        transformers.logging.set_verbosity_error()
        row = check_arch(arch)
    except BaseException as e:  # noqa: BLE001
        row = dict(arch=arch, outcome=f"FAILED: worker {_short(e)}", notes=[])
    conn.send(row)
    conn.close()


def sweep(archs, jobs=1, timeout=300, threads=1, log=None):
    """Run check_arch for each arch in a process of its own (at most `jobs` at once);
    a crash or a timeout is a FAILED row. Returns the rows in the order of `archs`."""
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.modeling_utils", "attnstash.install",
                                "attnstash.ops", __name__ if __name__ != "__main__" else "__main__"])
    pending = list(archs)
    running = {}  # arch -> (process, conn, start)
    rows = {}
    while pending or running:
        while pending and len(running) < jobs:
            arch = pending.pop(0)
            reason = skip_reason(arch)
            if reason:
                rows[arch] = dict(arch=arch, outcome=f"skipped: {reason}", stashed=None, attention_layers=None,
                                  decoder_layers=None, notes=[], combos={}, seconds=0)
                if log:
                    log(rows[arch])
                continue
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(arch, child, threads), daemon=True)
            proc.start()
            child.close()
            running[arch] = (proc, parent, time.time())
        if not running:
            continue
        time.sleep(0.05)
        for arch, (proc, conn, start) in list(running.items()):
            row = None
            if conn.poll():
                try:
                    row = conn.recv()
                except EOFError:
                    row = None
                proc.join(30)
                if row is None:
                    row = _dead_row(arch, proc, start)
            elif not proc.is_alive():
                proc.join()
                row = _dead_row(arch, proc, start)
            elif time.time() - start > timeout:
                proc.kill()
                proc.join()
                row = dict(arch=arch, outcome=f"FAILED: timed out after {timeout} s", notes=[])
            if row is not None:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                conn.close()
                row.setdefault("seconds", round(time.time() - start, 1))
                for key in ("stashed", "attention_layers", "decoder_layers", "combos"):
                    row.setdefault(key, None)
                rows[arch] = row
                del running[arch]
                if log:
                    log(row)
    return [rows[a] for a in archs]


def _dead_row(arch, proc, start):
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return dict(arch=arch, outcome=f"FAILED: the process crashed ({how})", notes=[],
                seconds=round(time.time() - start, 1))


# ---- the table ---------------------------------------------------------------------------------

CATEGORIES = ("supported", "refused", "not buildable", "skipped", "baseline not deterministic", "FAILED")


def category(outcome):
    for name in CATEGORIES:
        if outcome.startswith(name):
            return name
    return "other"


def _layers_cell(row):
    stashed, attention, decoder = row.get("stashed"), row.get("attention_layers"), row.get("decoder_layers")
    if stashed:
        text = ",".join(map(str, stashed)) + f" of {decoder}"
        if attention is not None and attention != stashed:
            text += f" (attention: {','.join(map(str, attention))})"
        return text
    if attention:
        return f"(attention: {','.join(map(str, attention))} of {decoder})"
    if decoder is not None:
        return f"none of {decoder}"
    return ""


def markdown(rows, title=None):
    counts = {}
    for row in rows:
        counts[category(row["outcome"])] = counts.get(category(row["outcome"]), 0) + 1
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append(", ".join(f"{counts.get(c, 0)} {c}" for c in CATEGORIES
                           if counts.get(c) or c != "baseline not deterministic") + f" (of {len(rows)})")
    lines += ["", "| arch | outcome | stashed layers | notes |", "|---|---|---|---|"]
    for row in rows:
        notes = [n for n in row.get("notes") or [] if "\n" not in n]
        for combo, result in (row.get("combos") or {}).items():
            if result.get("baseline"):
                notes.append(f"{combo}: baseline {result['baseline']}")
        cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines.append(f"| {row['arch']} | {cell(row['outcome'])} | {_layers_cell(row)} | {cell('; '.join(notes))} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--out", default="out/sweep", help="directory for sweep.json and sweep.md")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="types run at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per type")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per type")
    args = parser.parse_args(argv)
    known = causal_lm_types()
    archs = args.archs.split(",") if args.archs else list(known)
    unknown = [a for a in archs if a not in known]
    if unknown:
        parser.error(f"not causal-LM model types of transformers {transformers.__version__}: {', '.join(unknown)}")
    start = time.time()
    done = [0]

    def log(row):
        done[0] += 1
        print(f"[{done[0]}/{len(archs)}] {row['arch']}: {row['outcome'][:200]} ({row.get('seconds')} s)",
              file=sys.stderr, flush=True)

    rows = sweep(archs, jobs=args.jobs, timeout=args.timeout, threads=args.threads, log=log)
    elapsed = time.time() - start
    title = (f"transformers {transformers.__version__}, torch {torch.__version__}: {len(rows)} causal-LM types "
             f"in {elapsed:.0f} s")
    table = markdown(rows, title)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(dict(transformers=transformers.__version__, torch=torch.__version__, seconds=round(elapsed, 1),
                       rows=rows), f, indent=1, default=str)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(table)
    return 1 if any(category(r["outcome"]) == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
