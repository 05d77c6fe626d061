"""The model the benchmark and the demo train, and its inputs.

A Qwen3 decoder built from a config (random weights, no download) with
attn_implementation="sdpa". Shapes: input_ids [batch, seq]; hidden states
[batch, seq, hidden]; query [batch, heads, seq, head_dim]; key and value
[batch, kv_heads, seq, head_dim].

Presets: "demo" is the small model examples/demo.py (make demo) trains on CPU in fp32;
"qwen3-30b-a3b" has Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128,
hidden 2048) at sequence 4096, micro-batch 4, bf16, for a GPU, with a dense MLP as wide as
its 8 active experts (8 x 768) and a smaller vocabulary, so that the few layers, not the
LM head, dominate the step; "tiny" is for the soak and quick checks.

Mixed precision: a Shape with `amp` set ("bfloat16" or "float16") keeps float32 weights and
runs every forward under torch.autocast(device, dtype=amp): the attention then runs, and the
stash keeps, in the autocast dtype (the ops cast their inputs as F.sdpa does).

What the stash keeps and which SDPA ops it runs are attnstash.backends' table, not formulas
written here: sac_ops() lists the rows' forward ops, kept_bytes_per_layer() evaluates a row's
forward on meta tensors.
"""
import contextlib
import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from attnstash import backends

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AMP = {"bf16": "bfloat16", "fp16": "float16"}  # the --amp spellings

PRESETS = {
    "demo": dict(vocab=256, hidden=128, intermediate=256, layers=4, heads=8, kv_heads=2, head_dim=32, seq=1024,
                 batch=1, dtype="float32", device="cpu", repeats=10, warmup=2),
    "qwen3-30b-a3b": dict(vocab=32768, hidden=2048, intermediate=6144, layers=4, heads=32, kv_heads=4,
                          head_dim=128, seq=4096, batch=4, dtype="bfloat16", device="cuda", repeats=10, warmup=3),
    "tiny": dict(vocab=256, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, seq=256,
                 batch=2, dtype="float32", device="cpu", repeats=3, warmup=1),
}


@dataclasses.dataclass
class Shape:
    """A Qwen3 decoder and its micro-batch: input_ids [batch, seq]; attention with `heads`
    query heads and `kv_heads` key/value heads of `head_dim`; an MLP of `intermediate`.
    `dtype` is the weights'; `amp` (None, "bfloat16" or "float16") the autocast dtype the
    forwards run under."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    batch: int
    dtype: str
    device: str
    amp: Optional[str] = None

    @property
    def torch_dtype(self):
        """The weights' dtype."""
        return DTYPES[self.dtype]

    @property
    def compute_dtype(self):
        """The dtype attention runs in: the autocast dtype under amp, else the weights'."""
        return DTYPES[self.amp or self.dtype]

    def autocast(self):
        """The context the forwards run in: torch.autocast for amp, else nothing."""
        return autocast(self.device, self.amp)

    def describe(self):
        precision = f"{self.dtype} weights under autocast {self.amp}" if self.amp else self.dtype
        return (f"{self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, {self.heads} query / "
                f"{self.kv_heads} KV heads x {self.head_dim}, vocab {self.vocab}, micro-batch {self.batch} x "
                f"seq {self.seq}, {precision} on {self.device}")


def autocast(device, amp):
    """torch.autocast on this device's type in dtype `amp` (a DTYPES name or a torch.dtype);
    a context that does nothing for None."""
    if amp is None:
        return contextlib.nullcontext()
    dtype = DTYPES[amp] if isinstance(amp, str) else amp
    return torch.autocast(torch.device(device).type, dtype=dtype)


def make_shape(preset="demo", **overrides):
    """The preset's Shape with the given fields replaced (None means keep). Without an explicit
    `intermediate`, a new `hidden` scales the MLP width by the preset's ratio; without an
    explicit `dtype`, a CUDA device gets bfloat16 where the preset is CPU fp32 (cuDNN, the
    attention the stash keeps on CUDA, runs only fp16/bf16), and amp ("bf16", "fp16" or a
    DTYPES name) gets float32 weights."""
    base = {k: v for k, v in PRESETS[preset].items() if k in {f.name for f in dataclasses.fields(Shape)}}
    given = {k: v for k, v in overrides.items() if v is not None}
    if "amp" in given:
        given["amp"] = AMP.get(given["amp"], given["amp"])
        if given["amp"] not in ("bfloat16", "float16"):
            raise ValueError(f"amp must be bf16 or fp16, got {overrides['amp']!r}")
        if given.get("dtype", "float32") != "float32":
            raise ValueError("amp trains float32 weights under autocast: leave the dtype at float32")
        given["dtype"] = "float32"
    if "hidden" in given and "intermediate" not in given:
        given["intermediate"] = max(1, round(given["hidden"] * base["intermediate"] / base["hidden"]))
    if given.get("device", base["device"]) == "cuda" and "dtype" not in given and base["dtype"] == "float32":
        given["dtype"] = "bfloat16"
    shape = Shape(**{**base, **given})
    if shape.heads % shape.kv_heads:
        raise ValueError(f"--heads {shape.heads} must be a multiple of --kv-heads {shape.kv_heads}")
    return shape


