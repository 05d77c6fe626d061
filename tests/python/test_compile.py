"""torch.compile: a custom model whose attention calls attnstash::sdpa_fwd_keep, compiled
with fullgraph=True and checkpointed with reentrant checkpointing, trains with the same
loss and gradients as eager, with and without the stash, and leaves the stash empty.

Where compile and checkpointing meet: the compiled function is the checkpointed block
(no graph breaks inside it; dynamo compiles one graph for the first forward, grad off,
and one for the recompute, grad on). Compiling around the checkpoint call instead makes
dynamo trace the checkpoint itself into its own recomputation, where nothing can be kept:
that fails with a clear error."""
import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import attnstash
from test_sdpa_ops import Block


def train(use_stash, backend, steps=3):
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(64, 8, 2, 64, torch.float32, True, use_stash, slot=i) for i in range(2))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    run = [torch.compile(b, fullgraph=True, backend=backend) if backend else b for b in blocks]
    losses, grads = [], []
    for step in range(steps):
        x = torch.randn(2, 40, 64, requires_grad=True, generator=torch.Generator().manual_seed(step))
        h = x
        for block in run:
            h = checkpoint(block, h, use_reentrant=True)
        loss = h.square().mean()
        loss.backward()
        assert attnstash.stash_stats()["entries"] == 0
        losses.append(loss.detach())
        grads.append([x.grad] + [p.grad.clone() for p in blocks.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("use_stash", [False, True], ids=["plain", "stash"])
def test_compiled_checkpointed_blocks_train_like_eager(backend, use_stash):
    eager_losses, eager_grads = train(use_stash, None)
    before = attnstash.stash_stats()
    losses, grads = train(use_stash, backend)
    after = attnstash.stash_stats()
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    for got, want in zip(grads, eager_grads):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    if use_stash:  # 2 blocks x 3 steps, each kept once and replayed once
        assert after["keeps"] - before["keeps"] == 6 and after["replays"] - before["replays"] == 6


def test_compiling_around_the_checkpoint_call_fails_clearly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(64, 8, 2, 64, torch.float32, True, use_stash=True)

    def model(x):
        return checkpoint(block, x, use_reentrant=True).square().mean()

    x = torch.randn(2, 40, 64, requires_grad=True)
    with pytest.raises(Exception, match="torch.compile is tracing the activation checkpoint itself"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(x).backward()
    assert attnstash.stash_stats()["entries"] == 0
