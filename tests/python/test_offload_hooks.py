"""Stashed transformers layers under the user's activation offloading: saved-tensor hooks
around the checkpoints, both checkpointing modes. On a GPU every offloader (save_on_cpu,
transformers' offload=True, TRL's activation_offloading) hands the recompute a copy of the
layer input; on a CPU save_on_cpu moves nothing, so `copying` (a hooks pair that packs each
tensor into a copy of its own) reproduces the GPU situation here. The forward and its
recompute are tied by the checkpoint call (core.Run's token), not by the input's data
pointer: loss and gradients bitwise the run without the stash, one attention forward per
call, nothing held after."""
import pytest
import torch

import attnstash
from tiny_models import assert_bitwise_equal, batch, loss_and_grads, tiny_model

MODES = {"reentrant": True, "non-reentrant": False}


def copying():
    """Saved-tensor hooks that pack every tensor into a copy of its own, counting them."""
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.detach().clone()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), packed


def not_copying():
    return torch.autograd.graph.save_on_cpu(pin_memory=False), None


HOOKS = {"copying hooks": copying, "save_on_cpu": not_copying}


def offloaded_step(model, ids, hooks):
    context, _ = HOOKS[hooks]()
    with context:
        return loss_and_grads(model, ids)


@pytest.mark.parametrize("hooks", list(HOOKS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_transformers_model_under_offloading_hooks_trains_bitwise(mode, hooks):
    ids = batch()
    runs = []
    for use_stash in (False, True):
        model = tiny_model("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
        if use_stash:
            attnstash.install_attention_stash(model)
        try:
            before = attnstash.stash_stats()
            runs.append([offloaded_step(model, ids, hooks) for _ in range(2)])
            after = attnstash.stash_stats()
        finally:
            if use_stash:
                attnstash.uninstall_attention_stash(model)
    layers = 3
    assert after["keeps"] - before["keeps"] == after["replays"] - before["replays"] == 2 * layers
    for without, with_stash in zip(*runs):
        assert_bitwise_equal(without, with_stash)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_the_copying_hooks_really_hand_the_recompute_copies(mode):
    # What makes the test above the GPU situation: without the tie on the checkpoint call, the
    # recompute's layer input is a copy, at another address than the first forward's.
    seen = []

    class Layer(torch.nn.Module):
        def forward(self, x):
            seen.append(x.data_ptr())
            return x.sin()  # (saves x: the recompute runs)

    x = torch.randn(4, requires_grad=True)
    context, packed = copying()
    with context:
        y = torch.utils.checkpoint.checkpoint(Layer(), x * 1, use_reentrant=MODES[mode])
    y.sum().backward()
    assert len(seen) == 2 and seen[0] != seen[1] and packed


def test_a_layer_whose_checkpoint_calls_the_module_refuses_reentrant_offloading_and_says_why():
    # No Run holds a token for it (core.py, Anchor): its recompute could only find its record by
    # the layer input, which the hooks copy.
    import tiny_torch_models as plain
    model = plain.gpt(checkpointing="reentrant")
    attnstash.install_attention_stash(model, layers=plain.Block)
    try:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            with pytest.raises(attnstash.CheckpointingError) as caught:
                plain.loss_and_grads(model, plain.ids())
    finally:
        attnstash.uninstall_attention_stash(model)
    msg = str(caught.value)
    assert "layer 0 (blocks.0, Block) runs a reentrant checkpoint under saved-tensor hooks" in msg
    assert "not for a layer whose checkpoint calls the module itself" in msg and "turn offloading off" in msg
    assert attnstash.stash_stats()["records"] == 0


def test_a_layer_whose_checkpoint_calls_the_module_under_copying_hooks_fails_at_its_recompute_and_says_why():
    import tiny_torch_models as plain
    model = plain.gpt(checkpointing="non-reentrant")
    attnstash.install_attention_stash(model, layers=plain.Block)
    context, _ = copying()
    try:
        with context:
            loss = torch.nn.functional.cross_entropy(model(plain.ids()).flatten(0, 1), plain.ids().flatten())
        with pytest.raises(attnstash.ReplayError) as caught:
            loss.backward()
    finally:
        attnstash.uninstall_attention_stash(model)
    msg = str(caught.value)
    assert "no attention output is kept for this anchor" in msg and "hands the recompute a copy of the layer input" \
        in msg and "not for layers whose checkpoint calls the module itself" in msg
    del loss
    assert attnstash.stash_stats()["records"] == 0