def build_model(shape, seed=0):
    """A Qwen3ForCausalLM for `shape` with seeded random weights, on its device, in training
    mode, with no checkpointing yet. The same seed gives bitwise the same weights."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=max(shape.seq, 64), use_cache=False,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=shape.torch_dtype)
    model.to(shape.device)
    model.train()
    return model


def sac_ops(device):
    """The SDPA ops selective activation checkpointing must save: the fused forward op of
    every backend the stash keeps on this device type (attnstash.backends.KEPT_BACKENDS), so
    that SAC saves what the stash keeps."""
    kind = torch.device(device).type
    return [row.forward_op for row in backends.KEPT_BACKENDS if row.device == kind and row.forward_op is not None]


def enable_checkpointing(model, kind):
    """kind: "reentrant", "non-reentrant", "sac" (non-reentrant with selective activation
    checkpointing saving the SDPA ops) or "none"."""
    if kind == "none":
        model.gradient_checkpointing_disable()
    elif kind == "reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif kind == "non-reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif kind == "sac":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        policy = functools.partial(create_selective_checkpoint_contexts, sac_ops(model.device))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": policy})
    else:
        raise ValueError(f"unknown checkpointing kind {kind!r}")
    return model


def random_batch(shape, seed=1):
    """input_ids [batch, seq] of random tokens, on the shape's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(shape.device)


def padding_mask(shape, pad):
    """attention_mask [batch, seq] (1 = token, 0 = padding) for a padded batch: row i is
    left-padded by i/(batch-1) * pad * seq tokens, so the rows have different lengths and
    the first has none. None when pad is 0 (then Hugging Face builds no mask)."""
    if not pad:
        return None
    mask = torch.ones(shape.batch, shape.seq, dtype=torch.long)
    for row in range(1, shape.batch):
        mask[row, : round(pad * shape.seq * row / max(1, shape.batch - 1))] = 0
    return mask.to(shape.device)


def training_step(model, input_ids, after_forward=None, attention_mask=None, amp=None):
    """Forward and backward of one micro-batch; input_ids [batch, seq] are also the labels
    (Hugging Face shifts them; padding, where attention_mask is 0, is not scored). The
    forward runs under torch.autocast in dtype `amp` when given (the backward outside it, as
    torch recommends; checkpoint recomputes restore the autocast state themselves).
    after_forward() runs between the two (the stash holds its entries then). Returns the
    loss, detached. No optimizer step."""
    labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
    with autocast(input_ids.device, amp):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    if after_forward is not None:
        after_forward()
    loss.backward()
    return loss.detach()


def zero_grads(model):
    for p in model.parameters():
        p.grad = None


# ---- attention at the layer's shape ----------------------------------------------------------

def attention_inputs(shape, requires_grad=True, seed=2, device=None):
    """q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim] in the
    compute dtype, each a transposed view of a [batch, seq, heads * head_dim] projection, as
    Hugging Face passes them. device="meta" gives shapes only (nothing allocated)."""
    device = device or shape.device
    if device == "meta":
        def projection(heads):
            t = torch.empty(shape.batch, shape.seq, heads * shape.head_dim, device="meta", dtype=shape.compute_dtype)
            return t.view(shape.batch, shape.seq, heads, shape.head_dim).transpose(1, 2)
        return projection(shape.heads), projection(shape.kv_heads), projection(shape.kv_heads)
    g = torch.Generator().manual_seed(seed)

    def projection(heads):
        t = torch.randn(shape.batch, shape.seq, heads * shape.head_dim, generator=g, dtype=torch.float32)
        t = t.to(device=device, dtype=shape.compute_dtype)
        t = t.view(shape.batch, shape.seq, heads, shape.head_dim).transpose(1, 2)
        return t.requires_grad_(requires_grad)

    return projection(shape.heads), projection(shape.kv_heads), projection(shape.kv_heads)


def _sdpa_flags(shape):
    return dict(is_causal=True, scale=shape.head_dim ** -0.5, enable_gqa=shape.heads != shape.kv_heads)


def attention_forward(shape, q, k, v):
    """The call Hugging Face's sdpa entry makes for a causal, unmasked decoder layer."""
    return F.scaled_dot_product_attention(q, k, v, **_sdpa_flags(shape))


def sdpa_backend(shape):
    """The name of the SDPA backend F.scaled_dot_product_attention picks at this shape in
    training (inputs requiring grad, in the compute dtype): FLASH_ATTENTION on CPU is the
    CPU flash kernel."""
    q, k, v = attention_inputs(shape, requires_grad=True)
    return backends.chosen_backend(q, k, v, None, 0.0, **_sdpa_flags(shape)).name


def kept_bytes_per_layer(shape, backend=None):
    """(bytes, description) the stash keeps for one layer and micro-batch, or (None, why)
    for a backend it cannot keep: the output, log-sum-exp and extras the kept backend's forward
    returns (attnstash.backends, as torch_ops/stash_entries.cpp counts them), each with the shape
    PyTorch's meta function gives it.

    backend None: the backend F.sdpa picks at this shape on this device. A backend name
    ("CUDNN_ATTENTION", "FLASH_ATTENTION", ...): that backend's row for this device type, to
    predict for a device this machine lacks."""
    from torch.nn.attention import SDPBackend
    flags = _sdpa_flags(shape)
    name = backend or sdpa_backend(shape)
    choice = getattr(SDPBackend, name, None)
    row = None if choice is None else backends.kept_backend(shape.device, choice)
    if row is None:
        return None, f"the stash does not keep the {name} backend on {shape.device}"
    q, k, v = attention_inputs(shape, device="meta")
    out, lse, extras = row.forward(q, k, v, None, flags["is_causal"], flags["scale"])
    names = ("output", "log-sum-exp") + row.extra_names + tuple(
        f"extra {i}" for i in range(len(row.extra_names), len(extras)))
    named = [(n, t) for n, t in zip(names, [out, lse, *extras]) if isinstance(t, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for _, t in named)
    terms = " + ".join(f"{n} {list(t.shape)} {str(t.dtype)[6:]} ({t.numel() * t.element_size():,})"
                       for n, t in named)
    return total, f"per layer = {terms} = {total:,} bytes ({row.name}; shapes from PyTorch's meta functions)"
