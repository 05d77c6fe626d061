"""What ties a stashed layer's recompute to its first forward where its checkpoint calls the module
itself: the layer input, as a reentrant checkpoint hands it (a detached alias of the checkpoint's
own input) or a non-reentrant one (a token). Several layers in one checkpoint (Pairs), and an input
that does not require grad beside one that does: each trains bitwise where it can be tied, and
is refused at its recompute with the reason where it cannot."""
import gc

import pytest
import torch

import attnstash
from helpers import counters
from test_any_model import MODES, assert_the_stash_gives_the_normal_recompute
from tiny_torch_models import Block, Pairs, gpt, ids, loss_and_grads


def test_a_layer_whose_input_is_made_inside_its_reentrant_checkpoint_is_refused_with_the_reason(installed):
    # Its recompute gets a new input, which nothing ties to its first forward: a clear error at
    # the recompute (the first, of the last pair's second layer), not a miss.
    torch.manual_seed(0)
    model = Pairs("reentrant").train()
    installed(model, layers=list(model.gpt.blocks))
    with pytest.raises(attnstash.CheckpointingError, match=r"layer 3 \(gpt.blocks.3, Block\): nothing is kept for its "
                                                          "recompute's input, which has a grad_fn: it was made inside "
                                                          "its reentrant activation checkpoint") as raised:
        loss_and_grads(model, ids())
    # The inner layers kept nothing (their first forward's input needs no grad); the first
    # layers' records go with the graph, which the traceback holds: layer 2's was replayed, layer
    # 0's waits. Training goes on with the layers that can be tied, and releases it.
    assert attnstash.stash_stats()["records"] == 1
    del raised
    gc.collect()
    attnstash.uninstall_attention_stash(model)
    installed(model, filter_fn=lambda module, fqn: fqn in ("gpt.blocks.0", "gpt.blocks.2"))
    keeps, replays = counters()
    loss_and_grads(model, ids())
    assert counters() == (keeps + 2, replays + 2)


@pytest.mark.parametrize("mode", MODES)
def test_layers_checkpointed_together_train_bitwise_where_each_can_be_tied(mode, installed):
    # Reentrant: the first layer of each checkpoint, whose input is the checkpoint's; non-reentrant:
    # every layer (its recompute is tied by a token, whatever its input).
    torch.manual_seed(0)
    chosen = {"gpt.blocks.0", "gpt.blocks.2"} if mode == "reentrant" else {f"gpt.blocks.{i}" for i in range(4)}
    assert_the_stash_gives_the_normal_recompute(Pairs(mode).train(), installed, len(chosen),
                                                filter_fn=lambda module, fqn: fqn in chosen)


class BiasedBlock(Block):
    """A block that adds a second checkpointed input (a learned bias) to the first."""

    def forward(self, x, bias):
        return super().forward(x + bias)


class FrozenEmbedding(torch.nn.Module):
    """Its blocks' first input comes from a frozen embedding (requires no grad); their second, a
    learned bias, does."""

    def __init__(self, mode):
        super().__init__()
        self.gpt, self.mode = gpt(block_class=BiasedBlock, checkpointing=None), mode
        self.gpt.embed.weight.requires_grad_(False)
        self.bias = torch.nn.Parameter(torch.zeros(32))

    def forward(self, tokens, mask=None):
        x = self.gpt.embed(tokens)
        for block in self.gpt.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, self.bias * 1, use_reentrant=self.mode == "reentrant")
        return self.gpt.head(x)


def test_a_first_input_that_needs_no_grad_is_refused_under_reentrant_checkpointing_with_the_reason(installed):
    # Layer 0, whose input comes from the frozen embedding: its first forward, with grad off,
    # cannot be told from a no-grad forward, and keeps nothing. Layers 1 and 2 (inputs that
    # require grad) replay before it.
    torch.manual_seed(0)
    model = FrozenEmbedding("reentrant").train()
    installed(model, layers=BiasedBlock)
    with pytest.raises(attnstash.CheckpointingError, match=r"layer 0 \(gpt.blocks.0, BiasedBlock\): its input \(its "
                                                          "first tensor argument.*does not require grad"):
        loss_and_grads(model, ids())
    assert attnstash.stash_stats()["records"] == 0


def test_a_first_input_that_needs_no_grad_trains_bitwise_under_non_reentrant_checkpointing(installed):
    torch.manual_seed(0)
    assert_the_stash_gives_the_normal_recompute(FrozenEmbedding("non-reentrant").train(), installed, 3,
                                                layers=BiasedBlock)


def test_functional_call_with_other_parameters_is_wrong_with_and_without_the_stash(installed):
    # README, Limits: the recompute runs in the backward, after torch.func.functional_call has put
    # the model's own parameters back. torch's own gradient is then not the uncheckpointed one,
    # and the stash, which cannot see the parameters change, replays the first forward's
    # attention output into that recompute: wrong as well, and differently.
    tokens = ids()

    def grads(model):
        params = {n: p.detach().clone().mul_(1.01).requires_grad_() for n, p in model.named_parameters()}
        torch.manual_seed(7)
        out = torch.func.functional_call(model, params, (tokens,))
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten())
        return torch.autograd.grad(loss, list(params.values()))

    def differ(a, b):
        return any(not torch.equal(x, y) for x, y in zip(a, b))

    uncheckpointed = grads(gpt(checkpointing=None))
    checkpointed = grads(gpt(checkpointing="non-reentrant"))
    assert differ(checkpointed, uncheckpointed)
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    keeps, replays = counters()
    stashed = grads(model)
    assert counters() == (keeps + 3, replays + 3)
    assert differ(stashed, uncheckpointed) and differ(stashed, checkpointed)
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0
