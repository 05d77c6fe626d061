"""When attnstash::sdpa_fwd_keep keeps and when what it kept goes, on CPU: outside a checkpoint and
under inference mode it is F.scaled_dot_product_attention and keeps nothing; each recompute takes
its own forward and never runs the attention forward again; an entry is released with a dropped
non-reentrant graph, when its anchor is freed (never matched by a new tensor at that address) and
by stash_clear, after which a recompute fails instead of recomputing; stash_stats reports every
counter with its meaning."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import attnstash
from attention_cases import Block, anchor_for, error_of, qkv
from attnstash import ops


@pytest.mark.parametrize("grad_mode,anchor_requires_grad", [(True, True), (True, False), (False, False)])
def test_outside_a_checkpoint_it_is_fsdpa_and_keeps_nothing(grad_mode, anchor_requires_grad):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 8, 2, 64)
    for t in (q, k, v):
        t.requires_grad_(grad_mode)
    anchor = torch.randn(3, requires_grad=anchor_requires_grad)
    before = attnstash.stash_stats()
    with torch.set_grad_enabled(grad_mode):
        out = ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)
    assert attnstash.stash_stats()["keeps"] == before["keeps"]
    if grad_mode:  # an ordinary differentiable call: F.sdpa's own gradients
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, (q, k, v), g)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_inference_mode_keeps_nothing():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = torch.randn(3, requires_grad=True)
    with torch.inference_mode():
        out = ops.sdpa_fwd_keep(q, k, v, anchor, 0)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("order", [pytest.param(reversed, id="reverse"), pytest.param(list, id="forward")])
def test_the_recompute_takes_its_own_forward(order):
    # Two forwards through the same slot on different anchors, recomputed in either
    # order: each backward must get its own forward's attention.
    torch.manual_seed(0)
    block = Block(64, 4, 4, 64, torch.float32, True, use_stash=True)
    ref = Block(64, 4, 4, 64, torch.float32, True, use_stash=False)
    ref.load_state_dict(block.state_dict())
    xs = [torch.randn(2, 24, 64, requires_grad=True) for _ in range(2)]
    ys = [checkpoint(block, x, use_reentrant=True) for x in xs]
    assert attnstash.stash_stats()["records"] == 2
    for x, y in order(list(zip(xs, ys))):
        y.square().sum().backward()
    for x in xs:
        x_ref = x.detach().clone().requires_grad_()
        checkpoint(ref, x_ref, use_reentrant=True).square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_cleared_stash_fails_the_recompute_instead_of_recomputing(reentrant):
    block = Block(64, 4, 4, 64, torch.float32, True, use_stash=True)
    x = torch.randn(2, 24, 64, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=reentrant)
    assert attnstash.stash_clear() == 1
    msg = error_of(lambda: y.sum().backward())
    assert "no attention output is kept" in msg and "stash_clear" in msg


class CountAttentionForwards(TorchDispatchMode):
    """Counts calls of the CPU flash attention forward (aten level) while active."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_the_backward_never_runs_the_attention_forward_again(reentrant):
    counts = {}
    for use_stash in (False, True):
        torch.manual_seed(0)
        block = Block(64, 8, 2, 64, torch.float32, True, use_stash)
        x = torch.randn(2, 40, 64, requires_grad=True)
        y = checkpoint(block, x, use_reentrant=reentrant)
        with CountAttentionForwards() as count:
            y.square().mean().backward()
        counts[use_stash] = count.calls
    assert counts == {False: 1, True: 0}


def test_a_dropped_non_reentrant_forward_is_released_with_its_graph_while_its_anchor_lives():
    """Under non-reentrant checkpointing the first forward's node owns the record: dropping
    the graph releases it at once, though the anchor (x, which the caller holds) lives on."""
    torch.manual_seed(0)
    block = Block(64, 4, 2, 16, torch.float32)
    x = torch.randn(2, 40, 64, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    assert attnstash.stash_stats()["records"] == 1
    del y
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0  # x, the anchor, is still held here


def test_a_token_releases_what_is_held_under_it_as_it_is_freed():
    """ops.new_token: a 0-dim CPU tensor that requires grad; freeing it releases its records at
    once (held_ids releases nothing itself), other anchors' records untouched."""
    q, k, v = qkv(torch.float32, 4, 4, 16)
    token, other = ops.new_token(), anchor_for(q)
    assert token.dim() == 0 and token.device.type == "cpu" and token.requires_grad and token.is_leaf
    released = attnstash.stash_stats()["released_unused"]
    with torch.no_grad():
        for slot in (3, 4):
            ops.sdpa_fwd_keep(q, k, v, token, slot)
        ops.sdpa_fwd_keep(q, k, v, other, 3)
    kept_for_other = ops.record_id(other, 3)
    assert len(ops.held_ids()) == 3
    del token
    assert ops.held_ids() == [kept_for_other]
    assert attnstash.stash_stats()["released_unused"] == released + 2
    ops.release(kept_for_other)


def test_records_of_a_freed_anchor_are_released_by_the_next_call_or_stats_and_never_matched():
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = torch.randn(64, 1024, requires_grad=True)  # 256 KiB: malloc gives such blocks back on free
    address = anchor.data_ptr()
    released = attnstash.stash_stats()["released_unused"]
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0)
    del anchor
    gc.collect()
    assert list(ops.held_by_slot()) == [0]  # still held: nothing has called the ops since
    # A new anchor, likely at the same address, with the same version and shape.
    reuse = [torch.randn(64, 1024, requires_grad=True) for _ in range(4)]
    same = [t for t in reuse if t.data_ptr() == address]
    probe = same[0] if same else reuse[0]
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_replay(q, k, v, probe, 0))
    assert "no attention output is kept" in msg
    stats = attnstash.stash_stats()
    assert stats["records"] == 0 and stats["released_unused"] == released + 1
    # stash_stats() itself releases what freed anchors left, so that it reports what is held.
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0)
    del anchor
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0


