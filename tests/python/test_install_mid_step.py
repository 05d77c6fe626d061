"""Installing or uninstalling between a forward and its backward, on layers whose checkpoint calls
the module (the plain-PyTorch GPT, its own checkpoint calls or torch's checkpoint_wrapper): a
forward that ran before the install recomputes as without the stash; an uninstall while a
non-reentrant forward awaits its recompute is refused, changing nothing, until that forward's
backward has run or its graph is dropped (attnstash/install/installer.py, _awaiting_a_replay); a
reentrant one is uninstalled and its backward trains as installed. Each run is bitwise the run
without the stash and ends with nothing held. (Transformers layers: test_huggingface_install.)"""
import copy
import gc

import pytest
import torch
import torch.nn.functional as F

import attnstash
from helpers import assert_bitwise_equal, counters
from tiny_torch_models import Block, gpt, ids, loss_and_grads, wrapped

MODES = ("reentrant", "non-reentrant")
HOW = ("own checkpoint", "checkpoint_wrapper")


def model_for(mode, how):
    model = gpt(checkpointing=mode)
    return wrapped(model, mode) if how == "checkpoint_wrapper" else model


def forward(model, tokens, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def grads(model, loss):
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_ran_before_the_install_recomputes_as_without_and_the_next_step_stashes(mode, how, installed):
    base = model_for(mode, how)
    model = copy.deepcopy(base)
    tokens = ids()
    reference = loss_and_grads(base, tokens)
    loss = forward(model, tokens)
    installed(model, layers=Block)
    keeps, replays = counters()
    loss.backward()
    assert_bitwise_equal(grads(model, loss), reference)
    assert counters() == (keeps, replays)  # nothing was kept for it, nothing replayed
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)
    assert counters() == (keeps + 3, replays + 3)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("how", HOW)
def test_a_reentrant_forward_is_uninstalled_before_its_backward_and_trains_as_installed(how, installed):
    base = model_for("reentrant", how)
    model = copy.deepcopy(base)
    tokens = ids()
    reference = loss_and_grads(base, tokens)
    installed(model, layers=Block)
    loss = forward(model, tokens)
    assert attnstash.stash_stats()["records"] == 3
    attnstash.uninstall_attention_stash(model)
    assert not attnstash.layer_stash_stats(model)
    loss.backward()  # its recompute runs attention: a reentrant recompute saves nothing of its first forward's
    assert_bitwise_equal(grads(model, loss), reference)
    del loss
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0  # released with their anchors


@pytest.mark.parametrize("how", HOW)
def test_an_uninstall_while_a_non_reentrant_forward_awaits_its_backward_is_refused_and_changes_nothing(how,
                                                                                                    installed):
    base = model_for("non-reentrant", how)
    model = copy.deepcopy(base)
    tokens = ids()
    reference = loss_and_grads(base, tokens)
    installed(model, layers=Block)
    keeps, replays = counters()
    loss = forward(model, tokens)
    with pytest.raises(attnstash.InstallError, match=r"cannot uninstall the stash of GPT yet: layer 0 \(blocks\.0.*"
                                                     r"layer 2 .* ran 3 first forward\(s\) in a non-reentrant "
                                                     r"checkpoint.*Nothing was uninstalled"):
        attnstash.uninstall_attention_stash(model)
    assert sorted(attnstash.layer_stash_stats(model)) == [0, 1, 2]
    loss.backward()
    assert_bitwise_equal(grads(model, loss), reference)
    assert counters() == (keeps + 3, replays + 3)
    attnstash.uninstall_attention_stash(model)  # its backward has run
    assert not attnstash.layer_stash_stats(model) and attnstash.stash_stats()["records"] == 0


def test_an_uninstall_is_refused_while_a_retained_graph_lives_and_goes_through_once_it_is_dropped(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    loss = forward(model, ids())
    loss.backward(retain_graph=True)
    with pytest.raises(attnstash.InstallError, match=r"ran with retain_graph=True"):
        attnstash.uninstall_attention_stash(model)
    del loss
    attnstash.uninstall_attention_stash(model)
    assert not attnstash.layer_stash_stats(model) and attnstash.stash_stats()["records"] == 0


def test_an_uninstall_refused_for_one_model_leaves_another_model_s_forward_alone(installed):
    # Only the model being uninstalled is looked at: another model's forward in flight, of the
    # same block class, does not hold up its uninstall.
    first, second = gpt(checkpointing="non-reentrant"), gpt(seed=1, checkpointing="non-reentrant")
    installed(first, layers=Block)
    installed(second, layers=Block)
    loss = forward(second, ids())
    attnstash.uninstall_attention_stash(first)
    with pytest.raises(attnstash.InstallError, match="cannot uninstall the stash of GPT yet"):
        attnstash.uninstall_attention_stash(second)
    loss.backward()
    attnstash.uninstall_attention_stash(second)
    assert attnstash.stash_stats()["records"] == 0


def test_an_uninstall_that_releases_goes_through_and_a_backward_through_the_forward_then_fails(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    loss = forward(model, ids())
    attnstash.uninstall_attention_stash(model, release=True)
    assert not attnstash.layer_stash_stats(model) and attnstash.stash_stats()["records"] == 0
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_before_the_install_is_refused_at_its_recompute_once_a_later_forward_of_its_layer_kept(mode,
                                                                                                      installed):
    # Under saved-tensor hooks the one pending first forward of a layer would be taken for any
    # recompute handed a copy of the input; one handed neither that forward's input, which is
    # still alive, nor its equal repeats a forward that kept nothing, and is refused rather than
    # handed another forward's attention (module_call._may_be_a_copy).
    model = gpt(checkpointing=mode)
    with torch.autograd.graph.save_on_cpu():  # (on a CPU, it hands back the tensors themselves)
        before = forward(model, ids(1))
        installed(model, layers=Block)
        after = forward(model, ids(2))
    with pytest.raises(attnstash.ReplayError, match=r"layer 2 .*a forward that kept nothing \(one that ran before "
                                                    r"the stash was installed on this layer"):
        before.backward()
    del before, after
    attnstash.uninstall_attention_stash(model, release=True)  # (save_on_cpu keeps the CPU graphs alive: PyTorch's)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_copies_of_layer_inputs_the_user_still_holds_are_replayed_as_copies(mode, installed):
    # Hooks that copy what they save, and each block's input held by the user: the recompute is
    # handed a copy equal to its first forward's input, which is alive at another address.
    def held_inputs(model):
        inputs = []
        for block in model.blocks:
            block.register_forward_pre_hook(lambda module, args: inputs.append(args[0]) and None)
        return inputs

    def copying():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)

    base = gpt(checkpointing=mode)
    model = copy.deepcopy(base)
    base_inputs, model_inputs = held_inputs(base), held_inputs(model)
    tokens = ids()
    with copying():
        loss = forward(base, tokens)
    loss.backward()
    reference = grads(base, loss)
    installed(model, layers=Block)
    keeps, replays = counters()
    with copying():
        loss = forward(model, tokens)
    loss.backward()
    assert_bitwise_equal(grads(model, loss), reference)
    assert counters() == (keeps + 3, replays + 3)
    assert len(model_inputs) >= 3 and len(base_inputs) == len(model_inputs)
    del loss, model_inputs
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0
