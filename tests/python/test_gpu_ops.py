"""The ops on CUDA with cuDNN attention, at a scaled-down Qwen3-30B-A3B attention
shape. Skipped without a GPU; run on the GPU machine by tests/gpu/run.sh.

cuDNN accumulates dQ non-deterministically (two autograd runs on the same inputs give
different dQ), so dQ is bounded by autograd's own error against an fp32 reference;
the output, dK and dV are compared bitwise."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import attnstash
from attnstash import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDNN = SDPBackend.CUDNN_ATTENTION


def hf_layout(batch, heads, seq, head_dim, dtype=torch.bfloat16):
    t = torch.randn(batch, seq, heads * head_dim, device="cuda", dtype=dtype)
    return t.view(batch, seq, heads, head_dim).transpose(1, 2)


def qkv(d, batch=2, seq=256, hq=8, hkv=2):
    torch.manual_seed(0)
    return hf_layout(batch, hq, seq, d), hf_layout(batch, hkv, seq, d), hf_layout(batch, hkv, seq, d)


def replay_grads(q, k, v, g, causal):
    """Keep (first forward), then replay under grad inside a backward-like context: the
    replay node's gradients, through sdpa_replay's autograd."""
    anchor = torch.randn(4, device="cuda", requires_grad=True)
    with torch.no_grad():
        kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=causal, enable_gqa=True)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out = ops.sdpa_replay(qr, kr, vr, anchor, 0, is_causal=causal, enable_gqa=True)
    return kept, out, torch.autograd.grad(out, (qr, kr, vr), g)


def autograd_grads(q, k, v, g, causal):
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qa, ka, va, is_causal=causal, enable_gqa=True)
    return out, torch.autograd.grad(out, (qa, ka, va), g)


def fp32_reference(q, k, v, g, causal):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
    return torch.autograd.grad(out, (qf, kf, vf), g.float())


def test_cudnn_is_the_backend_under_test():
    q, k, v = qkv(128)
    with sdpa_kernel([CUDNN]):
        assert torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True) == CUDNN.value


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_keep_and_replay_match_autograd(d, causal):
    q, k, v = qkv(d)
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    with sdpa_kernel([CUDNN]):
        kept, replayed, (dq, dk, dv) = replay_grads(q, k, v, g, causal)
        runs = [autograd_grads(q, k, v, g, causal) for _ in range(5)]
    assert attnstash.stash_stats()["entries"] == 0
    ref_out, (ref_dq, ref_dk, ref_dv) = runs[0]
    assert torch.equal(kept, ref_out) and torch.equal(replayed, ref_out)
    assert torch.equal(dk, ref_dk) and torch.equal(dv, ref_dv)
    exact = fp32_reference(q, k, v, g, causal)[0]
    autograd_err = max((r[1][0].float() - exact).abs().max().item() for r in runs)
    replay_err = (dq.float() - exact).abs().max().item()
    assert replay_err <= autograd_err, (replay_err, autograd_err)


class Block(torch.nn.Module):
    def __init__(self, hidden=1024, hq=8, hkv=2, d=128, use_stash=True):
        super().__init__()
        self.hq, self.hkv, self.d, self.use_stash = hq, hkv, d, use_stash
        self.q = torch.nn.Linear(hidden, hq * d, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * hkv * d, bias=False)
        self.o = torch.nn.Linear(hq * d, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.use_stash:
            a = ops.sdpa_fwd_keep(q, k, v, x, 0, is_causal=True, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def test_reentrant_checkpoint_on_cuda_keeps_once_and_replays_once():
    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = attnstash.stash_stats()
    with sdpa_kernel([CUDNN]):
        y = checkpoint(block, x, use_reentrant=True)
        mid = attnstash.stash_stats()
        y.float().square().mean().backward()
    after = attnstash.stash_stats()
    assert mid["entries"] == 1
    # output (bf16) + LSE (fp32, [B, H, S, 1]) + cuDNN's two 0-dim int64 philox tensors
    assert mid["bytes"] == 2 * 8 * 256 * 128 * 2 + 2 * 8 * 256 * 4 + 2 * 8
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["entries"] == 0
    block.use_stash = False
    x2 = x.detach().clone().requires_grad_()
    with sdpa_kernel([CUDNN]):
        y2 = checkpoint(block, x2, use_reentrant=True)
    assert torch.equal(y, y2)


def test_replay_rejects_a_query_on_another_device():
    q, k, v = qkv(64)
    anchor = torch.randn(4, device="cuda", requires_grad=True)
    with sdpa_kernel([CUDNN]), torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
        with pytest.raises(RuntimeError, match="query .* differs"):
            ops.sdpa_replay(q.cpu(), k, v, anchor, 0, is_causal=True, enable_gqa=True)
    assert attnstash.stash_stats()["entries"] == 0


def test_opcheck_on_cuda():
    q, k, v = (t.detach().requires_grad_() for t in qkv(64, seq=128))
    with sdpa_kernel([CUDNN]):
        torch.library.opcheck(torch.ops.attnstash.sdpa_fwd_keep.default,
                              (q, k, v, torch.randn(3, device="cuda"), 0, None, 0.0, True, None, True))