def test_freed_input_anchors_are_released_whatever_tokens_kept_and_released_between():
    """release_freed looks through the registry only while a record not on a token may be held
    (records.cpp): after it has found none, a new input anchor's record, once that input is
    freed, is still released by the next call; token records go with their tokens throughout."""
    q, k, v = qkv(torch.float32, 4, 4, 16)
    for _ in range(2):
        anchor, token = anchor_for(q), ops.new_token()
        with torch.no_grad():
            ops.sdpa_fwd_keep(q, k, v, anchor, 0)
            ops.sdpa_fwd_keep(q, k, v, token, 1)
        assert attnstash.stash_stats()["records"] == 2  # both alive: nothing released
        del anchor
        gc.collect()
        assert sorted(ops.held_by_slot()) == [0, 1]  # held_by_slot releases nothing itself
        assert attnstash.stash_stats()["records"] == 1  # the freed input's record, released
        del token
        assert ops.held_ids() == []
        with torch.no_grad():  # tokens alone: kept and released with their tokens
            ops.sdpa_fwd_keep(q, k, v, ops.new_token(), 0)
        assert ops.held_ids() == []


def test_stash_clear_releases_everything():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchors = [anchor_for(q) for _ in range(3)]
    with torch.no_grad():
        for a in anchors:
            ops.sdpa_fwd_keep(q, k, v, a, 0)
    assert attnstash.stash_stats()["records"] == 3
    assert attnstash.stash_clear() == 3
    assert attnstash.stash_stats()["records"] == 0


def test_stats_report_every_counter_with_its_meaning():
    names = ["records", "bytes", "peak_bytes", "max_bytes", "keeps", "declined", "replays", "misses",
             "released_unused", "moved_bytes", "offload_waits", "recomputed"]
    assert list(attnstash.stash_stats()) == names  # csrc/stash_registry.h's order, then ops.py's
    meanings = attnstash.stash_stats_meanings()
    assert list(meanings) == names and all(meanings.values())


def test_the_phase_a_stashed_forward_starts_in():
    """ops.frame_phase (keep_replay.h, FramePhase: what the installer opens each frame by) in every
    place a stashed layer's forward runs: outside everything, under no_grad, in inference mode,
    inside a backward, under offloading's saved-tensor hooks, and in each checkpoint's first
    forward and recompute, with outer_grad (a backward can reach the checkpoint) seen on, off, or not at all."""
    P = ops.FramePhase
    seen = []

    def note(where):
        seen.append((where, P(ops.frame_phase(-1)), P(ops.frame_phase(True)), P(ops.frame_phase(0))))

    def layer(x):
        note("forward" if torch._C._current_graph_task_id() == -1 else "recompute")
        return x.sin()

    note("outside")
    with torch.no_grad():
        note("no_grad")
    with torch.inference_mode():
        note("inference_mode")
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: note("backward") or g)  # (a backward runs its hooks with grad off)
    y.register_hook(lambda g: _with_grad(note, "backward, grad on") or g)
    y.sum().backward()
    with torch.autograd.graph.save_on_cpu():
        note("save_on_cpu")
        with torch.no_grad():
            note("save_on_cpu, no_grad")
    for reentrant in (True, False):
        checkpoint(layer, x * 1, use_reentrant=reentrant).sum().backward()
    with torch.autograd.graph.save_on_cpu():
        checkpoint(layer, x * 1, use_reentrant=True).sum().backward()
    outside, first, hooked = P.outside_checkpoint, P.reentrant_first, P.reentrant_first_hooked
    assert seen == [
        ("outside", outside, outside, outside),
        ("no_grad", first, first, P.unreachable),
        ("inference_mode", P.unreachable, P.unreachable, P.unreachable),
        ("backward", P.recompute_without_grad, P.recompute_without_grad, P.recompute_without_grad),
        ("backward, grad on", P.recompute, P.recompute, P.recompute),
        ("save_on_cpu", P.non_reentrant_first, P.non_reentrant_first, P.non_reentrant_first),
        ("save_on_cpu, no_grad", hooked, hooked, P.unreachable),
        ("forward", first, first, P.unreachable), ("recompute", P.recompute, P.recompute, P.recompute),
        # (a non-reentrant checkpoint runs its first forward and its recompute under its own hooks)
        ("forward", P.non_reentrant_first, P.non_reentrant_first, P.non_reentrant_first),
        ("recompute", P.recompute, P.recompute, P.recompute),
        ("forward", hooked, hooked, P.unreachable), ("recompute", P.recompute, P.recompute, P.recompute)]
    with pytest.raises(ValueError, match="takes outer_grad as 1, 0 or -1 .unseen., got 2"):
        ops.frame_phase(2)


def _with_grad(fn, *args):
    with torch.enable_grad():
        return fn(*args)
