"""The installer on every diffusers model class that checkpoints its blocks (tiny_diffusers, the
diffusers sweep in tests/python/sweep_diffusers.py): found by itself, loss and every gradient
bitwise the normal recompute's under both checkpointing modes, one keep per attention call a
backward reaches and one replay per call its recompute makes, nothing held after; and the
refusals. About a minute on 2 cores."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("diffusers")

import attnstash  # noqa: E402
import sweep_diffusers  # noqa: E402
import tiny_diffusers as tiny  # noqa: E402
from tiny_models import assert_bitwise_equal  # noqa: E402

# Classes whose outcome is not "supported": a prefix of it and a text its message contains.
NOT_SUPPORTED = {
    # Their reentrant checkpointing fails without the stash too: backward through a graph twice
    # (a tensor computed once outside the blocks and reused by each), or keyword arguments.
    **{name: ("supported (non-reentrant; the model cannot train under reentrant checkpointing", why)
       for name, why in [("ErnieImageTransformer2DModel", "backward through the graph a second time"),
                         ("Kandinsky6Transformer3DModel", "backward through the graph a second time"),
                         ("MochiTransformer3DModel", "backward through the graph a second time"),
                         ("HunyuanImageTransformer2DModel", "Unexpected keyword arguments"),
                         ("WanAnimate2Transformer3DModel", "Unexpected keyword arguments")]},
    # Its attention mask is computed from parameters: the kept path gives masks no gradient.
    "RFD4ProteinaTransformer": ("refused at run", "the attn_mask requires grad"),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(tiny.CASES))
def test_every_diffusers_model_class(name):
    row = sweep_diffusers.check(name)
    expected, words = NOT_SUPPORTED.get(name, ("supported", None))
    assert row["outcome"] == expected or (words and row["outcome"].startswith(expected) and words in row["outcome"]), \
        row
    for mode, combo in row["combos"].items():
        if combo["status"] == "bitwise":
            assert combo["keeps"] == combo["expected"][0] > 0 and combo["replays"] == combo["expected"][1], (mode, combo)
            assert combo["held"] == 0


def test_the_sweep_fails_a_class_whose_checkpointed_block_the_installer_misses(monkeypatch):
    # Its recompute would run attention again unseen. Here the reader is made to miss one
    # collection of Flux's checkpointed blocks.
    from attnstash.install import diffusers_adapter
    read = diffusers_adapter.checkpointed_paths
    monkeypatch.setattr(diffusers_adapter, "checkpointed_paths",
                        lambda cls: frozenset(p for p in read(cls) if "single_transformer_blocks" not in p))
    with pytest.warns(attnstash.StashWarning, match="its block single_transformer_blocks.0"):  # (as a user is told)
        row = sweep_diffusers.check("FluxTransformer2DModel")
    assert row["outcome"].startswith("FAILED: the backward recomputes 1 attention calls outside the blocks"), row
    assert row["missed"] == {"single_transformer_blocks.0": 1}, row


def test_blocks_are_found_in_model_order_and_num_layers_counts_from_the_last():
    model, inputs = tiny.build("FluxTransformer2DModel")
    model.enable_gradient_checkpointing()
    names = [name for _, name, _ in attnstash.attention_layers(model)]
    assert names == ["transformer_blocks.0", "single_transformer_blocks.0"]
    reference = tiny.loss_and_grads(copy.deepcopy(model), inputs)
    assert attnstash.install_attention_stash(model, 1) == [1]
    try:
        keeps = attnstash.stash_stats()["keeps"]
        assert_bitwise_equal(tiny.loss_and_grads(model, inputs), reference)
        assert attnstash.stash_stats()["keeps"] == keeps + 1
    finally:
        attnstash.uninstall_attention_stash(model)


def test_resnet_blocks_a_unet_checkpoints_are_found_but_not_counted():
    model, _ = tiny.build("UNet2DConditionModel")
    found = attnstash.install.find_layers(model)
    kinds = {(type(f.module).__name__, f.stashable) for f in found}
    assert kinds == {("ResnetBlock2D", False), ("BasicTransformerBlock", True)}


@pytest.mark.parametrize("order", ["enable, then install", "install, then enable"])
def test_checkpointing_enabled_before_or_after_the_install(order):
    model, inputs = tiny.build("WanTransformer3DModel")
    base = copy.deepcopy(model)
    base.enable_gradient_checkpointing()
    reference = tiny.loss_and_grads(base, inputs)
    if order == "enable, then install":
        model.enable_gradient_checkpointing()
    attnstash.install_attention_stash(model)
    try:
        if order == "install, then enable":
            model.enable_gradient_checkpointing()
        keeps = attnstash.stash_stats()["keeps"]
        assert_bitwise_equal(tiny.loss_and_grads(model, inputs), reference)
        assert attnstash.stash_stats()["keeps"] == keeps + 4
    finally:
        attnstash.uninstall_attention_stash(model)


def test_a_diffusers_model_without_checkpointing_is_refused_at_its_first_training_forward():
    model, inputs = tiny.build("FluxTransformer2DModel")
    attnstash.install_attention_stash(model)
    try:
        with pytest.raises(attnstash.CheckpointingError, match=r"layer 0 \(transformer_blocks.0, "
                                                              r"FluxTransformerBlock\).*outside any activation"):
            tiny.loss_and_grads(model, inputs)
        with torch.no_grad():  # inference: untouched
            model(**inputs)
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0


def test_another_attention_backend_is_refused_at_its_first_training_forward():
    from diffusers.models.attention_dispatch import attention_backend
    model, inputs = tiny.build("WanTransformer3DModel")
    model.enable_gradient_checkpointing()
    attnstash.install_attention_stash(model)
    try:
        with attention_backend("_native_math"):  # sdpa_kernel(MATH) inside: a backend the stash cannot keep
            with pytest.raises(attnstash.KeepError, match="math backend"):
                tiny.loss_and_grads(model, inputs)
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0


def _hooked(model):
    return sorted(name for name, m in model.named_modules() if m._forward_pre_hooks)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_checkpointed_block_the_reading_misses_is_said_at_its_recompute(monkeypatch, reentrant):
    # The reader made to miss Flux's single blocks: what runs (the block's recompute) tells, once.
    from attnstash.install import diffusers_adapter
    read = diffusers_adapter.checkpointed_paths
    monkeypatch.setattr(diffusers_adapter, "checkpointed_paths",
                        lambda cls: frozenset(p for p in read(cls) if "single_transformer_blocks" not in p))
    model, inputs = tiny.build("FluxTransformer2DModel")
    model.enable_gradient_checkpointing(tiny.checkpoint_function(reentrant))
    assert attnstash.install_attention_stash(model) == [0]
    try:
        assert _hooked(model) == ["single_transformer_blocks.0"]
        with pytest.warns(attnstash.StashWarning) as said:
            tiny.loss_and_grads(model, inputs)
        assert len(said) == 1, [str(w.message) for w in said]
        assert ("FluxTransformer2DModel checkpoints its block single_transformer_blocks.0 "
                "(FluxSingleTransformerBlock), which has attention") in str(said[0].message)
        assert "filter_fn=" in str(said[0].message)
        assert _hooked(model) == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tiny.loss_and_grads(model, inputs)
    finally:
        attnstash.uninstall_attention_stash(model)


@pytest.mark.parametrize("name, unread", [
    ("Lumina2Transformer2DModel", ["context_refiner.0", "noise_refiner.0"]),
    ("WanAnimateTransformer3DModel", ["face_adapter.0"]),
])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_blocks_a_model_runs_outside_its_checkpoints_are_watched_until_a_training_forward(name, unread, reentrant):
    # Listed by the model's structure but not checkpointed, as the reading has it: no warning, the
    # watch gone after one step; a copy is not watched, an uninstall removes what is left.
    model, inputs = tiny.build(name)
    model.enable_gradient_checkpointing(tiny.checkpoint_function(reentrant))
    attnstash.install_attention_stash(model)
    try:
        assert _hooked(model) == unread
        copied = copy.deepcopy(model)
        with torch.no_grad():
            model(**inputs)
        assert _hooked(model) == unread  # (a forward without grad tells nothing)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tiny.loss_and_grads(model, inputs)
            tiny.loss_and_grads(copied, inputs)
        assert _hooked(model) == [] and _hooked(copied) == []
    finally:
        attnstash.uninstall_attention_stash(model)
        attnstash.uninstall_attention_stash(copied)
    attnstash.install_attention_stash(model)
    assert _hooked(model) == unread
    attnstash.uninstall_attention_stash(model)
    assert _hooked(model) == []
