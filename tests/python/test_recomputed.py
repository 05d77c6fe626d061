"""stash_stats()["recomputed"] (torch_ops/frames.h, recomputed): the attention calls a backward
runs again that the stash does not serve. It counts every such call of torch's own kernel,
whatever the checkpointing mode, where no stash is installed and in the layers an install left
out; not a stashed layer's replay, not the recompute of a keep the budget declined (counted as
declined), and not a call outside a backward (no_grad, eval, a model that does not checkpoint)."""
import gc

import pytest
import torch

import attnstash
from helpers import counters
from test_any_model import MODES
from tiny_torch_models import Block, gpt, ids, loss_and_grads


def recomputed():
    return attnstash.stash_stats()["recomputed"]


@pytest.mark.parametrize("mode", MODES)
def test_every_recompute_counts_where_nothing_is_stashed(mode):
    model = gpt(checkpointing=mode, calls=2)  # two attention calls per block
    before = recomputed()
    loss_and_grads(model, ids())
    assert recomputed() == before + 3 * 2


@pytest.mark.parametrize("mode", MODES)
def test_the_layers_an_install_leaves_out_count_and_the_stashed_ones_do_not(mode, installed):
    model = gpt(checkpointing=mode)
    installed(model, 1, layers=Block)
    before, (keeps, replays) = recomputed(), counters()
    loss_and_grads(model, ids())
    assert counters() == (keeps + 1, replays + 1)
    assert recomputed() == before + 2


@pytest.mark.parametrize("mode", MODES)
def test_a_declined_keep_counts_as_declined_not_as_recomputed(mode, installed):
    model = gpt(checkpointing=mode)
    installed(model, layers=Block, max_bytes=0)
    before, declined = recomputed(), attnstash.stash_stats()["declined"]
    loss_and_grads(model, ids())
    assert attnstash.stash_stats()["declined"] == declined + 3
    assert recomputed() == before


def test_calls_outside_a_backward_do_not_count():
    checkpointed, plain = gpt(checkpointing="non-reentrant"), gpt(checkpointing=None)
    before = recomputed()
    with torch.no_grad():
        checkpointed(ids())
    with torch.inference_mode():
        checkpointed(ids())
    loss_and_grads(plain, ids())  # a model that does not checkpoint: its backward runs no forward
    gc.collect()
    assert recomputed() == before
