"""--mode dit and --mode host: a diffusion transformer, and the host cost of the stash.

dit   diffusers' FluxTransformer2DModel (double-stream blocks attending over text + image tokens,
      then single-stream ones: one attention call of that joint shape per block), a flow-matching
      step per configuration at each image-token count of --tokens: no checkpointing;
      non-reentrant (diffusers' default, model.enable_gradient_checkpointing()) with and without
      the stash on every block (the installer finds them); SAC; reentrant with and without the
      stash. Reported as decoder.py reports. Presets: "dit" (CPU: 4 heads of 32, a 512 x 512
      image's 1024 tokens + 64 text tokens), "flux" (GPU: Flux's 24 heads of 128, 512 text tokens,
      4096 and 16384 image tokens, bf16; 2 + 2 blocks).
host  tiny shapes, one thread (the host is the bottleneck), the thread's CPU time (time.thread_time:
      other processes' time is not counted) of a step after an untimed one in each turn, each
      difference the median over the rounds of the per-round difference: (1) plain checkpointing
      of a transformers decoder and a tiny Flux while another model has the stash against nothing
      installed, target within 0.5%, next to the cost per F.sdpa call of attnstash's kernel on the
      op outside every frame (sdpa_call_cost) times the step's calls; (2) per stashed layer, each
      path against its unstashed run: the decoder's layers through transformers' checkpoint
      function (core.CheckpointCall, Run) and the same layers in a plain module that a plain loop
      checkpoints, stashed with layers= (a module call, core.LayerForward). Both skip the same
      attention forward, so their difference is the paths'.
"""
import copy
import dataclasses
import math
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils import benchmark
from torch.utils.checkpoint import checkpoint

import attnstash

from . import report
from .decoder import ModelStep
from .harness import Config, Run, check, environment, interleave, losses_equal, measure, median_ms
from .models import DTYPES, attention_forward, autocast, build_model, make_shape, plan, random_batch

DIT_PRESETS = {
    "dit": dict(heads=4, head_dim=32, layers=2, single_layers=2, tokens=(1024,), text_tokens=64, batch=1,
                in_channels=16, joint_dim=64, pooled_dim=32, dtype="fp32", device="cpu", repeats=10, warmup=2),
    "flux": dict(heads=24, head_dim=128, layers=2, single_layers=2, tokens=(4096, 16384), text_tokens=512, batch=1,
                 in_channels=64, joint_dim=4096, pooled_dim=768, dtype="bf16", device="cuda", repeats=10, warmup=2),
}


@dataclasses.dataclass
class DiTShape:
    """A Flux transformer (`layers` double- and `single_layers` single-stream blocks of heads x
    head_dim) and its micro-batch: `tokens` image tokens (latent patches) and `text_tokens`."""
    heads: int
    head_dim: int
    layers: int
    single_layers: int
    tokens: int
    text_tokens: int
    batch: int
    in_channels: int
    joint_dim: int
    pooled_dim: int
    dtype: str
    device: str
    amp: Optional[str] = None

    def describe(self):
        return (f"Flux transformer, {self.layers} double + {self.single_layers} single blocks, {self.heads} heads x "
                f"{self.head_dim}, {self.tokens} image + {self.text_tokens} text tokens, batch {self.batch}, "
                f"{'fp32 weights under autocast ' + self.amp if self.amp else self.dtype} on {self.device}")


def dit_shape(args):
    """The preset's DiTShape with the command line's overrides (its first --tokens)."""
    preset = DIT_PRESETS[args.preset]
    given = {k: getattr(args, k) for k in ("heads", "head_dim", "layers", "single_layers", "text_tokens", "batch",
                                          "device", "dtype", "amp") if getattr(args, k) is not None}
    args.tokens = args.tokens or list(preset["tokens"])
    fields = {f.name for f in dataclasses.fields(DiTShape)}
    shape = DiTShape(**{**{k: v for k, v in preset.items() if k in fields}, **given, "tokens": args.tokens[0]})
    return dataclasses.replace(shape, dtype="fp32") if shape.amp and args.dtype is None else shape


