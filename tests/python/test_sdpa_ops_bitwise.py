"""attnstash::sdpa_fwd_keep and attnstash::sdpa_replay on CPU give PyTorch's exact numbers: the
kept output is F.scaled_dot_product_attention's bit for bit, the gradients through reentrant and
non-reentrant checkpoints (GQA, an explicit scale, padding masks, saved-tensor hooks) are the
normal recompute's, and what is kept is the output and its log-sum-exp."""
import pytest
import torch
import torch.nn.functional as F

import attnstash
from attention_cases import anchor_for, checkpointed_step, padding_mask, qkv
from attnstash import ops

CASES = [  # dtype, query heads, kv heads, head_dim, causal
    (dtype, hq, hkv, d, causal)
    for dtype in (torch.float32, torch.bfloat16)
    for hq, hkv in ((8, 8), (8, 2))
    for d in (64, 128)
    for causal in (True, False)
]
CASE_IDS = [f"{str(c[0])[6:]}-{c[1]}q{c[2]}kv-d{c[3]}-{'causal' if c[4] else 'full'}" for c in CASES]


@pytest.mark.parametrize("dtype,hq,hkv,d,causal", CASES, ids=CASE_IDS)
def test_first_forward_output_is_bitwise_fsdpa(dtype, hq, hkv, d, causal):
    torch.manual_seed(0)
    q, k, v = qkv(dtype, hq, hkv, d)
    gqa = hq != hkv
    anchor = anchor_for(q)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 7, is_causal=causal, enable_gqa=gqa)
        assert attnstash.stash_stats()["keeps"] >= 1 and attnstash.stash_stats()["records"] == 1
        assert torch.equal(kept, expected) and kept.stride() == expected.stride()
        replayed = ops.sdpa_replay(q, k, v, anchor, 7, is_causal=causal, enable_gqa=gqa)
    assert replayed.data_ptr() == kept.data_ptr()  # the kept tensor itself, not a recomputation
    assert attnstash.stash_stats()["records"] == 0


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
    assert mid["records"] == 1 and mid["bytes"] > 0
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["records"] == 0 and after["bytes"] == 0


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


@pytest.mark.parametrize("dtype,hq,hkv,d,causal", CASES[::3], ids=CASE_IDS[::3])
def test_non_reentrant_checkpoint_gradients_are_bitwise_the_normal_recompute(dtype, hq, hkv, d, causal):
    base_loss, base_grads, _ = checkpointed_step(dtype, hq, hkv, d, causal, False, reentrant=False)
    before = attnstash.stash_stats()
    loss, grads, mid = checkpointed_step(dtype, hq, hkv, d, causal, True, reentrant=False)
    after = attnstash.stash_stats()
    assert mid["records"] == 1
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["records"] == 0


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
    assert attnstash.stash_stats()["records"] == 1
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), g)))
    assert attnstash.stash_stats()["records"] == 0


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


def test_a_nan_scale_replays_without_a_false_mismatch():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, scale=float("nan"))
        replayed = ops.sdpa_replay(q, k, v, anchor, 0, scale=float("nan"))
    assert replayed.data_ptr() == kept.data_ptr() and kept.isnan().all()
