"""install_attention_stash and uninstall_attention_stash on tiny Hugging Face models: uninstall
restores the original behaviour, an install is all or nothing, num_layers takes what
operator.index takes, two models installed at once do not interfere, and a deep copy carries an
install of its own."""
import copy
import gc

import numpy as np
import pytest
import torch

import attnstash
from tiny_models import (assert_bitwise_equal, batch, checkpoint_wrapped, clone, counters, loss_and_grads,
                         nothing_installed, tiny_model)


def module_state(model):
    """What an install may touch on each module: its attributes and hooks."""
    return [(sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_uninstall_restores_the_original_behaviour():
    model = tiny_model("llama")
    before = module_state(model)
    attnstash.install_attention_stash(model, 3)
    assert not nothing_installed()
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    attnstash.uninstall_attention_stash(model)
    assert nothing_installed()
    assert module_state(model) == before
    model.gradient_checkpointing_disable()
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()  # would fail if anything were left
    assert attnstash.stash_stats()["records"] == 0
    with pytest.raises(ValueError, match="no attention stash installed"):
        attnstash.uninstall_attention_stash(model)


def test_two_models_installed_at_once_do_not_interfere(installed):
    base_a, base_b = tiny_model("llama", seed=0), tiny_model("qwen3_moe", seed=1)
    ids = batch()
    ref_a, ref_b = loss_and_grads(clone(base_a), ids), loss_and_grads(clone(base_b), ids)
    a, b = clone(base_a), clone(base_b)
    installed(a, 3)
    installed(b, 1)
    loss_a = a(input_ids=ids, labels=ids).loss
    loss_b = b(input_ids=ids, labels=ids).loss
    assert attnstash.layer_stash_stats(a).keys() == {0, 1, 2} and attnstash.layer_stash_stats(b).keys() == {2}
    loss_a.backward()
    assert attnstash.layer_stash_stats(b)[2][0] == 1  # a's backward left b's output alone
    loss_b.backward()
    assert_bitwise_equal((loss_a.detach(), {n: p.grad for n, p in a.named_parameters()}), ref_a)
    assert_bitwise_equal((loss_b.detach(), {n: p.grad for n, p in b.named_parameters()}), ref_b)
    attnstash.uninstall_attention_stash(a)
    keeps = attnstash.stash_stats()["keeps"]
    b.zero_grad()
    assert_bitwise_equal(loss_and_grads(b, ids), ref_b)
    assert attnstash.stash_stats()["keeps"] == keeps + 1  # b still stashes its last layer

def test_install_is_all_or_nothing(monkeypatch):
    # A failure part-way (here: the third layer's forward cannot be wrapped) leaves no
    # attribute, wrapper or patch behind, and a later install works.
    from attnstash.install import attaching
    model = tiny_model("llama")
    before = module_state(model)
    attach = attaching.attach

    def refuse_the_third(layer, *args):
        if layer is model.model.layers[2]:
            raise RuntimeError("refused")
        return attach(layer, *args)

    monkeypatch.setattr(attaching, "attach", refuse_the_third)
    with pytest.raises(RuntimeError, match="refused"):
        attnstash.install_attention_stash(model, max_bytes=100)
    monkeypatch.undo()
    assert module_state(model) == before and nothing_installed()
    assert attnstash.stash_max_bytes() is None
    assert attnstash.install_attention_stash(model) == [0, 1, 2]
    attnstash.uninstall_attention_stash(model)


@pytest.mark.parametrize("num_layers", [np.int64(2), torch.tensor(2), 2])
def test_num_layers_takes_what_operator_index_takes(num_layers, installed):
    assert installed(tiny_model("llama"), num_layers) == [1, 2]


def test_a_deep_copy_carries_an_install_of_its_own(installed):
    base = tiny_model("llama")
    ids = batch()
    reference = loss_and_grads(clone(base), ids)
    model = clone(base)
    installed(model, 2)
    twin = copy.deepcopy(model)
    assert attnstash.layer_stash_stats(twin).keys() == {1, 2}
    with pytest.raises(ValueError, match="already has the stash"):
        attnstash.install_attention_stash(twin, 1)
    # Each trains with its own records: the copy's forward is held while the original trains.
    loss_twin = twin(input_ids=ids, labels=ids).loss
    assert attnstash.layer_stash_stats(twin) != attnstash.layer_stash_stats(model)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, ids), reference)
    assert counters() == (keeps + 2, replays + 2)
    assert attnstash.layer_stash_stats(twin)[2][0] == 1  # the original's backward left the copy's record
    loss_twin.backward()
    assert torch.equal(loss_twin.detach(), reference[0])
    attnstash.uninstall_attention_stash(twin)
    assert not any(hasattr(m, "_attnstash") for m in twin.modules())
    assert attnstash.install_attention_stash(twin, 1) == [2]  # once uninstalled, it can be installed
    attnstash.uninstall_attention_stash(twin)
    assert attnstash.layer_stash_stats(model).keys() == {1, 2}  # the original keeps its install


def test_layers_left_out_by_every_n_layers_are_not_stashed(installed):
    # Releases whose checkpointing takes every_n_layers checkpoint only some layers; the
    # install (num_layers=None) stashes those and leaves the others to run as they are.
    import inspect
    model = tiny_model("llama", layers=4)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers checkpoints every layer (no every_n_layers)")
    model.activation_checkpointing_disable()
    enable({"use_reentrant": True}, every_n_layers=2)
    checkpointed = [i for i, layer in enumerate(model.model.layers) if layer.gradient_checkpointing]
    assert 0 < len(checkpointed) < 4
    ids = batch()
    ref = loss_and_grads(clone(model), ids)
    assert installed(model) == checkpointed
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, ids), ref)
    assert counters() == (keeps + len(checkpointed), replays + len(checkpointed))
    assert attnstash.stash_stats()["records"] == 0


