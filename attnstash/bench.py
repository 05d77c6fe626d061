"""python -m attnstash.bench: what the attention stash saves, what it costs, and that it
changes nothing.

Every mode builds a Qwen3 decoder from a config (random weights, no download) with
attn_implementation="sdpa" and trains it on random token ids (the ids are also the labels).
Shapes: input_ids [batch, seq]; hidden states [batch, seq, hidden]; query
[batch, heads, seq, head_dim]; key and value [batch, kv_heads, seq, head_dim].

--mode model (the default)
    One training step of the whole model (forward and backward of one micro-batch; no
    optimizer) for each configuration, all in one process and INTERLEAVED: every round runs
    each configuration once, the order rotates from round to round, the warm-up rounds are
    dropped, and medians are reported. Each configuration has its own deep copy of one model,
    so all start from the same weights and see the same batch. The configurations:

      no checkpointing          nothing is recomputed: the time bound, the memory ceiling
      reentrant                 Hugging Face reentrant checkpointing: the baseline
      reentrant, wrapped        the same, with the stash installed on ANOTHER model, so this
                                model's attention goes through the stash's wrapper of the "sdpa"
                                entry and takes its plain path: the cost of stashing 0 layers
      stash k                   reentrant + the stash on the last k decoder layers
      SAC                       non-reentrant checkpointing with selective activation
                                checkpointing saving the SDPA op's outputs (the peer approach,
                                which reentrant checkpointing cannot use)
      non-reentrant             plain non-reentrant checkpointing: separates what SAC saves
                                from what non-reentrant checkpointing itself costs or saves
      non-reentrant, stash L    non-reentrant checkpointing + the stash on every layer: the
                                stash next to SAC, at the same memory (compare with both)

    The stash is installed before its configuration's step and uninstalled after it (outside
    the timed region), so the other configurations run Hugging Face's own "sdpa" entry.

    Measurements:
      step ms        wall time of forward + backward. CPU: time.perf_counter. CUDA: CUDA events
                     around the step, read after synchronising. Python's garbage collector
                     collects its young generations before, and is off during, each timed step.
      attention ms   one F.scaled_dot_product_attention call at the layer's shape, q/k/v in
                     Hugging Face's layout (transposed views of the projections) requiring
                     grad, grad mode on: the call a layer's recompute makes and the stash skips.
                     Timed in the same rounds (several calls a round), median of all.
      efficiency k   (reentrant ms - stash k ms) / (k * attention ms): the share of k attention
                     forwards the step actually saved; 1.0 is the physical limit.
      kept bytes     the stash's own accounting: peak_bytes during the step (reset before it).
      predicted      k * (output bytes + log-sum-exp bytes [+ cuDNN's two 8-byte philox
                     scalars]) for this shape and backend; the formula is printed. (CUDA flash
                     and memory-efficient attention: the kept outputs' sizes as PyTorch's meta
                     functions give them.)
      peak memory    bytes of live tensors at the step's peak, above what was live when the
                     step began (so the weights of all model copies are excluded, this model's
                     gradients included: they are set to None before every step).
                     CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(),
                     minus memory_allocated() at the start.
                     CPU: PyTorch's profiler with profile_memory=True records every allocation
                     and free of the CPU allocator with its size and time; the maximum of their
                     running sum is the peak. It is exact and repeatable (the same number on every
                     run), which process RSS is not: glibc keeps freed blocks, other threads
                     allocate, and RSS never shows a transient peak that was given back.
                     Counting tensors saved for backward with saved_tensors_hooks is not an
                     option: it misses every temporary, and such hooks change what the stash
                     does (they mark a non-reentrant checkpoint's first forward). The profiled
                     step is a separate, untimed one.
      loss           every step of every configuration computes the loss of the same batch from
                     the same weights: they are compared bitwise (and the largest difference
                     printed); the gradients of each configuration's check step are compared
                     with the baseline's (largest difference relative to the largest gradient),
                     next to the noise floor: a second baseline step against the first (on CUDA
                     cuDNN's dQ is not deterministic, so no two runs agree bitwise there).

--mode layer
    One decoder layer (its input [batch, seq, hidden] requires grad, a fixed output gradient)
    forward + backward under reentrant checkpointing, without and with the stash, interleaved:
    the milliseconds saved per stashed layer and micro-batch, against the attention forward
    at that shape, and the SDPA backend torch picked for it.

--mode soak
    A few hundred steps of a tiny model with a random number of micro-batches per step, some
    forwards dropped without a backward, the occasional no-grad forward, and the number of
    stashed layers changed between steps (uninstall + install). After every step the stash
    must hold 0 entries and 0 bytes (asserted). Process RSS (psutil) is recorded per step:
    first, last, maximum, and the least-squares slope over the second half (bytes/step).

Output: a table on stdout and, under --out, bench.json (every raw timing) and bench.png
(model mode), layer.json (layer mode), soak.json (soak mode).

Presets: "demo" is the small model examples/demo.py (make demo) trains on CPU in fp32;
"qwen3-30b-a3b" has Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128,
hidden 2048) at sequence 4096, micro-batch 4, bf16, for a GPU, with a dense MLP as wide as
its 8 active experts (8 x 768) and a smaller vocabulary, so that the few layers, not the
LM head, dominate the step; "tiny" is for the soak and quick checks.
"""
import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnstash
from attnstash import ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PRESETS = {
    "demo": dict(vocab=256, hidden=128, intermediate=256, layers=4, heads=8, kv_heads=2, head_dim=32, seq=1024,
                 batch=1, dtype="float32", device="cpu", repeats=10, warmup=2),
    "qwen3-30b-a3b": dict(vocab=32768, hidden=2048, intermediate=6144, layers=4, heads=32, kv_heads=4,
                          head_dim=128, seq=4096, batch=4, dtype="bfloat16", device="cuda", repeats=10, warmup=3),
    "tiny": dict(vocab=256, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, seq=256,
                 batch=2, dtype="float32", device="cpu", repeats=3, warmup=1),
}


