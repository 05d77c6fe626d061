"""What the attnstash.plan tests (test_plan_*.py) share: the CUDA marks, the tiny configs beyond
tiny_models.py, a batch with or without padding, and the bytes the stash holds after one
training forward, to compare with the plan."""
import contextlib

import pytest
import torch
import transformers

import attnstash
from tiny_models import VOCAB, tiny_config

CUDA = torch.cuda.is_available()
HF4 = int(transformers.__version__.split(".")[0]) < 5
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(CUDA, reason="decides by torch, not by the rules, where a CUDA GPU is present")

# Tiny configs beyond tests/python/tiny_models.py: a Mamba hybrid (attention on layers 1 and
# 3 only) and MLA (DeepSeek-V3: query/key head dim 24, value head dim 16; or equal dims).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, use_cache=False, tie_word_embeddings=False)
EXTRA = {
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16,
                  mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16, mamba_expand=2),
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1, n_shared_experts=1),
}
EXTRA["deepseek_v3_equal_dims"] = dict(EXTRA["deepseek_v3"], qk_nope_head_dim=8, qk_rope_head_dim=8)


def config_of(arch):
    if arch == "mistral_sliding":  # a sliding window shorter than the sequence: Hugging Face passes a mask
        return tiny_config("mistral", sliding_window=8)
    if arch in ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe"):
        return tiny_config(arch)
    model_type = "deepseek_v3" if arch.startswith("deepseek_v3") else arch
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[arch]})


def ids_and_mask(padded, batch=3, seq=24, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g).to(device)
    if not padded:
        return ids, {}
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[0, :5] = 0  # left padding of different lengths
    mask[1, :2] = 0
    return ids, {"attention_mask": mask}


@contextlib.contextmanager
def installed(model, n=None, max_bytes=None):
    layers = attnstash.install_attention_stash(model, n, max_bytes=max_bytes)
    try:
        yield layers
    finally:
        attnstash.uninstall_attention_stash(model)
        attnstash.stash_set_max_bytes(None)


def measured(model, padded, device="cpu", n=None, max_bytes=None, seq=24):
    """{layer: bytes} the stash holds after one training forward (all attention layers
    stashed, or the last n), and the number of declined keeps; the backward then releases."""
    ids, kwargs = ids_and_mask(padded, seq=seq, device=device)
    with installed(model, n, max_bytes):
        declined = attnstash.stash_stats()["declined"]
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        held = attnstash.layer_stash_stats(model)
        declined = attnstash.stash_stats()["declined"] - declined
        loss.backward()
    assert attnstash.stash_stats()["records"] == 0
    return {layer: h.bytes for layer, h in held.items()}, declined
