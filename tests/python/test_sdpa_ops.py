"""attnstash::sdpa_fwd_keep and attnstash::sdpa_replay on CPU: PyTorch's exact numbers,
the phase rules, and a clear error for every input they cannot keep."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import attnstash
from attention_cases import Block, checkpointed_step, error_of, padding_mask, qkv
from attnstash import ops

CASES = [  # dtype, query heads, kv heads, head_dim, causal
    (dtype, hq, hkv, d, causal)
    for dtype in (torch.float32, torch.bfloat16)
    for hq, hkv in ((8, 8), (8, 2))
    for d in (64, 128)
    for causal in (True, False)
]
CASE_IDS = [f"{str(c[0])[6:]}-{c[1]}q{c[2]}kv-d{c[3]}-{'causal' if c[4] else 'full'}" for c in CASES]


def anchor_for(q):
    return torch.randn(q.shape[0], q.shape[2], 16, requires_grad=True)


@pytest.mark.parametrize("dtype,hq,hkv,d,causal", CASES, ids=CASE_IDS)
def test_first_forward_output_is_bitwise_fsdpa(dtype, hq, hkv, d, causal):
    torch.manual_seed(0)
    q, k, v = qkv(dtype, hq, hkv, d)
    gqa = hq != hkv
    anchor = anchor_for(q)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 7, is_causal=causal, enable_gqa=gqa)
        assert attnstash.stash_stats()["keeps"] >= 1 and attnstash.stash_stats()["entries"] == 1
        assert torch.equal(kept, expected) and kept.stride() == expected.stride()
        replayed = ops.sdpa_replay(q, k, v, anchor, 7, is_causal=causal, enable_gqa=gqa)
    assert replayed.data_ptr() == kept.data_ptr()  # the kept tensor itself, not a recomputation
    assert attnstash.stash_stats()["entries"] == 0


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
    assert attnstash.stash_stats()["entries"] == 0


@pytest.mark.parametrize("dtype,hq,hkv,d,causal", CASES, ids=CASE_IDS)
def test_reentrant_checkpoint_gradients_are_bitwise_the_normal_recompute(dtype, hq, hkv, d, causal):
    # Two plain runs of PyTorch's CPU flash attention are bitwise equal (checked here), so the
    # stash must be too.
    base_loss, base_grads, _ = checkpointed_step(dtype, hq, hkv, d, causal, use_stash=False)
    again_loss, again_grads, _ = checkpointed_step(dtype, hq, hkv, d, causal, use_stash=False)
    assert torch.equal(base_loss, again_loss) and all(torch.equal(a, b) for a, b in zip(base_grads, again_grads))

    before = attnstash.stash_stats()
    loss, grads, mid = checkpointed_step(dtype, hq, hkv, d, causal, use_stash=True)
    after = attnstash.stash_stats()
    assert torch.equal(loss, base_loss)
    assert len(grads) == len(base_grads) == 5
    for got, want in zip(grads, base_grads):
        assert torch.equal(got, want)
    assert mid["entries"] == 1 and mid["bytes"] > 0
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["entries"] == 0 and after["bytes"] == 0


@pytest.mark.parametrize("scale", [None, 0.3])
def test_an_explicit_scale_reaches_the_forward_and_the_backward(scale):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 8, 2, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, scale=scale, enable_gqa=True)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    replayed = ops.sdpa_replay(qr, kr, vr, anchor, 0, is_causal=True, scale=scale, enable_gqa=True)
    g = torch.randn_like(replayed)
    got = torch.autograd.grad(replayed, (qr, kr, vr), g)
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale, enable_gqa=True)
    assert torch.equal(kept, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(ref, (qa, ka, va), g)))


def test_kept_bytes_are_output_plus_logsumexp():
    torch.manual_seed(0)
    q, k, v = qkv(torch.bfloat16, 8, 2, 64, batch=2, seq=48)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
        held = attnstash.stash_stats()["bytes"]
        ops.sdpa_replay(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
    output = 2 * 8 * 48 * 64 * 2  # bf16 output
    lse = 2 * 8 * 48 * 4  # float32 log-sum-exp
    assert held == output + lse


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
    assert attnstash.stash_stats()["entries"] == 2
    for x, y in order(list(zip(xs, ys))):
        y.square().sum().backward()
    for x in xs:
        x_ref = x.detach().clone().requires_grad_()
        checkpoint(ref, x_ref, use_reentrant=True).square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)


def test_replay_with_nothing_kept_fails_clearly():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    misses = attnstash.stash_stats()["misses"]
    msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 3))
    assert "no attention output is kept for this anchor" in msg and "slot 3" in msg
    assert attnstash.stash_stats()["misses"] == misses + 1


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


@pytest.mark.parametrize("dtype,hq,hkv,d,causal", CASES[::3], ids=CASE_IDS[::3])
def test_non_reentrant_checkpoint_gradients_are_bitwise_the_normal_recompute(dtype, hq, hkv, d, causal):
    base_loss, base_grads, _ = checkpointed_step(dtype, hq, hkv, d, causal, False, reentrant=False)
    before = attnstash.stash_stats()
    loss, grads, mid = checkpointed_step(dtype, hq, hkv, d, causal, True, reentrant=False)
    after = attnstash.stash_stats()
    assert mid["entries"] == 1
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["entries"] == 0


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_non_reentrant_checkpoint_with_a_padding_mask_is_bitwise_the_normal_recompute(kind):
    def step(use_stash):
        return checkpointed_step(torch.float32, 4, 4, 64, False, use_stash, reentrant=False,
                                 mask=padding_mask(2, 40, kind, torch.float32))

    (loss, grads, _), (base_loss, base_grads, _) = step(True), step(False)
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))


def test_saved_tensor_hooks_without_a_checkpoint_keep_behind_the_node_and_match_autograd():
    # Under save_on_cpu (saved-tensor hooks, no checkpoint) a grad-mode call keeps its output
    # and log-sum-exp behind its own node: the same numbers as F.sdpa's autograd.
    torch.manual_seed(0)
    q, k, v = (t.detach().requires_grad_() for t in qkv(torch.float32, 8, 2, 64))
    anchor = anchor_for(q)
    with torch.autograd.graph.save_on_cpu():
        out = ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
    assert attnstash.stash_stats()["entries"] == 1
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), g)))
    assert attnstash.stash_stats()["entries"] == 0


def test_anchor_modified_in_place_is_reported_as_a_version_change():
    # (Inside torch.utils.checkpoint, autograd's own saved-tensor check trips first.)
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True)
        anchor.add_(1.0)
        msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0, is_causal=True))
    assert "modified in place" in msg and "version was 0" in msg and "is 1 now" in msg
    assert attnstash.stash_stats()["entries"] == 0  # the stale entry was released with the error


def refused_and_nothing_kept(call, words):
    """call() (grad off) raises a RuntimeError that says every one of words; nothing stays kept."""
    with torch.no_grad():
        msg = error_of(call)
    assert all(w in msg for w in words), msg
    assert attnstash.stash_stats()["entries"] == 0


def under_math(call):
    """call, made under sdpa_kernel([SDPBackend.MATH])."""
    def under(*args):
        with sdpa_kernel([SDPBackend.MATH]):
            return call(*args)
    return under


def replay(q, k, v, anchor, is_causal=True):
    return ops.sdpa_replay(q, k, v, anchor, 0, is_causal=is_causal)


DIFFERING_REPLAYS = [  # a replay unlike its forward (q, k, v, anchor, causal), and what its error says
    pytest.param(lambda q, k, v, a: replay(q[:, :, :-1], k, v, a), ["query", "differs"], id="shape"),
    pytest.param(lambda q, k, v, a: replay(q, k.double(), v, a), ["key", "Double"], id="dtype"),
    pytest.param(lambda q, k, v, a: replay(q, k, v, a, is_causal=False), ["is_causal=1", "is_causal=0"], id="flags"),
    pytest.param(under_math(replay), ["SDPA backend", "math"], id="backend"),
]


@pytest.mark.parametrize("differing_replay,words", DIFFERING_REPLAYS)
def test_replay_rejects_a_call_that_differs_from_its_forward(differing_replay, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True)
    refused_and_nothing_kept(lambda: differing_replay(q, k, v, anchor), words + ["released"])


def test_an_output_modified_in_place_before_its_recompute_is_rejected():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        out = ops.sdpa_fwd_keep(q, k, v, anchor, 0)
        out.mul_(2)
        msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0))
    assert "modified in place" in msg and "output" in msg


def keep(q, k, v, anchor, **kwargs):
    return ops.sdpa_fwd_keep(q, k, v, anchor, 0, **kwargs)


def keep_again_with_another_query(q, k, v, anchor):
    """The same anchor and slot again, with another query: refused, and the first keep stays
    (its replay takes it)."""
    keep(q, k, v, anchor)
    try:
        keep(q + 1, k, v, anchor)
    finally:
        ops.sdpa_replay(q, k, v, anchor, 0)


UNKEEPABLE = [  # a call that cannot be kept (q, k, v, anchor), and what its error says
    pytest.param(lambda q, k, v, a: keep(q[0], k, v, a), ["query must be 4-D", "3-D"], id="3-D"),
    pytest.param(lambda q, k, v, a: keep(q, k, v, a, dropout_p=0.1), ["dropout_p=0.1", "attention dropout"],
                 id="dropout"),
    pytest.param(under_math(keep), ["math backend", "sdpa_kernel", "flash_attention (CPU)"], id="math backend"),
    pytest.param(keep_again_with_another_query,
                 ["already went through this attention (slot 0)", "different result", "inputs_embeds.clone()"],
                 id="second keep"),
    pytest.param(lambda q, k, v, a: keep(q, k, v, torch.zeros([1] * 9, requires_grad=True)),
                 ["at most 8 dimensions"], id="rank 9 anchor"),
]


@pytest.mark.parametrize("unkeepable,words", UNKEEPABLE)
def test_what_cannot_be_kept_fails_clearly_and_keeps_nothing(unkeepable, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    refused_and_nothing_kept(lambda: unkeepable(q, k, v, anchor), words)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_a_masked_keep_and_replay_are_bitwise_fsdpa(dtype, kind, hq, hkv):
    torch.manual_seed(0)
    q, k, v = qkv(dtype, hq, hkv, 64, batch=3, seq=40)
    if hq != hkv:  # with a mask, Hugging Face repeats K/V instead of passing enable_gqa
        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    mask = padding_mask(3, 40, kind, dtype)
    anchor = anchor_for(q)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
    assert torch.equal(kept, expected)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    replayed = ops.sdpa_replay(qr, kr, vr, anchor, 0, mask)
    g = torch.randn_like(replayed)
    got = torch.autograd.grad(replayed, (qr, kr, vr), g)
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask), (qa, ka, va), g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_mask_that_requires_grad_is_refused_rather_than_given_no_gradient():
    # The kept path gives masks no gradient (as PyTorch's flash and cuDNN derivatives do);
    # a mask that requires grad is refused instead of silently getting none.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "additive", torch.float32).requires_grad_()
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(q, k, v, anchor_for(q), 0, mask))
    assert "requires grad" in msg and "no gradient" in msg and "detach" in msg


def flip_key_0(mask, b, rows):
    """mask, with key 0 of batch b's query rows `rows` flipped in place."""
    mask[b, :, rows, 0] = ~mask[b, :, rows, 0]
    return mask