def test_attention_layers_print_one_line_each_and_still_unpack(installed):
    model = tiny_model("llama")
    found = attnstash.attention_layers(model)
    assert [(i, name) for i, name, _ in found] == [(0, "model.layers.0"), (1, "model.layers.1"), (2, "model.layers.2")]
    assert found[2].module is model.model.layers[2] and found[2].index == 2
    assert repr(found).splitlines() == ["  0  model.layers.0  LlamaDecoderLayer", "  1  model.layers.1  LlamaDecoderLayer",
                                        "  2  model.layers.2  LlamaDecoderLayer"]
    installed(model, 1)
    assert repr(attnstash.attention_layers(model)[2]) == "  2  model.layers.2  LlamaDecoderLayer  stashed"
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert str(attnstash.attention_layers(model)).splitlines()[1:] == [
        "  1  model.layers.1  LlamaDecoderLayer", "  2  model.layers.2  LlamaDecoderLayer  stashed, 1 attention call "
                                                  "per forward"]


LOAD_AND_TRAIN = """
import json, sys, torch, attnstash
from helpers import counters, nothing_installed
from tiny_models import batch, loss_and_grads
assert nothing_installed()
model = torch.load(sys.argv[1], weights_only=False)
layers = [index for index, _, _ in attnstash.attention_layers(model) if "_attnstash" in _.__dict__]
keeps, replays = counters()
loss, grads = loss_and_grads(model, batch())
reference_loss, reference_grads = torch.load(sys.argv[2])
bitwise = torch.equal(loss, reference_loss) and grads.keys() == reference_grads.keys() and \\
    all(torch.equal(grads[n], reference_grads[n]) for n in grads)
calls = [counters()[0] - keeps, counters()[1] - replays]
attnstash.uninstall_attention_stash(model)
print(json.dumps({"layers": layers, "bitwise": bitwise, "calls": calls, "records": attnstash.stash_stats()["records"],
                  "unpatched": nothing_installed()}))
"""


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_a_stashed_model_saved_whole_loads_stashed_in_a_new_process(mode, installed, tmp_path):
    # torch.save(model), then torch.load in a process that never installed: the layers reach the
    # stash there too (transformers' layer class is patched as the model loads), train bitwise,
    # and uninstall to nothing installed.
    import json
    import pathlib
    import subprocess
    import sys
    def without_input_hook(model):  # transformers' hook is a local function, which pickle cannot save
        if hasattr(model, "_require_grads_hook"):
            model.disable_input_require_grads()
        return model

    base = without_input_hook(tiny_model("llama"))
    if mode == "non-reentrant":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        without_input_hook(base)
    ids = batch()
    torch.save(loss_and_grads(clone(base), ids), tmp_path / "reference.pt")
    model = clone(base)
    installed(model, 2)
    torch.save(model, tmp_path / "model.pt")
    here = pathlib.Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", LOAD_AND_TRAIN, str(tmp_path / "model.pt"),
                           str(tmp_path / "reference.pt")], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(here)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"layers": [1, 2], "bitwise": True, "calls": [2, 2], "records": 0, "unpatched": True}


@pytest.mark.parametrize("when", ["installed before the backward", "uninstalled before the backward"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_an_install_or_uninstall_between_a_forward_and_its_backward_trains_bitwise(mode, when, installed):
    # A transformers layer's recompute runs what its checkpoint was handed: the layer's own
    # forward for a forward that ran before the install (nothing kept, nothing replayed), the
    # stash's Run, which the checkpoint holds, for one that ran before the uninstall (replayed).
    # (Layers whose checkpoint calls the module: test_install_mid_step.)
    base = tiny_model("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    model, ids = clone(base), batch()
    reference = loss_and_grads(base, ids)
    if when.startswith("uninstalled"):
        installed(model)
    keeps, replays = counters()
    loss = model(input_ids=ids, labels=ids).loss
    if when.startswith("installed"):
        installed(model)
    else:
        attnstash.uninstall_attention_stash(model)
    loss.backward()
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_bitwise_equal(got, reference)
    assert counters() == ((keeps, replays) if when.startswith("installed") else (keeps + 3, replays + 3))
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_an_uninstall_between_a_forward_and_its_backward_of_layers_that_checkpoint_wrapper_wraps(mode, installed):
    # transformers layers wrapped by torch's checkpoint_wrapper (FSDP's activation checkpointing),
    # their own checkpointing off: the checkpoint calls the layer module, as in
    # test_install_mid_step: refused under non-reentrant checkpointing until the backward has run.
    base = checkpoint_wrapped(tiny_model("llama"), mode == "reentrant")
    model, ids = clone(base), batch()
    reference = loss_and_grads(base, ids)
    installed(model)
    keeps, replays = counters()
    loss = model(input_ids=ids, labels=ids).loss
    if mode == "non-reentrant":
        with pytest.raises(attnstash.InstallError, match=r"ran 3 first forward\(s\) in a non-reentrant checkpoint"):
            attnstash.uninstall_attention_stash(model)
        loss.backward()
        assert counters() == (keeps + 3, replays + 3)
        attnstash.uninstall_attention_stash(model)
    else:
        attnstash.uninstall_attention_stash(model)
        loss.backward()  # its recompute runs attention
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert_bitwise_equal(got, reference)
    del loss
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0 and not attnstash.layer_stash_stats(model)
