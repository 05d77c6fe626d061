"""Tiny Hugging Face decoders built from configs (no downloads), for the tests."""
import copy
import dataclasses

import torch
import transformers

ARCHS = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")
VOCAB = 97


def tiny_config(arch, layers=3, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
                  tie_word_embeddings=False)
    config_class, extra = {
        "llama": (transformers.LlamaConfig, {}),
        "mistral": (transformers.MistralConfig, {"sliding_window": None}),
        "qwen2": (transformers.Qwen2Config, {}),
        "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                                    "moe_intermediate_size": 32, "head_dim": 16}),
    }[arch]
    return config_class(**{**common, **extra, **overrides})


def tiny_model(arch="llama", layers=3, seed=0, attn="sdpa", **overrides):
    """A model with random weights from `seed`, in train mode, with reentrant checkpointing."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, layers, **overrides),
                                                          attn_implementation=attn)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def checkpointing_field():
    """The TrainingArguments field that turns checkpointing on in the installed transformers
    (activation_checkpointing from 5.23, gradient_checkpointing before)."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def clone(model):
    return copy.deepcopy(model)


def batch(seed=1, batch_size=2, seq=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq), generator=g)


def loss_and_grads(model, ids, **kwargs):
    """One forward+backward; (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise_equal(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    different = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not different, f"gradients differ: {different}"


def assert_within_run_spread(normal, got):
    """For a backward that is not deterministic (cuDNN accumulates dQ in any order): `got`'s
    loss bitwise the first normal run's, and each gradient bitwise where the normal runs are,
    else no further from its nearest normal run than they are from each other. `normal`: (loss,
    [grad]) of several runs without the stash; `got`: one with it."""
    loss, grads = got
    assert torch.equal(loss, normal[0][0])
    for i, g in enumerate(grads):
        runs = [n[1][i] for n in normal]
        spread = max((a - b).abs().max().item() for j, a in enumerate(runs) for b in runs[j + 1:])
        nearest = min((g - r).abs().max().item() for r in runs)
        assert nearest <= spread, (i, nearest, spread)


def nothing_installed():
    """No stash is installed anywhere: F.scaled_dot_product_attention is torch's own and
    transformers' layer class carries no stand-in for the checkpoint function."""
    import torch.nn.functional as F
    from transformers.modeling_layers import GradientCheckpointingLayer
    return (F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
            and "_gradient_checkpointing_func" not in vars(GradientCheckpointingLayer))


def counters():
    """The stash's (keeps, replays) so far."""
    import attnstash
    s = attnstash.stash_stats()
    return s["keeps"], s["replays"]