ANOTHER_MASK = [  # the recompute's mask, from the first forward's bool padding mask, and what its error says
    pytest.param(lambda m: flip_key_0(m.clone(), 1, slice(None)), ["attn_mask", "different values"], id="values"),
    pytest.param(lambda m: padding_mask(2, 48, "additive", torch.float32), ["attn_mask", "Bool", "Float"],
                 id="dtype"),
    pytest.param(lambda m: flip_key_0(m, 0, 5), ["attn_mask was modified in place"], id="in place"),
]


@pytest.mark.parametrize("another_mask,words", ANOTHER_MASK)
def test_a_recompute_with_another_mask_is_refused(another_mask, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "bool", torch.float32)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
    refused_and_nothing_kept(lambda: ops.sdpa_replay(q, k, v, anchor, 0, another_mask(mask)), words)


@pytest.mark.parametrize("make_alias", [pytest.param(lambda m: m.detach(), id="detached"),
                                        pytest.param(lambda m: m[:], id="view")])
def test_a_recompute_given_an_alias_of_the_mask_checks_its_version_not_its_values(make_alias):
    # A reentrant checkpoint hands its recompute a detached alias of a positional mask.
    # Its values are the first forward's memory, so comparing them cannot show a change;
    # the shared version counter does, and nothing is read (on a GPU that read would
    # synchronise once per layer). A mask in other memory is compared by value.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "bool", torch.float32)
    anchor = anchor_for(q)

    def replay_reads_values(m):
        with torch.profiler.profile() as prof:
            ops.sdpa_replay(q, k, v, anchor, 0, m)
        return "aten::equal" in [e.name for e in prof.events()]

    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
        assert not replay_reads_values(make_alias(mask))
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
        assert replay_reads_values(mask.clone())
        for through in ("first forward's handle", "alias"):
            ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
            view = make_alias(mask)
            target = mask if through == "first forward's handle" else view
            flip_key_0(target, 0, 5)
            msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0, view))
            assert "attn_mask was modified in place" in msg, through
    assert attnstash.stash_stats()["entries"] == 0