# ---- the model ---------------------------------------------------------------------------

@dataclasses.dataclass
class Shape:
    """A Qwen3 decoder and its micro-batch: input_ids [batch, seq]; attention with `heads`
    query heads and `kv_heads` key/value heads of `head_dim`; an MLP of `intermediate`."""
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

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    def describe(self):
        return (f"{self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, {self.heads} query / "
                f"{self.kv_heads} KV heads x {self.head_dim}, vocab {self.vocab}, micro-batch {self.batch} x "
                f"seq {self.seq}, {self.dtype} on {self.device}")


def make_shape(preset="demo", **overrides):
    """The preset's Shape with the given fields replaced (None means keep). Without an explicit
    `intermediate`, a new `hidden` scales the MLP width by the preset's ratio; without an
    explicit `dtype`, a CUDA device gets bfloat16 where the preset is CPU fp32 (cuDNN, the
    attention the stash keeps on CUDA, runs only fp16/bf16)."""
    base = {k: v for k, v in PRESETS[preset].items() if k in {f.name for f in dataclasses.fields(Shape)}}
    given = {k: v for k, v in overrides.items() if v is not None}
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
    """The SDPA ops selective activation checkpointing must save: the fused forward ops
    F.scaled_dot_product_attention dispatches to on this device."""
    aten = torch.ops.aten
    if torch.device(device).type == "cpu":
        names = ["_scaled_dot_product_flash_attention_for_cpu"]
    else:
        names = ["_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention"]
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def enable_checkpointing(model, kind):
    """kind: "reentrant" (what the stash needs), "non-reentrant", "sac" (non-reentrant with
    selective activation checkpointing saving the SDPA ops) or "none"."""
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


def training_step(model, input_ids, after_forward=None, attention_mask=None):
    """Forward and backward of one micro-batch; input_ids [batch, seq] are also the labels
    (Hugging Face shifts them; padding, where attention_mask is 0, is not scored).
    after_forward() runs between the two (the stash holds its entries then). Returns the
    loss, detached. No optimizer step."""
    labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    if after_forward is not None:
        after_forward()
    loss.backward()
    return loss.detach()


def zero_grads(model):
    for p in model.parameters():
        p.grad = None


# ---- attention at the layer's shape ----------------------------------------------------------

def attention_inputs(shape, requires_grad=True, seed=2):
    """q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim], each a
    transposed view of a [batch, seq, heads * head_dim] projection, as Hugging Face passes them."""
    g = torch.Generator().manual_seed(seed)

    def projection(heads):
        t = torch.randn(shape.batch, shape.seq, heads * shape.head_dim, generator=g, dtype=torch.float32)
        t = t.to(device=shape.device, dtype=shape.torch_dtype)
        t = t.view(shape.batch, shape.seq, heads, shape.head_dim).transpose(1, 2)
        return t.requires_grad_(requires_grad)

    return projection(shape.heads), projection(shape.kv_heads), projection(shape.kv_heads)


