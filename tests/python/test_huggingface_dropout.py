"""Attention dropout: a kept output cannot stand in for a recompute that draws a new dropout
mask, so a model whose config gives its stashed layers attention dropout is refused at install,
whatever the family calls the field, naming the layer, the field, its value and the fix; a
dropout that no config shows (set on the modules after the model was built) is refused at the
first training step, naming the module's attribute. Nothing is installed or kept after either."""
import pytest
import torch
import transformers

import attnstash
from tiny_models import VOCAB, batch, nothing_installed, tiny_model

SMALL = dict(vocab_size=VOCAB, num_attention_heads=4)


def bert(**overrides):
    config = transformers.BertConfig(**SMALL, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                                     hidden_dropout_prob=0.0, **overrides)
    return transformers.AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")


def gpt2(**overrides):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_head=4, n_embd=64, n_layer=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def qwen2(**overrides):
    return tiny_model("qwen2", **overrides)


FAMILIES = [  # (build, field, the first layer's name and class)
    (bert, "attention_probs_dropout_prob", "layer 0 (bert.encoder.layer.0, BertLayer)", "BertForMaskedLM"),
    (gpt2, "attn_pdrop", "layer 0 (transformer.h.0, GPT2Block)", "GPT2LMHeadModel"),
    (qwen2, "attention_dropout", "layer 0 (model.layers.0, Qwen2DecoderLayer)", "Qwen2ForCausalLM"),
]


def enable(model):
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


@pytest.mark.parametrize("build,field,layer,model_class", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_a_config_with_attention_dropout_is_refused_at_install_naming_the_field(build, field, layer, model_class,
                                                                                installed):
    model = enable(build(**{field: 0.1}))
    with pytest.raises(attnstash.InstallError) as caught:
        installed(model)
    msg = str(caught.value)
    assert layer in msg and f"has {field}=0.1" in msg, msg
    assert f"{model_class}.from_pretrained(..., {field}=0.0)" in msg, msg
    assert "more of the layers to stash" in msg  # every layer of these models has it
    assert nothing_installed() and not any(hasattr(m, "_attnstash") for m in model.modules())


@pytest.mark.parametrize("build,field,layer,model_class", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_the_same_model_with_the_field_at_zero_installs(build, field, layer, model_class):
    model = enable(build(**{field: 0.0}))
    try:
        assert attnstash.install_attention_stash(model, 1) == [len(attnstash.attention_layers(model)) - 1]
    finally:
        attnstash.uninstall_attention_stash(model)


def test_only_the_layers_to_stash_are_read(installed):
    # num_layers=1: the last layer's config is the model's, so the refusal names that layer alone.
    model = qwen2(attention_dropout=0.25)
    with pytest.raises(attnstash.InstallError, match=r"layer 2 \(model.layers.2, Qwen2DecoderLayer\) would train "
                                                     r"with attention dropout: the model's config has "
                                                     r"attention_dropout=0.25"):
        installed(model, 1)
    assert nothing_installed()


def test_a_dropout_set_on_the_modules_after_the_build_is_refused_at_the_first_step_naming_the_attribute(installed):
    model = qwen2()
    installed(model, 1)
    for module in model.modules():
        if type(module).__name__ == "Qwen2Attention":
            module.attention_dropout = 0.1  # the config says 0.0: only the first step can see it
    ids = batch()
    with pytest.raises(attnstash.KeepError) as caught:
        model(input_ids=ids, labels=ids).loss.backward()
    msg = str(caught.value)
    assert "layer 2 (model.layers.2" in msg and "dropout_p=0.1" in msg, msg
    assert "It comes from Qwen2Attention.attention_dropout = 0.1" in msg, msg
    assert attnstash.stash_stats()["records"] == 0


def test_a_sub_config_s_dropout_names_its_path(installed):
    # A composite config (a VLM's text_config): the fix sets it on that sub-config.
    from attnstash.install import transformers_adapter

    class Outer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.config = transformers.PretrainedConfig(text_config=inner.config)
            self.config.text_config = inner.config
            self.language_model = inner

    inner = qwen2(attention_dropout=0.5)
    outer = Outer(inner)
    layer = inner.model.layers[2]
    assert transformers_adapter.attention_dropout(outer, layer, "language_model.model.layers.2") == (
        "text_config", "attention_dropout", 0.5)
    with pytest.raises(attnstash.InstallError, match=r"config.text_config.attention_dropout = 0.0; "
                                                     r"Outer.from_pretrained\(..., config=config\)"):
        installed(outer, 1)
    assert nothing_installed()