def test_a_dropped_non_reentrant_forward_is_released_with_its_graph_while_its_anchor_lives():
    """Under non-reentrant checkpointing the first forward's node owns the record: dropping
    the graph releases it at once, though the anchor (x, which the caller holds) lives on."""
    torch.manual_seed(0)
    block = Block(64, 4, 2, 16, torch.float32)
    x = torch.randn(2, 40, 64, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    assert attnstash.stash_stats()["entries"] == 1
    del y
    gc.collect()
    assert attnstash.stash_stats()["entries"] == 0  # x, the anchor, is still held here


def test_entries_of_a_freed_anchor_are_released_by_the_next_call_or_stats_and_never_matched():
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
    assert stats["entries"] == 0 and stats["released_unused"] == released + 1
    # stash_stats() itself releases what freed anchors left, so that it reports what is held.
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0)
    del anchor
    gc.collect()
    assert attnstash.stash_stats()["entries"] == 0


def test_stash_clear_releases_everything():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchors = [anchor_for(q) for _ in range(3)]
    with torch.no_grad():
        for a in anchors:
            ops.sdpa_fwd_keep(q, k, v, a, 0)
    assert attnstash.stash_stats()["entries"] == 3
    assert attnstash.stash_clear() == 3
    assert attnstash.stash_stats()["entries"] == 0


