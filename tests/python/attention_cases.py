"""What the op tests (test_sdpa_ops_*.py on CPU, test_gpu_ops.py on CUDA, test_compile.py)
build their attention calls from: query, key and value in Hugging Face's layout, padding
masks, an attention Block and a checkpointed training step through it, and error_of."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import attnstash
from attnstash import ops


def hf_layout(batch, heads, seq, head_dim, dtype, device="cpu"):
    """A [batch, heads, seq, head_dim] transposed view of a [batch, seq, heads*head_dim]
    projection, as Hugging Face passes query, key and value."""
    t = torch.randn(batch, seq, heads * head_dim, dtype=dtype, device=device)
    return t.view(batch, seq, heads, head_dim).transpose(1, 2)


def qkv(dtype, hq, hkv, d, batch=2, seq=48, device="cpu"):
    """Query with hq heads, key and value with hkv heads, each head d wide, in Hugging Face's layout."""
    return (hf_layout(batch, hq, seq, d, dtype, device), hf_layout(batch, hkv, seq, d, dtype, device),
            hf_layout(batch, hkv, seq, d, dtype, device))


def padding_mask(batch, seq, kind, dtype, device="cpu", key_room=0, pad_per_row=3):
    """A Hugging Face style 4-D mask [batch, 1, seq, seq], "bool" or "additive" (dtype's
    minimum where masked): causal, row b padded on the left by pad_per_row * b keys (each
    query still attends to itself). key_room > 0: a slice of a [batch, 1, seq, seq + key_room]
    mask, as Hugging Face slices its mask to the key length, so its row stride is seq + key_room."""
    room = (batch, 1, seq, seq + key_room)
    keep = torch.ones(room, dtype=torch.bool, device=device).tril()[..., :seq]
    for b in range(batch):
        keep[b, :, :, : pad_per_row * b] = False
        keep[b, :, torch.arange(seq), torch.arange(seq)] = True
    if kind == "bool":
        return keep
    return torch.zeros(room, dtype=dtype, device=device)[..., :seq].masked_fill_(~keep, torch.finfo(dtype).min)


class Block(torch.nn.Module):
    """x -> query and key/value projections -> attention -> output projection, plus x. The
    attention is F.sdpa, or (use_stash) attnstash's sdpa_fwd_keep anchored on x in `slot`;
    forward(x, mask=None): mask is F.sdpa's attn_mask. fused_kv: key and value come from one projection
    (as in the GPU tests), else each from its own. enable_gqa when hq != hkv."""

    def __init__(self, hidden, hq, hkv, d, dtype=None, causal=True, use_stash=True, slot=0, fused_kv=False):
        super().__init__()
        self.hq, self.hkv, self.d, self.causal, self.use_stash, self.slot = hq, hkv, d, causal, use_stash, slot
        self.fused_kv = fused_kv
        self.q = torch.nn.Linear(hidden, hq * d, bias=False, dtype=dtype)
        if fused_kv:
            self.kv = torch.nn.Linear(hidden, 2 * hkv * d, bias=False, dtype=dtype)
        else:
            self.k = torch.nn.Linear(hidden, hkv * d, bias=False, dtype=dtype)
            self.v = torch.nn.Linear(hidden, hkv * d, bias=False, dtype=dtype)
        self.o = torch.nn.Linear(hq * d, hidden, bias=False, dtype=dtype)

    def key_value(self, x):
        b, s, _ = x.shape
        if self.fused_kv:
            k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).unbind(2)
        else:
            k, v = self.k(x).view(b, s, self.hkv, self.d), self.v(x).view(b, s, self.hkv, self.d)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k, v = self.key_value(x)
        gqa = self.hq != self.hkv
        if self.use_stash:
            a = ops.sdpa_fwd_keep(q, k, v, x, self.slot, mask, is_causal=self.causal, enable_gqa=gqa)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=gqa)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def checkpointed_step(dtype, hq, hkv, d, causal, use_stash, reentrant=True, mask=None):
    """One seeded training step of a Block (hidden 64) on a [2, 40, 64] input, checkpointed
    (reentrant or not), with `mask` if given. Returns the loss, [x.grad] + the parameters'
    gradients, and attnstash.stash_stats() between the forward and the backward."""
    torch.manual_seed(0)
    block = Block(64, hq, hkv, d, dtype, causal, use_stash)
    x = torch.randn(2, 40, 64, dtype=dtype, requires_grad=True)
    y = checkpoint(block, x, mask, use_reentrant=reentrant)
    stats_after_forward = attnstash.stash_stats()
    loss = y.float().square().mean()
    loss.backward()
    return loss.detach(), [x.grad] + [p.grad for p in block.parameters()], stats_after_forward


def error_of(fn):
    """The message of the RuntimeError fn() must raise."""
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


def anchor_for(q):
    """An anchor (a layer input that requires grad) for a query of [batch, heads, seq, head_dim]."""
    return torch.randn(q.shape[0], q.shape[2], 16, requires_grad=True)