def attention_forward(shape, q, k, v):
    """The call Hugging Face's sdpa entry makes for a causal, unmasked decoder layer."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.head_dim ** -0.5,
                                          enable_gqa=shape.heads != shape.kv_heads)


def sdpa_backend(shape):
    """The name of the SDPA backend F.scaled_dot_product_attention picks at this shape in
    training (inputs requiring grad): FLASH_ATTENTION on CPU is the CPU flash kernel."""
    from torch.nn.attention import SDPBackend

    q, k, v = attention_inputs(shape, requires_grad=True)
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=shape.head_dim ** -0.5,
                                     enable_gqa=shape.heads != shape.kv_heads)
    return SDPBackend(int(choice)).name


def kept_bytes_per_layer(shape, backend):
    """(bytes, formula) the stash keeps for one layer and micro-batch, or (None, why) for a
    backend it cannot keep. The attention output [batch, heads, seq, head_dim] in the model's
    dtype, plus the log-sum-exp in float32: [batch, heads, seq] for CPU flash,
    [batch, heads, seq, 1] for cuDNN, plus cuDNN's philox seed and offset (two 0-dim int64
    tensors). For CUDA flash and memory-efficient attention the terms are the fused op's
    outputs the stash keeps, shaped by PyTorch's meta functions for that op."""
    b, h, s, d = shape.batch, shape.heads, shape.seq, shape.head_dim
    item = torch.empty((), dtype=shape.torch_dtype).element_size()
    out, lse = b * h * s * d * item, b * h * s * 4
    terms = f"B*H*S*D*{item} ({shape.dtype} output) + B*H*S*4 (float32 log-sum-exp)"
    values = f"{b}*{h}*{s}*{d}*{item} + {b}*{h}*{s}*4"
    if torch.device(shape.device).type == "cpu":
        total = out + lse
    elif backend == "CUDNN_ATTENTION":
        total = out + lse + 16
        terms += " + 2*8 (philox seed, offset)"
        values += " + 16"
    elif backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        return _kept_bytes_from_meta(shape, backend)
    else:
        return None, f"the stash does not keep the {backend} backend"
    return total, f"per layer = {terms} = {values} = {total:,} bytes"


def _kept_bytes_from_meta(shape, backend):
    """The CUDA flash / memory-efficient forward's kept outputs (output, log-sum-exp and the two
    extras the backward needs), shaped on the meta device."""
    aten = torch.ops.aten
    meta = dict(device="meta", dtype=shape.torch_dtype)
    q = torch.empty(shape.batch, shape.heads, shape.seq, shape.head_dim, **meta)
    kv = torch.empty(shape.batch, shape.kv_heads, shape.seq, shape.head_dim, **meta)
    scale = shape.head_dim ** -0.5
    if backend == "FLASH_ATTENTION":
        r = aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True, False, scale=scale)
        named = [("output", r[0]), ("log-sum-exp", r[1]), ("rng state", r[6]), ("unused", r[7])]
    else:
        r = aten._scaled_dot_product_efficient_attention(q, kv, kv, None, True, 0.0, True, scale=scale)
        named = [("output", r[0]), ("log-sum-exp", r[1]), ("philox seed", r[2]), ("philox offset", r[3])]
    named = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for _, t in named)
    terms = " + ".join(f"{n} {list(t.shape)} {str(t.dtype)[6:]} ({t.numel() * t.element_size():,})" for n, t in named)
    return total, f"per layer = {terms} = {total:,} bytes (shapes from PyTorch's meta functions)"


# ---- clocks and memory -----------------------------------------------------------------------