def test_stats_report_every_counter_with_its_meaning():
    names = ["entries", "bytes", "peak_bytes", "max_bytes", "keeps", "declined", "replays", "misses",
             "released_unused"]
    assert list(attnstash.stash_stats()) == names  # csrc/stash_registry.h's order
    meanings = attnstash.stash_stats_meanings()
    assert list(meanings) == names and all(meanings.values())


# ---- torch.compile and opcheck -------------------------------------------------------------

def test_opcheck_sdpa_fwd_keep_on_the_ordinary_path():
    torch.manual_seed(0)
    for dtype, hq, hkv in ((torch.float32, 4, 4), (torch.bfloat16, 8, 2)):
        q, k, v = (t.detach().requires_grad_() for t in qkv(dtype, hq, hkv, 64))
        anchor = torch.randn(3)
        torch.library.opcheck(torch.ops.attnstash.sdpa_fwd_keep.default,
                              (q, k, v, anchor, 0, None, 0.0, True, None, hq != hkv))


@pytest.mark.parametrize("test_util", ["test_schema", "test_autograd_registration", "test_faketensor",
                                       "test_aot_dispatch_dynamic"])
def test_opcheck_sdpa_replay_on_a_prepared_entry(test_util):
    # Each real call of sdpa_replay takes one entry; keep one for every call opcheck makes.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    real_calls = 0

    class Refill(torch.overrides.TorchFunctionMode):
        # opcheck calls the op several times on copies of the arguments: before each real
        # call, keep a forward for exactly those arguments.
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal real_calls
            takes = (torch.ops.attnstash.sdpa_replay.default, torch.ops.attnstash._replay_take.default)
            if func in takes and type(args[0]) is torch.Tensor:
                # (Compiled code passes detached inputs: keep through a detached alias that
                # requires grad, which has the anchor's data pointer, version and shape.)
                anchor_alias = args[3].detach().requires_grad_()
                with torch.no_grad():
                    torch.ops.attnstash.sdpa_fwd_keep.default(*args[:3], anchor_alias, *args[4:])
                real_calls += 1
            return func(*args, **(kwargs or {}))

    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), anchor, 0,
            None, 0.0, True, None, False)
    with Refill():
        torch.library.opcheck(torch.ops.attnstash.sdpa_replay.default, args, test_utils=test_util)
    assert real_calls >= (1 if test_util in ("test_schema", "test_aot_dispatch_dynamic") else 0)
    assert attnstash.stash_stats()["entries"] == 0


