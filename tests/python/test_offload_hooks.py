"""Stashed transformers layers under the user's activation offloading: saved-tensor hooks
around the checkpoints, both checkpointing modes. On a GPU every offloader (save_on_cpu,
transformers' offload=True, TRL's activation_offloading) hands the recompute a copy of the
layer input; on a CPU save_on_cpu moves nothing, so `copying` (a hooks pair that packs each
tensor into a copy of its own) reproduces the GPU situation here. The forward and its
recompute are tied by the checkpoint call (core.Run's token), not by the input's data
pointer: loss and gradients bitwise the run without the stash, one attention forward per
call, nothing held after."""
import contextlib
import gc

import pytest
import torch

import attnstash
from offload_cases import KINDS, MODES, build
from tiny_models import assert_bitwise_equal


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


@pytest.mark.parametrize("hooks", list(HOOKS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_model_under_offloading_hooks_trains_bitwise(mode, kind, hooks):
    # transformers: tied by its Run's token; plain PyTorch (the checkpoint calls the module): by
    # module_call.py's token, held by the layer input's grad_fn (reentrant) or the layer's
    # pending list (non-reentrant).
    runs, counted = [], []
    for use_stash in (False, True):
        case = build(kind, mode)
        if use_stash:
            attnstash.install_attention_stash(case.model, **case.install)
        try:
            before = attnstash.stash_stats()
            steps = []
            for _ in range(2):
                context, packed = HOOKS[hooks]()
                with context:
                    steps.append(case.step(case.model))
                if packed is not None:
                    counted.append(len(packed))
            runs.append(steps)
            after = attnstash.stash_stats()
        finally:
            if use_stash:
                attnstash.uninstall_attention_stash(case.model)
    layers = 3
    assert after["keeps"] - before["keeps"] == after["replays"] - before["replays"] == 2 * layers
    assert after["misses"] == before["misses"]
    for without, with_stash in zip(*runs):
        assert_bitwise_equal(without, with_stash)
    assert all(n > 0 for n in counted)  # the hooks really packed the checkpoints' inputs
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


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dropped_forward_under_copying_hooks_holds_nothing_once_its_graph_is_gone(mode):
    import tiny_torch_models as plain
    model = plain.gpt(checkpointing=mode)
    attnstash.install_attention_stash(model, layers=plain.Block)
    try:
        context, _ = copying()
        with context:
            loss = torch.nn.functional.cross_entropy(model(plain.ids()).flatten(0, 1), plain.ids().flatten())
        assert attnstash.stash_stats()["records"] == 3
        del loss
        assert attnstash.stash_stats()["records"] == 0
        loss_and_grads_ok = plain.loss_and_grads(model, plain.ids())  # and the next step still trains
        assert loss_and_grads_ok[1]
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_two_forwards_of_a_layer_before_one_backward_under_copying_hooks_are_refused_at_the_recompute(mode):
    # The recompute is handed a copy, and two of the layer's first forwards wait: it cannot tell
    # which one it repeats, and says so rather than guess.
    import tiny_torch_models as plain
    model = plain.gpt(checkpointing=mode)
    attnstash.install_attention_stash(model, layers=plain.Block)
    context, _ = copying()
    try:
        with context:
            a = torch.nn.functional.cross_entropy(model(plain.ids()).flatten(0, 1), plain.ids().flatten())
            b = torch.nn.functional.cross_entropy(model(plain.ids(seed=2)).flatten(0, 1),
                                                  plain.ids(seed=2).flatten())
        with pytest.raises(attnstash.ReplayError) as caught:
            (a + b).backward()
        msg = str(caught.value)
        assert "was handed a copy of the layer input" in msg and "2 of its first forwards are waiting" in msg
        assert "Run the backward of each forward before the next forward of this layer" in msg
        del a, b, caught
        gc.collect()
        # After a backward that fails in a recompute with two forwards pending, PyTorch itself keeps
        # one forward's graph alive (its checkpoint's frames stay, with or without attnstash), and
        # that forward's records go with its graph: at most one forward's three.
        assert attnstash.stash_stats()["records"] <= 3
    finally:
        attnstash.uninstall_attention_stash(model, release=True)  # (that graph never backs up)
    assert attnstash.stash_stats()["records"] == 0


def test_a_reentrant_checkpoint_of_a_leaf_input_under_offloading_hooks_is_refused_and_says_why():
    import tiny_torch_models as plain
    block = plain.gpt(checkpointing="reentrant").blocks[0]
    model = torch.nn.Sequential(block)
    attnstash.install_attention_stash(model, layers=plain.Block)
    x = torch.randn(2, 12, 32, requires_grad=True)
    try:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            with pytest.raises(attnstash.CheckpointingError) as caught:
                torch.utils.checkpoint.checkpoint(block, x, None, use_reentrant=True)
    finally:
        attnstash.uninstall_attention_stash(model)
    msg = str(caught.value)
    assert "runs a reentrant checkpoint under saved-tensor hooks" in msg and "leaf tensor that requires grad" in msg
    assert "use non-reentrant checkpointing, turn offloading off for it" in msg
    assert attnstash.stash_stats()["records"] == 0


# ---- what the stash keeps goes through the hooks (install/offload.py, Hooks) ---------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_kept_records_go_through_the_users_hooks_and_leave_the_device_count(mode, kind):
    model, install, _, forward, _ = build(kind, mode)
    attnstash.install_attention_stash(model, **install)
    try:
        plain_step = forward(model)  # without hooks: what the stash holds on the device
        held = attnstash.stash_stats()["bytes"]
        plain_step.backward()
        context, packed = copying()
        with context:
            loss = forward(model)
        after_forward = attnstash.stash_stats()
        loss.backward()
        after_backward = attnstash.stash_stats()
    finally:
        attnstash.uninstall_attention_stash(model)
    assert held > 0
    assert after_forward["bytes"] == 0 and after_forward["moved_bytes"] == held
    assert after_forward["records"] == 3
    outputs = [s for s in packed if len(s) == 4]  # the kept outputs [batch, heads, seq, head_dim] among what was packed
    assert len(outputs) >= 3
    assert after_backward["records"] == 0 and after_backward["moved_bytes"] == 0 and after_backward["bytes"] == 0
    assert after_backward["misses"] == after_forward["misses"]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_budget_counts_the_device_bytes_only(mode):
    # A budget of one layer's record: without hooks the stash keeps one layer (declines the rest);
    # under hooks each layer's record leaves the device after its forward, so every layer keeps.
    model, install, _, forward, _ = build("plain PyTorch", mode)
    attnstash.install_attention_stash(model, **install)
    try:
        loss = forward(model)
        one_layer = attnstash.stash_stats()["bytes"] // 3
        loss.backward()
        results = {}
        for hooks in (False, True):
            attnstash.stash_set_max_bytes(one_layer)
            try:
                before = attnstash.stash_stats()
                context = copying()[0] if hooks else contextlib.nullcontext()
                with context:
                    loss = forward(model)
                loss.backward()
                after = attnstash.stash_stats()
            finally:
                attnstash.stash_set_max_bytes(None)
            results[hooks] = (after["keeps"] - before["keeps"], after["declined"] - before["declined"])
    finally:
        attnstash.uninstall_attention_stash(model)
    assert results[False] == (1, 2) and results[True] == (3, 0), results
    assert attnstash.stash_stats()["records"] == 0


def test_hooks_that_give_back_another_dtype_are_refused_and_say_so():
    # An offloader that changes what it holds (here: float64 back for a float32 kept output)
    # cannot carry what the stash keeps: refused at the recompute, never a wrong gradient.
    model, install, _, forward, _ = build("plain PyTorch", "reentrant")
    attnstash.install_attention_stash(model, **install)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.double() if t.dim() == 4 else t)
    try:
        with hooks:
            loss = forward(model)
        with pytest.raises(attnstash.ReplayError) as caught:
            loss.backward()
    finally:
        attnstash.uninstall_attention_stash(model)
    msg = str(caught.value)
    assert "a kept attention output came back from offloading as Double[2, 4, 12, 8]" in msg
    assert "but it left as Float[2, 4, 12, 8]" in msg and "must give back what they were given" in msg
    del loss, caught
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_a_block_compiled_inside_an_eager_checkpoint_under_copying_hooks_fails_at_its_recompute_and_says_why(mode):
    # Its graph anchors on the layer input (install/compiled.py), which the hooks copy: a clear
    # error at the recompute, never a wrong gradient.
    model, install, _, forward, _ = build("plain PyTorch", mode)
    torch._dynamo.reset()
    attnstash.install_attention_stash(model, **install)
    for block in model.blocks:
        block.compile(backend="eager")
    context, _ = copying()
    try:
        with context:
            loss = forward(model)
        with pytest.raises(RuntimeError) as caught:
            loss.backward()
    finally:
        attnstash.uninstall_attention_stash(model)
        torch._dynamo.reset()
    msg = str(caught.value)
    assert "no attention output is kept for this anchor" in msg and "hands the recompute a copy of the layer input" \
        in msg and "not for a layer compiled on its own inside an eager checkpoint" in msg
    del loss, caught
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0
