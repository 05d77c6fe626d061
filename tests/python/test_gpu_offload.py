"""The stash under the user's activation offloading on CUDA, where the offloader really moves
the checkpoints' inputs to host memory and hands each recompute a copy (on a CPU save_on_cpu
moves nothing: test_offload_hooks.py reproduces that with hooks that copy). transformers'
`activation_checkpointing_enable(offload=True)` (save_on_cpu, pinned, inside its checkpoint
function) and save_on_cpu(pin_memory=True) around a plain-PyTorch model whose forward
checkpoints each block, both checkpointing modes, bf16: one attention forward per layer per
step, no miss, the loss bitwise the run without the stash, each gradient bitwise where the
runs without the stash are, else no further from its nearest such run than they are from each
other (cuDNN accumulates dQ in any order), nothing held after. Skipped without a GPU; run on
the GPU machine by tests/gpu/run.sh. Last, attnstash's own offload (offload=True), which moves
nothing on a CPU (tests/python/test_offload_own.py runs its mechanism there with stand-ins)."""
import inspect

import pytest
import torch

import attnstash
from tiny_models import assert_within_run_spread

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODES = {"reentrant": True, "non-reentrant": False}


def stashed(step, model, **install):
    attnstash.install_attention_stash(model, **install)
    before = attnstash.stash_stats()
    try:
        got = step(model)
    finally:
        attnstash.uninstall_attention_stash(model)
    after = attnstash.stash_stats()
    return got, {k: after[k] - before[k] for k in ("keeps", "replays", "misses")} | \
        ({"offload_waits": after["offload_waits"] - before["offload_waits"]} if install.get("offload") else {})


@pytest.mark.parametrize("mode", list(MODES))
def test_transformers_offload_true_on_cuda(mode):
    from tiny_models import batch, clone, tiny_model
    base = tiny_model("llama", layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no activation_checkpointing_enable(offload=True)")
    enable(activation_checkpointing_kwargs={"use_reentrant": MODES[mode]}, offload=True)
    base = base.to("cuda", torch.bfloat16)
    ids = batch(batch_size=2, seq=128).cuda()

    def step(model):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    normal = [step(clone(base)) for _ in range(4)]
    got, counted = stashed(step, clone(base))
    assert counted == {"keeps": 2, "replays": 2, "misses": 0}
    assert_within_run_spread(normal, got)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_a_plain_model_under_pinned_save_on_cpu_on_cuda(mode):
    import tiny_torch_models as plain
    base = plain.gpt(checkpointing=mode, dim=256, heads=4).to("cuda", torch.bfloat16)
    ids = plain.ids(batch=2, seq=128).cuda()
    seen = []

    def step(model):
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    import copy
    normal = [step(copy.deepcopy(base)) for _ in range(4)]
    model = copy.deepcopy(base)
    handle = model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].data_ptr()))
    got, counted = stashed(step, model, layers=plain.Block)
    handle.remove()
    assert len(seen) == 2 and seen[0] != seen[1]  # the recompute was handed a copy
    assert counted == {"keeps": 3, "replays": 3, "misses": 0}
    assert_within_run_spread(normal, got)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_attnstash_offload_on_cuda(mode):
    """install_attention_stash(offload=True): after the forward the stash holds nothing on the
    device (all moved to pinned host memory), the backward fetches each layer's records (only
    the first recompute waits), and the step is the step without it."""
    from tiny_models import batch, clone, tiny_model
    base = tiny_model("llama", layers=3, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
    base = base.to("cuda", torch.bfloat16)
    ids = batch(batch_size=2, seq=128).cuda()
    seen = {}

    def step(model):
        loss = model(input_ids=ids, labels=ids).loss
        seen.update(attnstash.stash_stats())
        loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    normal = [step(clone(base)) for _ in range(4)]
    got, counted = stashed(step, clone(base), offload=True)
    assert seen["bytes"] == 0 and seen["moved_bytes"] > 0 and seen["records"] == 3
    assert counted == {"keeps": 3, "replays": 3, "misses": 0, "offload_waits": 1}
    assert_within_run_spread(normal, got)
    stats = attnstash.stash_stats()
    assert stats["records"] == stats["moved_bytes"] == 0