def test_compiled_fullgraph_call_matches_eager():
    torch.manual_seed(0)
    q, k, v = (t.detach().requires_grad_() for t in qkv(torch.float32, 8, 2, 64))

    def attention(q, k, v, anchor):
        return ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True).sum(dim=1)

    anchor = torch.randn(3)
    eager = attention(q, k, v, anchor)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v, anchor)
    assert torch.equal(eager, compiled)
    g = torch.randn_like(eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(eager, (q, k, v), g),
                                                 torch.autograd.grad(compiled, (q, k, v), g)))


# ---- inputs F.sdpa refuses get PyTorch's own words --------------------------------------------

REFUSED_BY_FSDPA = [  # from q, k, v [2, 4, 8, 16]: (q, k, v, mask, kwargs) F.sdpa refuses, and a piece of its error
    pytest.param(lambda q, k, v: (q, k.bfloat16(), v, None, {}),
                 "Expected query, key, and value to have the same dtype", id="dtypes differ"),
    pytest.param(lambda q, k, v: (torch.randn(2, 6, 8, 16), k, v, None, {"enable_gqa": True}),
                 "must divide the number of heads", id="heads do not divide"),
    pytest.param(lambda q, k, v: (q, torch.randn(2, 4, 8, 32), v, None, {}),
                 "Expected size for first two dimensions of batch2", id="head_dim differs"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(2, 1, 9, 8), {}), "9", id="mask shape"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(2, 1, 8, 8, dtype=torch.int32), {}),
                 "Expected attn_mask dtype to be bool or float", id="mask dtype"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(3, 5, dtype=torch.bool), {}),
                 "must match the size", id="bool mask of a shape that does not broadcast"),
    pytest.param(lambda q, k, v: (q.long(), k.long(), v.long(), None, {}), "dtype", id="integer dtype"),
]


@pytest.mark.parametrize("refused,words", REFUSED_BY_FSDPA)
def test_inputs_fsdpa_refuses_get_its_own_error_when_kept(refused, words):
    torch.manual_seed(0)
    q, k, v, mask, kwargs = refused(*(torch.randn(2, 4, 8, 16) for _ in range(3)))
    with pytest.raises(RuntimeError) as plain:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    assert words in str(plain.value)
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(q, k, v, anchor_for(q.float()), 0, mask, **kwargs))
    assert msg == str(plain.value)  # F.sdpa's own error, word for word
    assert attnstash.stash_stats()["entries"] == 0


def test_a_nan_scale_replays_without_a_false_mismatch():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, scale=float("nan"))
        replayed = ops.sdpa_replay(q, k, v, anchor, 0, scale=float("nan"))
    assert replayed.data_ptr() == kept.data_ptr() and kept.isnan().all()


def test_a_mask_that_requires_grad_in_a_reentrant_checkpoint_gets_the_mask_error():
    block = Block(64, 4, 4, 16, torch.float32, False, use_stash=True)
    x = torch.randn(2, 8, 64, requires_grad=True)
    mask = torch.zeros(2, 1, 8, 8, requires_grad=True)
    msg = error_of(lambda: checkpoint(block, x, mask, use_reentrant=True))
    assert "attn_mask requires grad" in msg and "detach" in msg


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_query_gets_a_clear_error_when_kept(layout):
    nt = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 7, 16)],
                                    layout=torch.jagged if layout == "jagged" else torch.strided)
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(nt, nt, nt, torch.randn(3, requires_grad=True), 0))
    assert "nested" in msg and "dense" in msg


def test_a_mask_that_requires_grad_only_in_the_recompute_is_refused_there():
    # A learned bias folded into the mask: under a reentrant checkpoint's first forward (no
    # grad) it looks like any mask; in the recompute it requires grad, and the kept path
    # would give it none.
    torch.manual_seed(0)
    block = Block(64, 4, 4, 16, torch.float32, False, use_stash=True)
    bias = torch.nn.Parameter(torch.zeros(1, 1, 8, 8))
    x = torch.randn(2, 8, 64, requires_grad=True)

    def biased(x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 16).transpose(1, 2) for p in (block.q, block.k, block.v))
        return ops.sdpa_fwd_keep(q, k, v, x, 0, bias * 1.0).sum()

    y = checkpoint(biased, x, use_reentrant=True)
    msg = error_of(lambda: y.backward())
    assert "attn_mask requires grad" in msg and "no gradient" in msg and "kept output has been released" in msg
    assert attnstash.stash_stats()["entries"] == 0