class Clock:
    """Times a call in milliseconds: CUDA events on a CUDA device (read after synchronising),
    time.perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def time(self, fn):
        """(fn(), milliseconds)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end)
        t0 = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def collector_paused():
    """Collect the young generations now (a full collection takes a quarter of a second with
    transformers loaded) and keep the collector from running inside a timed region."""
    gc.collect(1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _stderr_silenced():
    """Hide what the profiler's native start/stop print on stderr (file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then m.bytes: the peak of live tensor bytes in the
    block above what was live when it began (None if this torch cannot say). CUDA: the
    caching allocator's counters. CPU: the allocation events of PyTorch's profiler (see the
    module docstring)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _stderr_silenced():
                self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start
            return False
        with _stderr_silenced():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.bytes = _cpu_peak_from_profile(self._prof)
        return False


def _cpu_peak_from_profile(prof):
    """The maximum running sum of the CPU allocations (+size) and frees (-size) the profiler
    recorded, in time order; None if this torch's profiler does not expose them."""
    try:
        from torch._C._profiler import _EventType
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
    except (AttributeError, ImportError, RuntimeError):
        return None
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def cpu_threads(n):
    """Run with n intra-op threads on CPU (0: leave torch's setting), restoring it after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


# ---- interleaved timing ---------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """One thing to time: setup() and teardown() run around its turn in a round, outside the
    clock; step() is timed `calls` times a turn."""
    name: str
    step: object
    setup: object = None
    teardown: object = None
    calls: int = 1
    times_ms: list = dataclasses.field(default_factory=list)

    @property
    def median_ms(self):
        return statistics.median(self.times_ms) if self.times_ms else float("nan")


def interleave(runners, clock, warmup, repeats, progress=None):
    """warmup + repeats rounds; each runs every runner once, starting one further along the
    list each round. Times of the warm-up rounds are dropped."""
    for r in range(warmup + repeats):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            if runner.setup:
                runner.setup()
            try:
                for _ in range(runner.calls):
                    with collector_paused():
                        _, ms = clock.time(runner.step)
                    if r >= warmup:
                        runner.times_ms.append(ms)
            finally:
                if runner.teardown:
                    runner.teardown()
        if progress is not None:
            progress.update(1)


def _progress(total, desc):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="round", leave=False, file=sys.stderr)
    except ImportError:
        return None


def environment(shape, threads):
    import transformers
    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "attnstash": attnstash.__version__,
             "device": shape.device, "cpu threads": threads}
    if torch.device(shape.device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["cudnn"] = torch.backends.cudnn.version()
    else:
        facts["cpu"] = platform.processor() or platform.machine()
    return facts


# ---- model mode -----------------------------------------------------------------------------

STASHED = ("stash", "stash-nr")


class ModelConfig:
    """One configuration of the model-mode benchmark, with its own copy of the model.
    kind: "none", "reentrant", "wrapped", "stash", "sac", "non-reentrant" or "stash-nr" (the
    stash under non-reentrant checkpointing); stash_layers: k for "stash" and "stash-nr"."""

    def __init__(self, name, kind, model, input_ids, stash_layers=0, wrapper_host=None, attention_mask=None):
        self.name, self.kind, self.model, self.input_ids = name, kind, model, input_ids
        self.attention_mask = attention_mask
        self.stash_layers, self.wrapper_host = stash_layers, wrapper_host
        self.losses = []  # every step's loss
        self.runner = Runner(name, self.step, self.setup, self.teardown)
        checkpointing = {"none": "none", "sac": "sac", "non-reentrant": "non-reentrant", "stash-nr": "non-reentrant"}
        enable_checkpointing(model, checkpointing.get(kind, "reentrant"))

    def setup(self):
        zero_grads(self.model)
        if self.kind in STASHED:
            attnstash.install_attention_stash(self.model, self.stash_layers)
        elif self.kind == "wrapped":
            attnstash.install_attention_stash(self.wrapper_host, 1)

    def teardown(self):
        if self.kind in STASHED:
            attnstash.uninstall_attention_stash(self.model)
        elif self.kind == "wrapped":
            attnstash.uninstall_attention_stash(self.wrapper_host)

    def step(self, after_forward=None):
        loss = training_step(self.model, self.input_ids, after_forward, self.attention_mask)
        self.losses.append(loss)
        return loss


def _check_step(config, device):
    """One untimed step of a configuration that records its memory, what the stash holds,
    and its gradients."""
    config.setup()
    try:
        ops.stash_reset_peak()
        before = attnstash.stash_stats()
        during = {}

        def after_forward():
            during["stash"] = attnstash.stash_stats()
            during["layers"] = attnstash.layer_stash_stats(config.model)

        with collector_paused(), PeakMemory(device) as peak:
            loss = config.step(after_forward)
        after = attnstash.stash_stats()
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in config.model.parameters()]
    finally:
        config.teardown()
        zero_grads(config.model)
    return {
        "loss": loss.item(),
        "peak_bytes": peak.bytes,
        "kept_bytes": after["peak_bytes"],
        "held_after_forward": {"entries": during["stash"]["entries"], "bytes": during["stash"]["bytes"],
                               "by_layer": {str(i): list(v) for i, v in during["layers"].items()}},
        "held_after_step": {"entries": after["entries"], "bytes": after["bytes"]},
        "keeps": after["keeps"] - before["keeps"],
        "replays": after["replays"] - before["replays"],
        "misses": after["misses"] - before["misses"],
    }, grads


def _grad_difference(grads, reference):
    """(bitwise equal, max |g - g_ref| / max |g_ref|) over all parameters."""
    equal, worst, scale = True, 0.0, 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            equal = equal and g is None and r is None
            continue
        equal = equal and torch.equal(g, r)
        worst = max(worst, (g.float() - r.float()).abs().max().item())
        scale = max(scale, r.float().abs().max().item())
    return equal, (worst / scale if scale else worst)


def stash_points(spec, layers):
    """"1,2,4" -> [1, 2, 4]; "all" stands for every layer; default: 1, a quarter, half, all."""
    if not spec:
        return sorted({1, max(1, layers // 4), max(1, layers // 2), layers})
    points = sorted({layers if p.strip() == "all" else int(p) for p in spec.split(",") if p.strip()})
    for p in points:
        if not 1 <= p <= layers:
            raise ValueError(f"--stash-points: {p} is not between 1 and the {layers} layers")
    return points


def run_model_mode(shape, args, out_dir):
    device = shape.device
    clock = Clock(device)
    backend = sdpa_backend(shape)
    per_layer, formula = kept_bytes_per_layer(shape, backend)
    if per_layer is None:
        raise SystemExit(f"attnstash.bench: torch picks {backend} attention at this shape on {device}; {formula} "
                         "(it keeps CPU flash attention, and cuDNN, flash and memory-efficient attention on CUDA).")
    points = stash_points(args.stash_points, shape.layers)
    print(f"model: {shape.describe()}\nSDPA backend: {backend}; stash points: {points}", flush=True)

    t0 = time.perf_counter()
    base = build_model(shape, seed=args.seed)
    input_ids = random_batch(shape, seed=args.seed + 1)
    mask = padding_mask(shape, args.pad)
    host = build_model(make_shape("tiny", layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8, vocab=16, seq=8,
                                  device="cpu", dtype="float32"))

    def config(name, kind, **kwargs):  # each configuration gets its own copy of the model
        return ModelConfig(name, kind, copy.deepcopy(base), input_ids, attention_mask=mask, **kwargs)

    configs = [config("no checkpointing", "none"), config("reentrant", "reentrant"),
               config("reentrant, wrapped", "wrapped", wrapper_host=host)]
    configs += [config(f"stash {k}", "stash", stash_layers=k) for k in points]
    configs += [config("SAC (non-reentrant)", "sac"), config("non-reentrant", "non-reentrant"),
                config(f"non-reentrant, stash {shape.layers}", "stash-nr", stash_layers=shape.layers)]
    del base
    baseline = configs[1]

    # Check steps first: memory, kept bytes, gradients against the baseline's; a second
    # baseline step gives the noise floor of that comparison.
    checks, reference = {}, None
    for config in [baseline] + [c for c in configs if c is not baseline]:
        result, grads = _check_step(config, device)
        if reference is None:
            reference = grads
            _, again = _check_step(baseline, device)
            noise_floor = dict(zip(("grads_equal", "grad_max_rel_diff"), _grad_difference(again, reference)))
            del again
        result["grads_equal"], result["grad_max_rel_diff"] = _grad_difference(grads, reference)
        checks[config.name] = result
        del grads
    del reference
    print(f"built {len(configs)} model copies and ran their check steps in {time.perf_counter() - t0:.1f} s",
          flush=True)

    # Timed rounds: every configuration, plus the attention forward alone, interleaved.
    q, k, v = attention_inputs(shape)
    attention = Runner("attention forward (one layer)", lambda: attention_forward(shape, q, k, v), calls=5)
    runners = [c.runner for c in configs] + [attention]
    bar = _progress(args.warmup + args.repeats, "bench rounds")
    interleave(runners, clock, args.warmup, args.repeats, bar)
    if bar is not None:
        bar.close()

    all_losses = [loss for c in configs for loss in c.losses]
    losses_equal = all(torch.equal(all_losses[0], x) for x in all_losses)
    max_loss_diff = max((x.float() - all_losses[0].float()).abs().item() for x in all_losses)
    t_base, t_attn = baseline.runner.median_ms, attention.median_ms
    # The stash saves against the checkpointing it runs under.
    t_under = {"stash": t_base, "stash-nr": next(c for c in configs if c.kind == "non-reentrant").runner.median_ms}
    rows = []
    for c in configs:
        check = checks[c.name]
        row = {
            "name": c.name, "kind": c.kind, "stash_layers": c.stash_layers,
            "times_ms": c.runner.times_ms, "median_ms": c.runner.median_ms,
            "vs_reentrant": c.runner.median_ms / t_base - 1.0,
            "loss": check["loss"], "peak_bytes": check["peak_bytes"], "kept_bytes": check["kept_bytes"],
            "predicted_kept_bytes": per_layer * c.stash_layers if c.kind in STASHED else 0,
            "check": check,
        }
        if c.kind in STASHED:
            saved = t_under[c.kind] - c.runner.median_ms
            row["saved_ms_per_layer"] = saved / c.stash_layers
            row["efficiency"] = saved / (c.stash_layers * t_attn)
        rows.append(row)
    wrapped = next(r for r in rows if r["kind"] == "wrapped")
    report = {
        "mode": "model", "preset": args.preset, "shape": dataclasses.asdict(shape), "pad": args.pad,
        "environment": environment(shape, torch.get_num_threads()), "sdpa_backend": backend,
        "rounds": {"warmup": args.warmup, "repeats": args.repeats},
        "attention_forward_ms": {"times_ms": attention.times_ms, "median_ms": t_attn},
        "kept_bytes_per_layer": per_layer, "prediction_formula": formula,
        "configs": rows,
        "losses_equal": losses_equal, "max_loss_diff": max_loss_diff, "grad_noise_floor": noise_floor,
        "wrapper_overhead": {"reentrant_ms": t_base, "wrapped_ms": wrapped["median_ms"],
                             "relative": wrapped["vs_reentrant"]},
        "efficiency": {str(r["stash_layers"]): r["efficiency"] for r in rows if r["kind"] == "stash"},
    }
    _print_model_report(report)
    if out_dir is not None:
        _write_json(out_dir / "bench.json", report)
        png = _plot_model_report(report, out_dir / "bench.png")
        print(f"wrote {out_dir / 'bench.json'}" + (f" and {png}" if png else ""))
    return report


def _mb(n):
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def _print_model_report(report):
    shape = report["shape"]
    print(f"\nTraining step (forward + backward, no optimizer), medians of {report['rounds']['repeats']} interleaved "
          f"rounds after {report['rounds']['warmup']} warm-up; peak = live tensor bytes above the step's start "
          f"({'CUDA allocator' if shape['device'] == 'cuda' else 'CPU allocations recorded by the profiler'}).")
    header = f"{'configuration':<22} {'step ms':>10} {'vs reentrant':>13} {'kept':>12} {'predicted':>12} " \
             f"{'peak memory':>13} {'replays':>8}  loss"
    print(header)
    print("-" * len(header))
    for r in report["configs"]:
        print(f"{r['name']:<22} {r['median_ms']:>10.2f} {r['vs_reentrant'] * 100:>+12.2f}% {_mb(r['kept_bytes']):>12} "
              f"{_mb(r['predicted_kept_bytes']):>12} {_mb(r['peak_bytes']):>13} {r['check']['replays']:>8}  "
              f"{r['loss']:.6f}")
    t_attn = report["attention_forward_ms"]["median_ms"]
    print(f"\nattention forward of one layer ({report['sdpa_backend']}): {t_attn:.3f} ms (median)")
    print(f"kept-bytes prediction: k * [{report['prediction_formula']}]")
    for r in report["configs"]:
        if r["kind"] in STASHED:
            match = "equal" if r["kept_bytes"] == r["predicted_kept_bytes"] else "DIFFERENT"
            print(f"  {r['name']}: saved {r['saved_ms_per_layer']:.3f} ms per stashed layer, "
                  f"efficiency {r['efficiency']:.2f} (1.0 = one attention forward per layer); kept bytes {match} "
                  f"to the prediction")
    w = report["wrapper_overhead"]
    print(f"stash on 0 layers (wrapper installed, plain path): {w['wrapped_ms']:.2f} ms vs {w['reentrant_ms']:.2f} ms "
          f"({w['relative'] * 100:+.2f}%)")
    print(f"loss: {'bitwise equal' if report['losses_equal'] else 'NOT equal'} across every step of every "
          f"configuration (max difference {report['max_loss_diff']:.3g})")
    describe = lambda c: ("bitwise equal" if c["grads_equal"]  # noqa: E731
                          else f"max relative difference {c['grad_max_rel_diff']:.3g}")
    print(f"gradients vs the reentrant check step (a second reentrant step: {describe(report['grad_noise_floor'])}):")
    for r in report["configs"]:
        if r["name"] != "reentrant":
            print(f"  {r['name']:<22} {describe(r['check'])}")


def _plot_model_report(report, path):
    """Step time and peak memory against the number of stashed layers (0 = reentrant), with
    SAC, plain non-reentrant and no checkpointing as horizontal lines. Returns the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = {r["name"]: r for r in report["configs"]}
    line = [rows["reentrant"]] + [r for r in report["configs"] if r["kind"] == "stash"]
    ks = [r["stash_layers"] for r in line]
    t_attn = report["attention_forward_ms"]["median_ms"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))

    med = [r["median_ms"] for r in line]
    lo = [m - min(r["times_ms"]) for m, r in zip(med, line)]
    hi = [max(r["times_ms"]) - m for m, r in zip(med, line)]
    ax_t.errorbar(ks, med, yerr=[lo, hi], marker="o", capsize=3, label="reentrant + stash (median, min-max)")
    ax_t.plot(ks, [med[0] - k * t_attn for k in ks], ":", color="gray",
              label="limit: one attention forward saved per layer")
    ax_t.axhline(rows["SAC (non-reentrant)"]["median_ms"], color="tab:green", ls="--", label="SAC, non-reentrant")
    ax_t.axhline(rows["non-reentrant"]["median_ms"], color="tab:olive", ls=(0, (1, 3)), label="non-reentrant, no SAC")
    ax_t.axhline(rows["no checkpointing"]["median_ms"], color="tab:red", ls="-.", label="no checkpointing")
    ax_t.scatter([0], [rows["reentrant, wrapped"]["median_ms"]], marker="x", color="black", zorder=3,
                 label="wrapper installed, 0 layers")
    ax_t.set_xticks(ks)
    ax_t.set_xlabel("stashed layers")
    ax_t.set_ylabel("step time, ms")
    ax_t.set_title("training step (forward + backward)")
    ax_t.legend(fontsize=8)

    to_mb = lambda n: (n or 0) / 1e6  # noqa: E731
    ax_m.plot(ks, [to_mb(r["peak_bytes"]) for r in line], marker="o", label="peak memory, reentrant + stash")
    ax_m.plot(ks, [to_mb(r["kept_bytes"]) for r in line], marker="s", label="kept by the stash")
    ax_m.plot(ks, [to_mb(r["predicted_kept_bytes"]) for r in line], ":", color="gray", label="predicted kept")
    ax_m.axhline(to_mb(rows["SAC (non-reentrant)"]["peak_bytes"]), color="tab:green", ls="--", label="SAC peak")
    ax_m.axhline(to_mb(rows["non-reentrant"]["peak_bytes"]), color="tab:olive", ls=(0, (1, 3)),
                 label="non-reentrant peak")
    ax_m.axhline(to_mb(rows["no checkpointing"]["peak_bytes"]), color="tab:red", ls="-.", label="no checkpointing peak")
    ax_m.set_xticks(ks)
    ax_m.set_xlabel("stashed layers")
    ax_m.set_ylabel("MB (above the step's start)")
    ax_m.set_title("memory")
    ax_m.legend(fontsize=8)
    s = report["shape"]
    fig.suptitle(f"attnstash, {s['layers']} layers, H{s['heads']}/{s['kv_heads']} D{s['head_dim']} "
                 f"S{s['seq']} B{s['batch']} {s['dtype']} on {report['environment'].get('gpu', s['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- layer mode -----------------------------------------------------------------------------

def run_layer_mode(shape, args, out_dir):
    """One decoder layer, forward + backward under reentrant checkpointing, with and without
    the stash (installed for its turn only), interleaved."""
    one = dataclasses.replace(shape, layers=1)
    clock = Clock(shape.device)
    backend = sdpa_backend(one)
    model = enable_checkpointing(build_model(one, seed=args.seed), "reentrant")
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(args.seed + 3)
    x = torch.randn(one.batch, one.seq, one.hidden, generator=g).to(one.device, one.torch_dtype).requires_grad_()
    grad_out = torch.randn(one.batch, one.seq, one.hidden, generator=g).to(one.device, one.torch_dtype)
    position_ids = torch.arange(one.seq, device=one.device).unsqueeze(0)
    with torch.no_grad():
        rope = model.model.rotary_emb(x, position_ids)

    def step():
        y = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(grad_out)

    def reset():
        zero_grads(model)
        x.grad = None

    def stash_on():
        reset()
        attnstash.install_attention_stash(model, 1)

    def grads():
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    reset()
    step()
    plain = grads()
    stash_on()
    try:
        step()
        stashed = grads()
        replays = attnstash.stash_stats()["replays"]
    finally:
        attnstash.uninstall_attention_stash(model)
    grads_equal, grad_diff = _grad_difference(stashed, plain)
    del plain, stashed

    q, k, v = attention_inputs(one)
    runners = [Runner("reentrant, no stash", step, setup=reset),
               Runner("reentrant + stash", step, setup=stash_on,
                      teardown=lambda: attnstash.uninstall_attention_stash(model)),
               Runner("attention forward", lambda: attention_forward(one, q, k, v), calls=3)]
    repeats = args.repeats if args.repeats_given else max(args.repeats, 30)
    bar = _progress(args.warmup + repeats, "layer rounds")
    interleave(runners, clock, args.warmup, repeats, bar)
    if bar is not None:
        bar.close()
    plain_ms, stash_ms, attn_ms = (r.median_ms for r in runners)
    report = {
        "mode": "layer", "preset": args.preset, "shape": dataclasses.asdict(one),
        "environment": environment(one, torch.get_num_threads()), "sdpa_backend": backend,
        "rounds": {"warmup": args.warmup, "repeats": repeats},
        "runs": {r.name: {"times_ms": r.times_ms, "median_ms": r.median_ms} for r in runners},
        "saved_ms_per_layer": plain_ms - stash_ms, "attention_forward_ms": attn_ms,
        "efficiency": (plain_ms - stash_ms) / attn_ms, "grads_equal": grads_equal,
        "grad_max_rel_diff": grad_diff, "replays_in_check_step": replays,
        "seed_pr_h100_saved_ms": 0.93,
    }
    print(f"one decoder layer: {one.describe()}\nSDPA backend picked: {backend}")
    print(f"forward + backward, medians of {repeats} interleaved rounds after {args.warmup} warm-up:")
    print(f"  reentrant, no stash   {plain_ms:9.3f} ms")
    print(f"  reentrant + stash     {stash_ms:9.3f} ms")
    print(f"  saved per stashed layer and micro-batch: {plain_ms - stash_ms:.3f} ms; attention forward alone "
          f"{attn_ms:.3f} ms (efficiency {report['efficiency']:.2f}); the seed PR measured 0.93 ms on an H100")
    print(f"  gradients with the stash vs without: "
          f"{'bitwise equal' if grads_equal else f'max relative difference {grad_diff:.3g}'}")
    if out_dir is not None:
        _write_json(out_dir / "layer.json", report)
        print(f"wrote {out_dir / 'layer.json'}")
    return report


# ---- soak mode ------------------------------------------------------------------------------

def run_soak(shape, args, out_dir):
    """Many irregular steps; the stash must be empty after each, and RSS must stay flat."""
    import psutil

    rng = random.Random(args.seed)
    model = enable_checkpointing(build_model(shape, seed=args.seed), "reentrant")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    process = psutil.Process()
    g = torch.Generator().manual_seed(args.seed + 1)
    steps, rss, log = args.steps, [], []
    start = attnstash.stash_stats()
    stashed = 0
    bar = _progress(steps, "soak steps")
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            if stashed:
                attnstash.uninstall_attention_stash(model)
            stashed = rng.randint(1, shape.layers)
            attnstash.install_attention_stash(model, stashed)
            micro = rng.randint(1, 4)
            kinds = []
            for _ in range(micro):
                ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(shape.device)
                roll = rng.random()
                if roll < 0.1:  # an evaluation forward: keeps nothing
                    with torch.no_grad():
                        model(input_ids=ids, labels=ids)
                    kinds.append("no-grad")
                elif roll < 0.35:  # a forward whose graph is dropped without a backward
                    out = model(input_ids=ids, labels=ids)
                    del out
                    kinds.append("dropped")
                else:
                    (model(input_ids=ids, labels=ids).loss / micro).backward()
                    kinds.append("trained")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            held = attnstash.stash_stats()
            assert held["entries"] == 0 and held["bytes"] == 0, \
                f"soak step {step}: the stash still holds {held['entries']} entries, {held['bytes']} bytes"
            rss.append(process.memory_info().rss)
            log.append({"step": step, "stashed_layers": stashed, "micro_batches": kinds, "rss": rss[-1]})
            if bar is not None:
                bar.update(1)
    finally:
        if stashed:
            attnstash.uninstall_attention_stash(model)
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    end = attnstash.stash_stats()
    counts = {k: end[k] - start[k] for k in ("keeps", "replays", "misses", "released_unused")}
    half = rss[len(rss) // 2:]
    slope = _slope(half)
    one_entry, _ = kept_bytes_per_layer(shape, sdpa_backend(shape))
    kinds = [k for entry in log for k in entry["micro_batches"]]
    report = {
        "mode": "soak", "shape": dataclasses.asdict(shape), "environment": environment(shape, torch.get_num_threads()),
        "steps": steps, "seconds": seconds,
        "micro_batches": {k: kinds.count(k) for k in ("trained", "dropped", "no-grad")},
        "stash": {**counts, "entries_at_end": end["entries"], "bytes_at_end": end["bytes"]},
        "rss": {"first": rss[0], "last": rss[-1], "max": max(rss), "second_half_slope_bytes_per_step": slope},
        "bytes_of_one_kept_entry": one_entry,
        "log": log,
    }
    print(f"soak: {steps} steps in {seconds:.1f} s, {shape.describe()}")
    print(f"  micro-batches: {report['micro_batches']}; stash keeps {counts['keeps']}, replays {counts['replays']}, "
          f"released unused {counts['released_unused']}, misses {counts['misses']}")
    print(f"  stash after every step: 0 entries, 0 bytes (asserted); at the end: {end['entries']} entries, "
          f"{end['bytes']} bytes")
    print(f"  RSS first {_mb(rss[0])}, last {_mb(rss[-1])}, max {_mb(max(rss))}; second-half slope "
          f"{slope / 1e3:+.2f} kB/step over {len(half)} steps (one leaked entry per step would add "
          f"{one_entry / 1e3:.1f} kB/step)")
    if out_dir is not None:
        _write_json(out_dir / "soak.json", report)
        print(f"wrote {out_dir / 'soak.json'}")
    return report


def _slope(values):
    """Least-squares slope of values against their index (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


# ---- command line ---------------------------------------------------------------------------

def _write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m attnstash.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["model", "layer", "soak"], default="model")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: demo (tiny for --mode soak)")
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "head-dim", "seq", "batch", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default: the preset's; layer mode 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default: the preset's)")
    p.add_argument("--stash-points", default=None, help='stashed-layer counts to time, e.g. "1,2,4" or "1,all"')
    p.add_argument("--steps", type=int, default=300, help="soak steps")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default 1 on CPU: on a small shared machine more threads make "
                        "timings erratic; 0 keeps torch's default)")
    p.add_argument("--pad", type=float, default=0.0,
                   help="model mode: padded batches, rows left-padded by up to this fraction of seq (e.g. 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench", help="directory for the JSON and PNG ('' to write nothing)")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.mode == "soak" else "demo")
    preset = PRESETS[args.preset]
    args.repeats_given = args.repeats is not None
    args.repeats = preset["repeats"] if args.repeats is None else args.repeats
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be at least 1 and --warmup at least 0")
    return args


def main(argv=None):
    """Run the benchmark; returns its report (a dict, also written as JSON under --out)."""
    args = parse_args(argv)
    shape = make_shape(args.preset, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                       heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, seq=args.seq,
                       batch=args.batch, vocab=args.vocab, dtype=args.dtype, device=args.device)
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"attnstash.bench: the {args.preset} preset runs on CUDA, which this torch cannot use; "
                         "pass --device cpu (and a smaller shape) to run it here.")
    threads = args.threads if args.threads is not None else (1 if shape.device == "cpu" else 0)
    out_dir = Path(args.out) if args.out else None
    run = {"model": run_model_mode, "layer": run_layer_mode, "soak": run_soak}[args.mode]
    with cpu_threads(threads):
        return run(shape, args, out_dir)


if __name__ == "__main__":
    main()
