"""A backward that keeps its graph (retain_graph=True), then another through the same forward:
GAN and multi-loss training, a loss backed up in parts. PyTorch recomputes each checkpointed
layer in each backward; the stash replays what the first forward kept in each, and the record
goes when the last backward (one that frees the graph) takes it, or with the graph. Both
checkpointing modes, layers reached through transformers' checkpoint function and by a module
call, with the user's offloading hooks (save_on_cpu, and a pair whose pack copies) or attnstash's
own, a budget that demotes, a layer compiled inside its eager checkpoint; every run bitwise the
run without the stash.
(keep_replay.h, backward_keeps_graph, says the rule.)"""
import gc

import pytest
import torch

import attnstash
import tiny_torch_models as plain
from offload_cases import KINDS, MODES, build
from test_offload_hooks import copying
from test_offload_own import install_stand_in
from tiny_models import assert_bitwise_equal, clone, counters

HOW = ["eager", "under save_on_cpu", "under hooks that copy", "with its own offload", "with a budget that demotes"]
# (save_on_cpu on CPU tensors moves nothing; hooks that copy hand the recompute a copy of the
# layer input, as every offloader does on a GPU)
HOOKS = {"under save_on_cpu": torch.autograd.graph.save_on_cpu, "under hooks that copy": lambda: copying()[0]}


def two_backwards(model, forward, hooks=None):
    """The loss, backward keeping the graph, the gradients; half the loss backward again through
    the same graph, the gradients: [loss, grads after the first, grads after the second]."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    if hooks is None:
        loss = forward(model)
    else:
        with hooks():
            loss = forward(model)
    grads = []
    loss.backward(retain_graph=True)
    grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (loss * 0.5).backward()
    grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return loss.detach(), grads


def assert_bitwise(a, b):
    """two_backwards' results bitwise equal: the loss, and the gradients after each backward."""
    for grads_a, grads_b in zip(a[1], b[1]):
        assert grads_a  # gradients reached the parameters
        assert_bitwise_equal((a[0], grads_a), (b[0], grads_b))


def assert_nothing_held():
    stats = attnstash.stash_stats()
    assert stats["records"] == 0 and stats["bytes"] == 0 and stats["moved_bytes"] == 0, stats


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_backward_through_a_kept_graph_replays_again_bitwise(mode, kind, how, installed):
    case = build(kind, mode)
    hooks = HOOKS.get(how)
    reference = two_backwards(clone(case.model), case.forward, hooks)
    assert_bitwise(two_backwards(clone(case.model), case.forward, hooks), reference)  # reproducible

    model = clone(case.model)
    layers = model.model.layers if kind == "transformers" else model.blocks  # the copy's
    if how == "with its own offload":
        stand_in = install_stand_in(model, layers, case.install)
    else:
        budget = {"max_bytes": 1} if how == "with a budget that demotes" else {}
        installed(model, **case.install, **budget)
    try:
        before = attnstash.stash_stats()
        keeps, replays = counters()
        assert_bitwise(two_backwards(model, case.forward, hooks), reference)
        after = attnstash.stash_stats()
        if how == "with a budget that demotes":  # every keep declined: each recompute runs attention
            assert after["declined"] - before["declined"] == 3
        else:  # kept once, replayed in each backward: no silent fall-back to a second forward
            assert counters() == (keeps + 3, replays + 6)
        assert after["released_unused"] == before["released_unused"]
        assert after["misses"] == before["misses"]
        if how == "with its own offload":
            assert [entry[0] for entry in stand_in.log].count("moved") == 3
        assert_nothing_held()
    finally:
        if how == "with its own offload":
            attnstash.uninstall_attention_stash(model)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_graph_a_backward_kept_holds_its_records_until_it_is_dropped(mode, kind, installed):
    case = build(kind, mode)
    model = clone(case.model)
    installed(model, **case.install)
    before = attnstash.stash_stats()
    loss = case.forward(model)
    loss.backward(retain_graph=True)
    held = attnstash.stash_stats()
    assert held["records"] == 3 and held["bytes"] > 0  # another backward may come: still held
    assert held["replays"] - before["replays"] == 3
    del loss
    gc.collect()
    assert_nothing_held()  # released with the graph, no later forward needed
    # replayed once, so not counted as dropped unused
    assert attnstash.stash_stats()["released_unused"] == before["released_unused"]


@pytest.mark.parametrize("keeps_graph", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_autograd_grad_keeping_the_graph_then_backward(kind, keeps_graph, installed):
    # Non-reentrant only: reentrant checkpointing supports backward(), not autograd.grad.
    # create_graph=True keeps the graph too (a gradient penalty's first half).
    case = build(kind, "non-reentrant")

    def run(model):
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        loss = case.forward(model)
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, allow_unused=True, **{keeps_graph: True})
        loss.backward()
        return [g.detach() for g in first if g is not None], [p.grad for p in params if p.grad is not None]

    reference = run(clone(case.model))
    model = clone(case.model)
    installed(model, **case.install)
    keeps, replays = counters()
    got = run(model)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], reference[0] + reference[1]))
    assert len(got[0]) == len(reference[0]) > 0 and len(got[1]) == len(reference[1]) > 0
    assert counters() == (keeps + 3, replays + 6)
    assert_nothing_held()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_block_compiled_inside_its_eager_checkpoint_replays_in_each_backward(mode, installed):
    torch._dynamo.reset()
    base = plain.gpt(checkpointing=mode)
    tokens = plain.ids()

    def forward(model):
        return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    def compiled(model):
        for block in model.blocks:
            block.compile(backend="aot_eager")
        return model

    reference = two_backwards(compiled(clone(base)), forward)
    model = clone(base)
    installed(model, layers=plain.Block)
    compiled(model)
    keeps, replays = counters()
    assert_bitwise(two_backwards(model, forward), reference)
    assert counters() == (keeps + 3, replays + 6)
    assert_nothing_held()
