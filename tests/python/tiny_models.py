"""Tiny Hugging Face decoders built from configs (no downloads), for the tests. The generic
helpers that need only torch live in helpers.py (the op-level tests import them from there) and
are re-exported here."""
import dataclasses

import torch
import transformers

from helpers import (assert_bitwise_equal, assert_within_run_spread, clone, counters,  # noqa: F401
                     nothing_installed)

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


def checkpoint_wrapped(model, reentrant):
    """`model` with each decoder layer wrapped by torch's checkpoint_wrapper, as FSDP's activation
    checkpointing (accelerate's fsdp_config) wraps them: the layers' own gradient_checkpointing
    off (and the Trainer's, in a Trainer run)."""
    import functools
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                              apply_activation_checkpointing,
                                                                              checkpoint_wrapper)
    from transformers.modeling_layers import GradientCheckpointingLayer
    model.gradient_checkpointing_disable()
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                   checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, GradientCheckpointingLayer))
    return model


def checkpointing_field():
    """The TrainingArguments field that turns checkpointing on in the installed transformers
    (activation_checkpointing from 5.23, gradient_checkpointing before)."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def batch(seed=1, batch_size=2, seq=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq), generator=g)


def loss_and_grads(model, ids, **kwargs):
    """One forward+backward; (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