def build_dit(shape, seed=0):
    """FluxTransformer2DModel for `shape`, seeded random weights, built on its device, train mode."""
    from diffusers import FluxTransformer2DModel
    side = shape.head_dim * 7 // 16 // 2 * 2  # Flux's rotary split: 16 + 56 + 56 of 128
    torch.manual_seed(seed)
    with torch.device(shape.device):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=shape.in_channels, num_layers=shape.layers, num_single_layers=shape.single_layers,
            attention_head_dim=shape.head_dim, num_attention_heads=shape.heads, joint_attention_dim=shape.joint_dim,
            pooled_projection_dim=shape.pooled_dim, axes_dims_rope=(shape.head_dim - 2 * side, side, side))
    return (model if shape.dtype == "fp32" else model.to(DTYPES[shape.dtype])).train()


class DiTStep:
    """One flow-matching step on inputs drawn for `shape` (set_inputs draws new ones): the loss is
    the MSE of the predicted velocity against a fixed target."""
    inputs, layers = (), None

    def __init__(self, shape, seed=0):
        self.seed, self.device, self.amp = seed, shape.device, shape.amp
        self.set_inputs(shape)

    def set_inputs(self, s):
        self.kwargs, dtype = None, DTYPES[s.dtype]
        g = torch.Generator(device=s.device).manual_seed(self.seed + 1)
        height = max(h for h in range(1, math.isqrt(s.tokens) + 1) if s.tokens % h == 0)
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(s.tokens // height), indexing="ij")

        def randn(*size):
            return torch.randn(*size, generator=g, device=s.device).to(dtype)

        self.kwargs = dict(hidden_states=randn(s.batch, s.tokens, s.in_channels),
                           encoder_hidden_states=randn(s.batch, s.text_tokens, s.joint_dim),
                           pooled_projections=randn(s.batch, s.pooled_dim),
                           timestep=torch.full((s.batch,), 0.5, device=s.device, dtype=dtype),
                           img_ids=torch.stack([0 * rows, rows, cols], -1).flatten(0, 1).to(s.device, dtype),
                           txt_ids=torch.zeros(s.text_tokens, 3, device=s.device, dtype=dtype))
        self.target = randn(s.batch, s.tokens, s.in_channels).float()

    def forward(self, model):
        return (model(**self.kwargs, return_dict=False)[0].float() - self.target).pow(2).mean()


def dit_mode(shape, args, out):
    step, blocks = DiTStep(shape, seed=args.seed), shape.layers + shape.single_layers
    base = build_dit(shape, seed=args.seed)
    configs = [Config("none")]
    if args.checkpointing != "reentrant":
        configs += [Config("non-reentrant"), Config("non-reentrant", blocks), Config("sac")]
    if args.checkpointing != "non-reentrant":
        configs += [Config("reentrant"), Config("reentrant", blocks)]
    runs = [Run(c, copy.deepcopy(base), step) for c in configs]
    del base
    points, everything = [], []
    for tokens in args.tokens:
        s = dataclasses.replace(shape, tokens=tokens)
        step.set_inputs(s)
        print(f"dit: {s.describe()}", flush=True)
        with autocast(s.device, s.amp):
            planned = plan(runs[0].model, dtype=DTYPES[s.amp or s.dtype], **step.kwargs)
        times, point = measure(runs, runs[1], planned, "diffusion transformer step, ms", args.repeats, args.warmup,
                               column=f"{tokens} + {s.text_tokens} tokens")
        everything += times.values()
        points.append({"tokens": tokens, "text_tokens": s.text_tokens, "shape": dataclasses.asdict(s), **point})
        report.print_rows(point)
        for run in runs:
            run.losses.clear()
    result = {"mode": "dit", "preset": args.preset, "environment": environment(shape.device),
              "checkpointing": args.checkpointing, "blocks": blocks, "points": points}
    report.print_measurements(everything)
    report.write(out, "dit", result)
    return result


# ---- host mode ------------------------------------------------------------------------------

class Block(torch.nn.Module):
    """A transformers decoder layer in a plain module (the stash reaches it as a module call)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin):
        y = self.layer(x, attention_mask=None, position_embeddings=(cos, sin))
        return y[0] if isinstance(y, tuple) else y


class PlainDecoder(torch.nn.Module):
    """A transformers decoder's modules run by a plain loop that checkpoints each Block."""

    def __init__(self, hf):
        super().__init__()
        hf, self.kwargs = copy.deepcopy(hf), None
        self.embed, self.rotary, self.norm, self.head = hf.model.embed_tokens, hf.model.rotary_emb, hf.model.norm, \
            hf.lm_head
        self.blocks = torch.nn.ModuleList(Block(layer) for layer in hf.model.layers)

    def activation_checkpointing_enable(self, kwargs):
        self.kwargs = kwargs

    def activation_checkpointing_disable(self):
        self.kwargs = None

    def forward(self, input_ids):
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, torch.arange(input_ids.shape[1], device=h.device).unsqueeze(0))
        for block in self.blocks:
            h = checkpoint(block, h, cos, sin, **self.kwargs) if self.kwargs else block(h, cos, sin)
        return F.cross_entropy(self.head(self.norm(h))[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


class PlainStep(ModelStep):
    layers = Block

    def forward(self, model):
        return model(self.ids)


def paired(times, a, b):
    """Median and IQR (ms) of b - a over the rounds."""
    d = torch.tensor(times[b].times, dtype=torch.float64) - torch.tensor(times[a].times, dtype=torch.float64)
    q = d.quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).mul(1e3).tolist()
    return q[1], q[2] - q[0]


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Counting(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


_SDPA_CALL = """
import json, sys, time, torch
from torch.utils import benchmark
if sys.argv[2] == "1":
    import attnstash
c = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(2)
q, k, v = (torch.randn(b, s, h, d, generator=g).transpose(1, 2).requires_grad_() for b, h, s, d in
           (c["query"], c["key"], c["value"]))
mask = None if c["mask"] is None else torch.ones(c["mask"][0], dtype=getattr(torch, c["mask"][1]))
torch.set_num_threads(1)
fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, is_causal=c["is_causal"],
                                                               enable_gqa=c["enable_gqa"])
print(benchmark.Timer("fn()", globals={"fn": fn}, num_threads=1, timer=time.thread_time)
      .blocked_autorange(min_run_time=1).median * 1e6)
"""


def sdpa_call_cost(call, rounds=5):
    """What attnstash's kernel on aten::scaled_dot_product_attention costs a call outside every
    frame: F.sdpa at `call`'s shape (a planner CallPlan, q, k, v as attention_forward makes them)
    timed in fresh processes without attnstash and with it imported, alternated `rounds` times
    (us, medians)."""
    import json
    import statistics
    import subprocess
    import sys
    spec = json.dumps({"query": list(call.query), "key": list(call.key), "value": list(call.value),
                       "mask": None if call.mask is None else [list(call.mask[0]), call.mask[1]],
                       "is_causal": call.is_causal, "enable_gqa": call.enable_gqa})
    times = {"0": [], "1": []}
    for _ in range(rounds):
        for loaded in times:
            done = subprocess.run([sys.executable, "-c", _SDPA_CALL, spec, loaded], capture_output=True, text=True,
                                  check=True)
            times[loaded].append(float(done.stdout.split()[-1]))
    return {"without_attnstash_us": statistics.median(times["0"]), "with_attnstash_us": statistics.median(times["1"]),
            "rounds": rounds, "times_us": times}


def function_mode_cost(decoder, shape):
    """What a TorchFunctionMode pushed only inside a stashed layer's forward would cost (one way
    for attention calls to reach the stash: it sees every torch call of that forward): one
    decoder layer's forward alone and under a mode that passes every call through."""
    layer, x = decoder.model.layers[0], torch.randn(1, shape.seq, shape.hidden)
    cos, sin = decoder.model.rotary_emb(x, torch.arange(shape.seq).unsqueeze(0))

    def forward():
        with torch.no_grad():
            layer(x, attention_mask=None, position_embeddings=(cos, sin))

    def under_mode():
        with _PassThrough():
            forward()

    counting = _Counting()
    with counting:
        forward()
    cost = {"torch_calls": counting.calls}
    for name, fn in (("alone_us", forward), ("under_mode_us", under_mode)):
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=1, timer=time.thread_time)
        cost[name] = timer.blocked_autorange(min_run_time=1).median * 1e6
    return cost


def host_mode(shape, args, out):
    shape = make_shape("tiny", layers=args.layers or 4, hidden=64, heads=4, kv_heads=2, head_dim=16,
                       seq=args.seq or 32, batch=1, device="cpu")
    flux = DiTShape(heads=2, head_dim=16, layers=2, single_layers=2, tokens=64, text_tokens=16, batch=1,
                    in_channels=8, joint_dim=32, pooled_dim=16, dtype="fp32", device="cpu")
    decoder, step = build_model(shape, seed=args.seed), ModelStep(shape, random_batch(shape, args.seed + 1), None)
    n, tags = shape.layers, ("transformers: ", "diffusers: ", "module call: ")
    models = ((tags[0], decoder, step, (None, 0, n)), (tags[1], build_dit(flux, args.seed), DiTStep(flux), (None, 0)),
              (tags[2], PlainDecoder(decoder), PlainStep(shape, step.ids, None), (None, n)))
    modes = ["reentrant", "non-reentrant"] if args.checkpointing == "both" else [args.checkpointing]
    runs = [Run(Config(mode, k), copy.deepcopy(model), subject, tag)
            for mode in modes for tag, model, subject, stashes in models for k in stashes]
    checks = {}
    for tag in tags:
        checks.update(check([r for r in runs if r.tag == tag], next(r for r in runs if r.tag == tag)))
    print(f"host: {shape.describe()}; {flux.describe()}; {args.repeats} rounds", flush=True)
    times = interleave(runs, args.repeats, args.warmup, "host CPU time (time.thread_time), ms", clock=time.thread_time,
                       untimed=1)
    sdpa = sdpa_call_cost(plan(decoder, shape).layers[0].calls[0])
    alone, loaded = sdpa["without_attnstash_us"], sdpa["with_attnstash_us"]
    mode_cost = function_mode_cost(decoder, shape)
    med, installed, per_layer = {k: median_ms(m) for k, m in times.items()}, {}, {}
    for mode in modes:
        for tag, calls in ((tags[0], 2 * n), (tags[1], 2 * (flux.layers + flux.single_layers))):
            plain, zero = tag + Config(mode).name, tag + Config(mode, 0).name
            diff, iqr = paired(times, plain, zero)
            installed[f"{tag[:-2]}, {mode}"] = {
                "plain_ms": med[plain], "paired_diff_ms": diff, "paired_diff_iqr_ms": iqr,
                "relative": diff / med[plain],
                "within_0.5%": abs(diff) <= 0.005 * med[plain],
                "kernel_estimate": calls * (loaded - alone) * 1e-3 / med[plain]}
        us = {tag: paired(times, tag + Config(mode).name, tag + Config(mode, n).name)[0] / n * 1e3 for tag in tags[::2]}
        per_layer[mode] = {"transformers_us": us[tags[0]], "module_call_us": us[tags[2]],
                           "module_call_minus_transformers_us": us[tags[2]] - us[tags[0]]}
    result = {"mode": "host", "shape": dataclasses.asdict(shape), "dit_shape": dataclasses.asdict(flux),
              "environment": environment("cpu"), "rounds": {"warmup": args.warmup, "repeats": args.repeats},
              "medians_ms": med, "times_ms": {k: [t * 1e3 for t in m.times] for k, m in times.items()},
              "sdpa_call": sdpa, "installed_overhead": installed,
              "function_mode_per_layer_forward": mode_cost,
              "per_stashed_layer": per_layer, "checks": checks,
              "losses_equal": {tag[:-2]: losses_equal([r for r in runs if r.tag == tag]) for tag in tags}}
    report.print_measurements(times)
    print(report.table(installed.items(), [
        ("stash on 0 layers", lambda kv: kv[0]), ("plain ms", lambda kv: f"{kv[1]['plain_ms']:.3f}"),
        ("0 layers - plain, ms (IQR)",
         lambda kv: f"{kv[1]['paired_diff_ms']:+.3f} ({kv[1]['paired_diff_iqr_ms']:.3f})"),
        ("relative", lambda kv: f"{kv[1]['relative']:+.2%}"), ("within 0.5%", lambda kv: kv[1]["within_0.5%"]),
        ("kernel x calls", lambda kv: f"{kv[1]['kernel_estimate']:+.3%}")]))
    print(f"F.sdpa at the decoder's shape, outside every frame: {alone:.2f} us in a process without attnstash, "
          f"{loaded:.2f} us with it loaded (its kernel on the op); medians of {sdpa['rounds']} interleaved processes "
          "each (Timer.blocked_autorange)")
    print(f"a pass-through TorchFunctionMode around one decoder layer's forward (no_grad): "
          f"{mode_cost['alone_us']:.1f} -> {mode_cost['under_mode_us']:.1f} us, "
          f"{mode_cost['torch_calls']} torch calls (Timer.blocked_autorange)")
    print(report.table(per_layer.items(), [
        ("per stashed layer, us", lambda kv: kv[0]),
        ("transformers path", lambda kv: f"{kv[1]['transformers_us']:+.1f}"),
        ("module-call path", lambda kv: f"{kv[1]['module_call_us']:+.1f}"),
        ("module call - transformers", lambda kv: f"{kv[1]['module_call_minus_transformers_us']:+.1f}")]))
    report.write(out, "host", result)
    return result
