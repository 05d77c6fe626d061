"""torch.compile: a custom model whose attention calls attnstash::sdpa_fwd_keep, compiled
with fullgraph=True and checkpointed with reentrant checkpointing, trains with the same
loss and gradients as eager, with and without the stash, and leaves the stash empty.

Where compile and checkpointing meet: the compiled function is the checkpointed block
(no graph breaks inside it; dynamo compiles one graph for the first forward, grad off,
and one for the recompute, grad on). Compiling around the checkpoint call instead makes
dynamo trace the checkpoint itself into its own recomputation, where nothing can be kept:
that fails with a clear error, or (on torch versions whose trace hides the checkpoint)
warns and runs plain attention.

Models stashed by the installer and compiled: test_compile_installed.py."""
import warnings

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import attnstash
from attention_cases import Block


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
        assert attnstash.stash_stats()["records"] == 0
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


def test_compiling_around_the_checkpoint_call_fails_or_warns_clearly(capfd):
    # torch.compile turns the checkpoint into its own recomputation, where nothing can be
    # kept. torch 2.13 lets the op see the checkpoint while tracing: a clear error. torch
    # 2.11 traces the checkpointed block as an ordinary differentiable call: a warning, and
    # the compiled step is plain attention, with the gradients of a run without the stash.
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(64, 8, 2, 64, torch.float32, True, use_stash=True)

    def model(x):
        return checkpoint(block, x, use_reentrant=True).square().mean()

    x = torch.randn(2, 40, 64, requires_grad=True)
    before = attnstash.stash_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.compile(model, fullgraph=True, backend="aot_eager")(x).backward()
            error = None
        except Exception as e:  # noqa: BLE001 (whatever dynamo wraps it in)
            error = str(e)
    if error is not None:
        assert "torch.compile is tracing the activation checkpoint itself" in error
    else:
        # A Python warning, or (raised while dynamo traces) c10's warning on stderr.
        said = [str(w.message) for w in caught] + [capfd.readouterr().err]
        assert any("nothing is kept" in m and "checkpoint(torch.compile(block)" in m for m in said)
        after = attnstash.stash_stats()
        assert after["keeps"] == before["keeps"] and after["replays"] == before["replays"]
        got, x.grad = x.grad, None
        block.use_stash = False
        model(x).backward()
        assert torch.equal(got, x.grad)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_checkpointed_block_under_autocast_trains_like_eager_fsdpa(backend):
    # fp32 weights under CPU autocast: the ops cast their inputs as F.sdpa does, also when
    # torch.compile traces them; the kept path equals eager F.sdpa under autocast bitwise.
    def run(use_stash, compile_backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        block = Block(64, 8, 2, 64, torch.float32, True, use_stash)
        fn = torch.compile(block, fullgraph=True, backend=compile_backend) if compile_backend else block
        x = torch.randn(2, 40, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(fn, x, use_reentrant=True)
            loss = y.float().square().mean()
        loss.backward()
        return loss.detach(), [x.grad] + [p.grad for p in block.parameters()]

    before = attnstash.stash_stats()
    stash_loss, stash_grads = run(True, backend)
    after = attnstash.stash_stats()
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    # (Compiled autocast regions may round the input gradient differently from eager, with
    # or without the stash: compare like with like.)
    plain_loss, plain_grads = run(False, backend)
    assert torch.equal(stash_loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(stash_grads, plain_grads))


def test_the_eager_forward_reads_where_dynamo_would_trace_it():
    """core.stashed_forward skips torch.compiler.disable's cost in plain eager and keeps it wherever
    dynamo's frame callback is set (a compiled caller running code eagerly): state.dynamo_callback
    must say which, on this torch (a release without it would pay disable's cost on every call)."""
    from attnstash.install import state
    assert state.dynamo_callback is not state._callback_unknown
    assert state.dynamo_callback() is None
    seen = []

    @torch.compile(backend="eager")
    def caller(x):
        seen.append(state.dynamo_callback())  # not traceable: run eagerly, under the compiled caller's callback
        return x + 1

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caller(torch.ones(2))
    torch._dynamo.reset()
    assert seen and seen[0] is not None
    assert state.dynamo_callback() is None
