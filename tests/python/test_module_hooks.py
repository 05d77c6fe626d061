"""Module hooks on stashed layers whose checkpoint calls the module itself (the plain-PyTorch GPT,
layers=): full backward hooks and backward pre-hooks (which pass the layer input through a node
of their own, on what the recompute is handed), and forward pre-hooks, which may make the layer
a new input inside its checkpoint. Each trains bitwise like the run without the stash, with its
hooks called as often, or is refused with the reason."""
import copy

import pytest
import torch

import attnstash
from helpers import assert_bitwise_equal, counters
from tiny_torch_models import Block, gpt, ids, loss_and_grads

MODES = ("reentrant", "non-reentrant")


def hooked(mode, hook):
    """The GPT with `hook` registered on each block: (model, the list each hook call appends to)."""
    model = gpt(checkpointing=mode)
    calls = []
    for block in model.blocks:
        if hook == "full backward hook":
            block.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(module))
        elif hook == "backward pre-hook":
            block.register_full_backward_pre_hook(lambda module, grad_out: calls.append(module))
        else:  # a forward pre-hook that hands the layer a new tensor
            block.register_forward_pre_hook(lambda module, args: (calls.append(module), (args[0] * 1.0,) + args[1:])[1])
    return model, calls


@pytest.mark.parametrize("hook", ["full backward hook", "backward pre-hook"])
@pytest.mark.parametrize("mode", MODES)
def test_backward_hooks_on_stashed_layers_are_called_as_without_and_train_bitwise(mode, hook, installed):
    tokens = ids()
    base, base_calls = hooked(mode, hook)
    reference = loss_and_grads(base, tokens)
    model, model_calls = hooked(mode, hook)
    installed(model, layers=Block)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)
    assert counters() == (keeps + 3, replays + 3)  # the hook's node on the input hides nothing
    assert len(model_calls) == len(base_calls) == 3


def test_a_forward_pre_hook_that_makes_a_new_input_trains_bitwise_under_non_reentrant_checkpointing(installed):
    tokens = ids()
    base, _ = hooked("non-reentrant", "forward pre-hook")
    reference = loss_and_grads(copy.deepcopy(base), tokens)
    installed(base, layers=Block)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(base, tokens), reference)
    assert counters() == (keeps + 3, replays + 3)


def test_a_forward_pre_hook_that_makes_a_new_input_is_refused_under_reentrant_checkpointing(installed):
    # The hook runs inside the checkpoint: the first forward's input was made without grad (nothing
    # kept on it), the recompute's is another tensor. Refused at the recompute, with the reason.
    model, _ = hooked("reentrant", "forward pre-hook")
    installed(model, layers=Block)
    with pytest.raises(attnstash.CheckpointingError, match=r"layer 2 \(blocks.2, Block\): nothing is kept for its "
                                                          r"recompute's input, which has a grad_fn.*forward pre-hook"):
        loss_and_grads(model, ids())
    assert attnstash.stash_stats()["records"] == 0
