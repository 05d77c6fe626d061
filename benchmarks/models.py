"""The decoder the benchmark and the demo train, checkpointing, inputs and predictions.

A Qwen3 decoder (transformers, attn_implementation="sdpa", random weights, no download) for a
Shape. Presets: "demo" (examples/demo.py's, on CPU); "qwen3-30b-a3b" (Qwen3-30B-A3B's attention,
32 query / 4 KV heads of 128, hidden 2048, at sequence 4096, micro-batch 4, bf16, a dense MLP
as wide as its 8 active experts, for a GPU); "tiny". Dtypes are the planner's: bf16, fp16, fp32;
amp trains fp32 weights under torch.autocast. What the stash keeps is predicted by attnstash.plan
on the model itself; the attention forward alone is timed at the shape of the call it recorded.
"""
import contextlib
import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from attnstash import backends
from attnstash.planner.arguments import DTYPES as _DTYPES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHORT = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(value):
    """"bf16", "fp16" or "fp32" for any spelling the planner accepts (bfloat16, half, ...)."""
    dtype = _DTYPES.get(str(value).lower().replace("torch.", "")) if not isinstance(value, torch.dtype) else value
    if dtype not in _SHORT:
        raise ValueError(f"a dtype must be bf16, fp16 or fp32, got {value!r}")
    return _SHORT[dtype]


PRESETS = {
    "demo": dict(vocab=256, hidden=128, intermediate=256, layers=4, heads=8, kv_heads=2, head_dim=32, seq=1024,
                 batch=1, dtype="fp32", device="cpu", repeats=10, warmup=2),
    "qwen3-30b-a3b": dict(vocab=32768, hidden=2048, intermediate=6144, layers=4, heads=32, kv_heads=4,
                          head_dim=128, seq=4096, batch=4, dtype="bf16", device="cuda", repeats=10, warmup=3),
    "tiny": dict(vocab=256, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, seq=256,
                 batch=2, dtype="fp32", device="cpu", repeats=3, warmup=1),
}


@dataclasses.dataclass
class Shape:
    """A Qwen3 decoder and its micro-batch. `dtype`: the weights'; `amp`: None or the autocast
    dtype the forwards run under (then the weights are fp32)."""
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
    def compute_dtype(self):
        """The dtype attention runs in."""
        return DTYPES[self.amp or self.dtype]

    def autocast(self):
        return autocast(self.device, self.amp)

    def describe(self):
        precision = f"fp32 weights under autocast {self.amp}" if self.amp else self.dtype
        return (f"{self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, {self.heads} query / "
                f"{self.kv_heads} KV heads x {self.head_dim}, vocab {self.vocab}, micro-batch {self.batch} x "
                f"seq {self.seq}, {precision} on {self.device}")


def autocast(device, amp):
    """torch.autocast on the device's type in dtype `amp` (a DTYPES name); nothing for None."""
    return contextlib.nullcontext() if amp is None else torch.autocast(torch.device(device).type, DTYPES[amp])


def make_shape(preset="demo", **overrides):
    """The preset's Shape with the given fields replaced (None: keep). A new `hidden` without
    `intermediate` scales the MLP by the preset's ratio; CUDA without a dtype gets bf16 where the
    preset is fp32 (the attention the stash keeps on CUDA runs bf16/fp16); amp needs fp32 weights."""
    base = {k: v for k, v in PRESETS[preset].items() if k in {f.name for f in dataclasses.fields(Shape)}}
    given = {k: v for k, v in overrides.items() if v is not None}
    for key in ("dtype", "amp"):
        if key in given:
            given[key] = dtype_name(given[key])
    if given.get("amp") == "fp32":
        del given["amp"]
    if "amp" in given:
        if given.setdefault("dtype", "fp32") != "fp32":
            raise ValueError("amp trains fp32 weights under autocast: leave the dtype at fp32")
    if "hidden" in given and "intermediate" not in given:
        given["intermediate"] = max(1, round(given["hidden"] * base["intermediate"] / base["hidden"]))
    if given.get("device", base["device"]) == "cuda" and "dtype" not in given and base["dtype"] == "fp32":
        given["dtype"] = "bf16"
    shape = Shape(**{**base, **given})
    if shape.heads % shape.kv_heads:
        raise ValueError(f"--heads {shape.heads} must be a multiple of --kv-heads {shape.kv_heads}")
    return shape


