"""Tiny models written in plain PyTorch, for the installer's tests: a nanoGPT-style decoder
that calls torch.utils.checkpoint.checkpoint itself, the same blocks wrapped by torch's
checkpoint_wrapper (torchtitan's way), and checkpointed two at a time (Pairs)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa_imported_by_name

VOCAB = 61


class Block(nn.Module):
    """Pre-norm attention and MLP. `calls`: attention calls per forward (of different scales,
    so that each is its own output); `dropout`: dropout before the projections (the random
    numbers a recompute must draw again); `by_name`: attention through a name bound at import."""

    def __init__(self, dim=32, heads=4, calls=1, dropout=0.0, by_name=False):
        super().__init__()
        self.heads, self.calls, self.dropout, self.by_name = heads, calls, dropout, by_name
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, mask=None):
        b, s, d = x.shape
        h = F.dropout(self.norm1(x), self.dropout, self.training)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attend = sdpa_imported_by_name if self.by_name else F.scaled_dot_product_attention
        out = sum(attend(q, k, v, attn_mask=mask, is_causal=mask is None, scale=(i + 1) / (d // self.heads) ** 0.5)
                  for i in range(self.calls))
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def _attend(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


ATTENTION_FUNCTIONS = {"sdpa": _attend}  # a module-level table of attention functions


class Projections(nn.Module):
    """The projections of the blocks below, which differ in how they attend (their forward)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)


class TableBlock(Projections):
    """Attention taken from a module-level table, as ModernBERT's is in transformers 4.57: this
    class's own code never names it."""

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = ATTENTION_FUNCTIONS["sdpa"](q, k, v, attn_mask=mask, is_causal=mask is None)
        return x + self.proj(out.transpose(1, 2).reshape(b, s, d))


attend_by_another_name = F.scaled_dot_product_attention  # a module-level alias


class AliasBlock(Projections):
    """Attention through a module-level alias of the attention function: this class's
    code names neither it nor a function of its module that calls it."""

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = attend_by_another_name(q, k, v, attn_mask=mask, is_causal=mask is None)
        return x + self.proj(out.transpose(1, 2).reshape(b, s, d))


class MatmulBlock(Projections):
    """Attention written out in matmuls, not F.scaled_dot_product_attention (which only this
    docstring and a comment below mention): nothing the stash can keep."""

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # the same as scaled_dot_product_attention(q, k, v), without the causal mask
        out = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
        return x + self.proj(out.transpose(1, 2).reshape(b, s, d))


class GPT(nn.Module):
    """Embedding, blocks, head. `checkpointing`: None, "reentrant" or "non-reentrant": its forward
    checkpoints each block itself (torch.utils.checkpoint.checkpoint(block, x)), as nanoGPT- and
    litgpt-style code does."""

    def __init__(self, layers=3, dim=32, heads=4, checkpointing="non-reentrant", preserve_rng_state=True,
                 block_class=Block, **block):
        super().__init__()
        self.checkpointing, self.preserve_rng_state = checkpointing, preserve_rng_state
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(block_class(dim, heads, **block) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x, mask)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=self.checkpointing == "reentrant",
                                                      preserve_rng_state=self.preserve_rng_state)
        return self.head(x)


class Pairs(nn.Module):
    """The GPT's four blocks checkpointed two at a time (one checkpoint around two blocks, as
    torch.utils.checkpoint.checkpoint_sequential's segments are)."""

    def __init__(self, mode):
        super().__init__()
        self.gpt = gpt(layers=4, checkpointing=None)
        self.mode = mode

    def forward(self, tokens, mask=None):
        x = self.gpt.embed(tokens)
        for first, second in zip(self.gpt.blocks[::2], self.gpt.blocks[1::2]):
            x = torch.utils.checkpoint.checkpoint(lambda h, a=first, b=second: b(a(h)), x,
                                                  use_reentrant=self.mode == "reentrant")
        return self.gpt.head(x)


def wrapped(model, mode="non-reentrant"):
    """The model's blocks (its ModuleList `blocks`) wrapped by torch's checkpoint_wrapper (the
    model itself then does not checkpoint)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                              apply_activation_checkpointing,
                                                                              checkpoint_wrapper)
    impl = CheckpointImpl.REENTRANT if mode == "reentrant" else CheckpointImpl.NO_REENTRANT
    model.checkpointing = None
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
                                   check_fn=lambda m: any(m is b for b in model.blocks))
    return model


def gpt(seed=0, **kwargs):
    torch.manual_seed(seed)
    return GPT(**kwargs).train()


def ids(seed=1, batch=2, seq=12):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, tokens, mask=None, seed=7):
    """One forward and backward (the random state fixed first): (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(tokens, mask).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
