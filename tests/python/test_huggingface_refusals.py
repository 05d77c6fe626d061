"""install_attention_stash fails instead of falling back, with a clear error (naming the layer
where there is one) for every set-up in which a kept output could not be replayed or nothing
would be kept: a model without SDPA or without layers to stash, a bad num_layers, a second
install, a transformers outside the supported range or without what the install relies on,
training without checkpointing, an unsupported SDPA backend,
a recompute with nothing kept, a model switched to eager after the install, a recompute that
would not reproduce its random numbers (and one input through two different forwards, which
is no refusal here). Attention
dropout: test_huggingface_dropout.py."""
import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnstash
from attnstash.install import transformers_adapter
from tiny_models import batch, clone, nothing_installed, tiny_model

SUPPORTED_TEXT = "{0[0]}.{0[1]} to {1[0]}.{1[1]}".format(*transformers_adapter.SUPPORTED)

def test_a_model_without_sdpa_is_refused():
    model = tiny_model("llama", attn="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'.*sdpa"):
        attnstash.install_attention_stash(model, 1)


def test_a_model_without_layers_to_stash_is_refused_with_what_was_looked_for():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(attnstash.InstallError, match="found no layers to stash in Sequential: looked for transformers "
                                                     "GradientCheckpointingLayers.*diffusers.*checkpoint_wrapper.*"
                                                     "layers="):
        attnstash.install_attention_stash(model, 1)
    assert nothing_installed()


@pytest.mark.parametrize("bad", [True, 1.0, "2", 0, -1, 4])
def test_num_layers_must_be_an_int_between_1_and_the_layer_count(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="num_layers"):
        attnstash.install_attention_stash(model, bad)
    assert not any(hasattr(m, "_attnstash") for m in model.modules())


def test_a_second_install_on_a_stashed_layer_is_refused(installed):
    model = tiny_model("llama")
    installed(model, 2)
    with pytest.raises(ValueError, match="already has the stash"):
        attnstash.install_attention_stash(model, 3)
    assert attnstash.layer_stash_stats(model).keys() == {1, 2}


def test_a_transformers_without_the_layer_class_is_named(monkeypatch):
    import transformers.modeling_layers
    model = tiny_model("llama")
    monkeypatch.delattr(transformers.modeling_layers, "GradientCheckpointingLayer")
    with pytest.raises(attnstash.UnsupportedVersionError,
                       match=f"transformers {transformers.__version__} has no "
                             f"transformers.modeling_layers.GradientCheckpointingLayer.*{SUPPORTED_TEXT}"):
        attnstash.install_attention_stash(model, 1)


def versions_around_the_supported_range():
    (lo, hi) = transformers_adapter.SUPPORTED
    return [f"{lo[0]}.{lo[1] - 1}.2", f"{hi[0]}.{hi[1] + 1}.0", f"{hi[0] + 1}.0.0"]


@pytest.mark.parametrize("version", versions_around_the_supported_range())
def test_a_transformers_outside_the_supported_range_is_refused(version, monkeypatch, installed):
    model = tiny_model("llama")
    monkeypatch.setattr(transformers_adapter, "installed_version", lambda: version)
    with pytest.raises(attnstash.UnsupportedVersionError,
                       match=f"transformers {version} is not supported: .* {SUPPORTED_TEXT}.*"
                             "ATTNSTASH_ALLOW_UNTESTED_TRANSFORMERS=1"):
        attnstash.install_attention_stash(model, 1)
    assert nothing_installed()
    monkeypatch.setenv("ATTNSTASH_ALLOW_UNTESTED_TRANSFORMERS", "1")
    assert installed(model, 1) == [2]


def run_error(model, **kwargs):
    ids = batch()
    with pytest.raises(RuntimeError) as info:
        model(input_ids=ids, labels=ids, **kwargs).loss.backward()
    return str(info.value)


def test_training_without_checkpointing_fails(installed):
    model = tiny_model("llama")
    model.gradient_checkpointing_disable()
    installed(model, 1)
    msg = run_error(model)
    assert "layer 2 (model.layers.2, LlamaDecoderLayer)" in msg and "checkpointing is off for it" in msg
    assert "gradient_checkpointing is False" in msg and "gradient_checkpointing_enable()" in msg


def test_an_unsupported_sdpa_backend_is_named(installed):
    model = tiny_model("llama")
    installed(model, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        msg = run_error(model)
    assert "layer 2 (model.layers.2" in msg and "math backend" in msg


def test_a_recompute_with_nothing_kept_names_the_layer(installed):
    model = tiny_model("mistral")
    installed(model, 2)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    attnstash.stash_clear()
    with pytest.raises(attnstash.ReplayError,
                       match=r"layer 2 \(model.layers.2, MistralDecoderLayer\).*no attention output is kept"):
        loss.backward()


def test_a_model_switched_to_eager_after_install_fails_at_its_first_training_forward(installed):
    model = tiny_model("llama")
    installed(model, 2)
    model.set_attn_implementation("eager")
    msg = run_error(model)
    assert "layer 1 (model.layers.1" in msg and "called no F.scaled_dot_product_attention" in msg
    assert 'attn_implementation="sdpa"' in msg
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_one_input_through_two_different_forwards_trains_both(reentrant, installed):
    # Other position ids: the first layer's attention differs between the two forwards. Each
    # checkpoint call holds a token of its own (core.py, Anchor), so each recompute takes its
    # own forward's output: both backwards give the gradients of the run without the stash.
    # (Layers reached as module calls anchor on the input itself, and refuse this:
    # test_sdpa_ops_refusals.)
    base = tiny_model("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = batch()
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + 5

    def two_forwards(model):
        model.zero_grad(set_to_none=True)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        first = model(inputs_embeds=embeds, labels=ids).loss
        second = model(inputs_embeds=embeds, labels=ids, position_ids=positions).loss
        second.backward()
        first.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return (first.detach(), second.detach()), {"inputs_embeds": embeds.grad, **grads}

    (losses_a, grads_a) = two_forwards(clone(base))
    model = clone(base)
    installed(model)
    (losses_b, grads_b) = two_forwards(model)
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_a_recompute_that_would_not_reproduce_its_random_numbers_is_refused(mode, installed):
    # Dropout before the projections (LoRA dropout here) with preserve_rng_state=False: the
    # recompute's query, key and value would differ from the first forward's.
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5))
    model.train()
    kwargs = {"use_reentrant": mode == "reentrant", "preserve_rng_state": False}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "reentrant":
        model.enable_input_require_grads()
    installed(model)
    msg = run_error(model)
    assert "draws random numbers before its attention" in msg and "preserve_rng_state=True" in msg
    assert attnstash.stash_stats()["records"] == 0


def test_a_transformers_that_no_longer_calls_the_checkpoint_function_is_named(monkeypatch, installed):
    # As if a release checkpointed its layers another way: the stand-in sits under a name
    # transformers does not call. The error says what was not reached, with the release, and
    # does not claim that checkpointing is off.
    monkeypatch.setattr(transformers_adapter, "NAME", "_a_name_transformers_does_not_call")
    model = tiny_model("llama")
    installed(model, 1)
    msg = run_error(model)
    assert f"transformers {transformers.__version__}" in msg and "_gradient_checkpointing_func" in msg
    assert "ran with gradient_checkpointing on, but without calling its checkpoint function" in msg
    assert "off" not in msg
    assert attnstash.stash_stats()["records"] == 0