def build_model(shape, seed=0):
    """A Qwen3ForCausalLM with seeded random weights (the same seed: bitwise the same), in train
    mode on the shape's device, not checkpointed yet."""
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=max(shape.seq, 64), use_cache=False,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=DTYPES[shape.dtype])
    return model.to(shape.device).train()


def sac_ops(device):
    """The SDPA ops selective activation checkpointing saves: the fused forward of every backend
    the stash keeps on this device type (attnstash.backends), so that SAC saves what the stash keeps."""
    kind = torch.device(device).type
    return [row.forward_op for row in backends.KEPT_BACKENDS if row.device == kind and row.forward_op is not None]


def enable_checkpointing(model, kind, offload=False):
    """kind: "none", "reentrant", "non-reentrant" or "sac" (non-reentrant, selective activation
    checkpointing saving the SDPA ops), for a transformers model (gradient_checkpointing_enable)
    or a diffusers one (enable_gradient_checkpointing: its own default is non-reentrant).
    `offload`: transformers' own offloading of what the checkpoints save (offload=True)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    if kind not in ("none", "reentrant", "non-reentrant", "sac"):
        raise ValueError(f"unknown checkpointing kind {kind!r}")
    kwargs = {"use_reentrant": kind == "reentrant"}
    if kind == "sac":
        device = next(model.parameters()).device
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, sac_ops(device))
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"  # transformers 5.24
    if hasattr(model, f"{prefix}_checkpointing_enable"):  # transformers
        if kind == "none":
            getattr(model, f"{prefix}_checkpointing_disable")()
        else:
            getattr(model, f"{prefix}_checkpointing_enable")(kwargs, **({"offload": True} if offload else {}))
    elif kind == "none":  # diffusers
        model.disable_gradient_checkpointing()
    elif kind == "non-reentrant":
        model.enable_gradient_checkpointing()
    else:
        model.enable_gradient_checkpointing(lambda module, *args: checkpoint(module.__call__, *args, **kwargs))
    return model


def random_batch(shape, seed=1):
    """input_ids [batch, seq] of random tokens on the shape's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(shape.device)


def padding_mask(shape, pad):
    """attention_mask [batch, seq] (0 = padding) with row i left-padded by i/(batch-1) * pad * seq
    tokens; None for pad 0 (then Hugging Face builds no mask)."""
    if not pad:
        return None
    mask = torch.ones(shape.batch, shape.seq, dtype=torch.long)
    for row in range(1, shape.batch):
        mask[row, : round(pad * shape.seq * row / max(1, shape.batch - 1))] = 0
    return mask.to(shape.device)


# ---- predictions and the attention forward the stash skips ----------------------------------

def plan(model, shape=None, padded=False, dtype=None, **inputs):
    """attnstash.plan of the model for the shape's micro-batch (or these example inputs), in the
    dtype attention runs in."""
    import attnstash
    if shape is not None:
        return attnstash.plan(model, batch_size=shape.batch, seq_len=shape.seq, dtype=shape.compute_dtype,
                              padded=padded)
    return attnstash.plan(model, example_kwargs=inputs, dtype=dtype)


def describe_call(call):
    """The planner's bytes for one call, term by term."""
    return (f"output {call.output_bytes:,} + log-sum-exp {call.logsumexp_bytes:,} + extras {call.extra_bytes:,} = "
            f"{call.bytes:,} bytes ({call.backend.name}, q {list(call.query)}, k/v {list(call.key)})")


def attention_forward(call, device, dtype, seed=2):
    """A function running F.scaled_dot_product_attention as `call` (a planner CallPlan) ran, q,
    k, v requiring grad, each a transposed view of a [batch, seq, heads, head_dim] projection as
    transformers and diffusers pass them (a mask of ones where it had one): what a recompute runs."""
    g = torch.Generator(device=device).manual_seed(seed)

    def projection(b, h, s, d):
        return torch.randn(b, s, h, d, generator=g, device=device).to(dtype).transpose(1, 2).requires_grad_()

    q, k, v = projection(*call.query), projection(*call.key), projection(*call.value)
    mask = None if call.mask is None else torch.ones(call.mask[0], dtype=getattr(torch, call.mask[1]), device=device)
    return lambda: F.scaled_dot_product_attention(q, k, v, mask, is_causal=call.is_causal, enable_gqa=call.enable_gqa)
