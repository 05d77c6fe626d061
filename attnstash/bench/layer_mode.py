"""--mode layer: one decoder layer under each checkpointing mode, without and with the stash, and SAC.

One decoder layer (its input [batch, seq, hidden] requires grad, a fixed output gradient)
forward + backward, in these configurations (--checkpointing reentrant, non-reentrant or
both, the default):

  reentrant, no stash        Hugging Face reentrant checkpointing
  reentrant + stash          the same with the stash (installed for its turn only)
  non-reentrant, no stash    non-reentrant checkpointing
  non-reentrant + stash      the same with the stash
  SAC (non-reentrant)        non-reentrant checkpointing with selective activation
                             checkpointing saving the SDPA op (models.enable_checkpointing "sac")

interleaved with the attention forward alone (measure.interleave: rotated rounds, warm-up
dropped, medians; at least 30 rounds unless --repeats says otherwise). Each configuration
runs on its own deep copy of one layer model (bitwise the same weights), on one input.

Reported: the milliseconds saved per stashed layer and micro-batch under each checkpointing
mode (plain - stash), the efficiency (saved / attention forward: 1.0 is the limit), the
stash against SAC (time and peak memory: "at equal memory" is checked, not assumed), and
for every configuration the peak memory of one untimed check step (measure.PeakMemory, as
model mode measures it: live tensor bytes above the step's start), what the stash kept and
replayed in it, and its gradients (the layer input's and every parameter's) against its
plain counterpart (the stash and SAC against plain checkpointing of the same mode), bitwise
and as the largest relative difference, next to a noise floor (a second plain step against
the first). Under --amp the layer's forward runs under torch.autocast (its weights and input
stay float32).

LayerBench (the layer, its configurations and inputs) is shared with --mode profile
(profile.py) and --mode seq-sweep (seq_sweep.py).
"""
import copy
import dataclasses

import torch

import attnstash
from attnstash import backends, ops

from . import report as reporting
from .measure import Clock, PeakMemory, Runner, collector_paused, environment, grad_difference, interleave, progress
from .models import attention_forward, build_model, enable_checkpointing, zero_grads

# (name, checkpointing kind for models.enable_checkpointing, stash installed)
CONFIGS = (
    ("reentrant, no stash", "reentrant", False),
    ("reentrant + stash", "reentrant", True),
    ("non-reentrant, no stash", "non-reentrant", False),
    ("non-reentrant + stash", "non-reentrant", True),
    ("SAC (non-reentrant)", "sac", False),
)
# Each configuration that is not plain checkpointing, and the plain one it is compared with.
PLAIN_OF = {"reentrant + stash": "reentrant, no stash", "non-reentrant + stash": "non-reentrant, no stash",
            "SAC (non-reentrant)": "non-reentrant, no stash"}
# Checkpointing mode: (plain, stash) configuration names.
MODES = {"reentrant": ("reentrant, no stash", "reentrant + stash"),
         "non-reentrant": ("non-reentrant, no stash", "non-reentrant + stash")}
SAC = "SAC (non-reentrant)"
ATTENTION = "attention forward"
# The configurations each --checkpointing choice runs.
CHOSEN = {"reentrant": ("reentrant, no stash", "reentrant + stash"),
          "non-reentrant": ("non-reentrant, no stash", "non-reentrant + stash", SAC),
          "both": tuple(name for name, _, _ in CONFIGS)}


def config_names(checkpointing="both"):
    """The configuration names --checkpointing reentrant|non-reentrant|both runs, in CONFIGS order."""
    return CHOSEN[checkpointing]


def sdpa_flags(shape):
    """The flags Hugging Face's sdpa entry passes for a causal, unmasked decoder layer."""
    return dict(is_causal=True, scale=shape.head_dim ** -0.5, enable_gqa=shape.heads != shape.kv_heads)


def device_generator(device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def attention_inputs_on_device(shape, seed=2):
    """q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim] requiring grad,
    in the compute dtype, each a transposed view of a [batch, seq, heads * head_dim]
    projection as Hugging Face passes them (models.attention_inputs' layout), drawn on the
    device itself (at 32k tokens drawing them on the CPU takes seconds)."""
    g = device_generator(shape.device, seed)

    def projection(heads):
        t = torch.randn(shape.batch, shape.seq, heads * shape.head_dim, generator=g, device=shape.device)
        t = t.to(shape.compute_dtype).view(shape.batch, shape.seq, heads, shape.head_dim).transpose(1, 2)
        return t.requires_grad_()

    return projection(shape.heads), projection(shape.kv_heads), projection(shape.kv_heads)


class LayerConfig:
    """One configuration: its name, checkpointing kind, whether the stash is on, and its own
    one-layer model copy."""

    def __init__(self, name, kind, stash, model):
        self.name, self.kind, self.stash, self.model = name, kind, stash, model
        self.layer = model.model.layers[0]

    def setup(self):
        zero_grads(self.model)
        if self.stash:
            attnstash.install_attention_stash(self.model, 1)

    def teardown(self):
        if self.stash:
            attnstash.uninstall_attention_stash(self.model)


class LayerBench:
    """One decoder layer of `shape` (layers forced to 1) in the named configurations (CONFIGS
    names), each on a deep copy of one model, and the inputs at the shape's sequence length
    (set_inputs changes them: the weights do not depend on it)."""

    def __init__(self, shape, names, seed=0):
        self.shape = dataclasses.replace(shape, layers=1)
        self.seed = seed
        base = build_model(self.shape, seed=seed)
        self.configs = []
        for name, kind, stash in CONFIGS:
            if name in names:
                self.configs.append(LayerConfig(name, kind, stash, enable_checkpointing(copy.deepcopy(base), kind)))
        self.rotary = base.model.rotary_emb
        del base
        self.by_name = {c.name: c for c in self.configs}
        self.x = None
        self.set_inputs(self.shape)

    def set_inputs(self, shape):
        """The layer input x [batch, seq, hidden] (requires grad), the output gradient, the
        rotary embeddings and the attention-alone inputs, for `shape`'s batch and seq."""
        self.x = self.grad_out = self.rope = self.qkv = None
        if self.shape.device == "cuda":
            torch.cuda.empty_cache()
        self.shape = dataclasses.replace(shape, layers=1)
        s = self.shape
        g = device_generator(s.device, self.seed + 3)
        self.x = torch.randn(s.batch, s.seq, s.hidden, generator=g, device=s.device).to(s.torch_dtype)
        self.x.requires_grad_()
        self.grad_out = torch.randn(s.batch, s.seq, s.hidden, generator=g, device=s.device).to(s.torch_dtype)
        self.position_ids = torch.arange(s.seq, device=s.device).unsqueeze(0)
        with torch.no_grad():
            self.rope = self.rotary(self.x, self.position_ids)
        self.qkv = attention_inputs_on_device(s)

    def step(self, config, marks=False):
        """Forward + backward of the layer in `config`. marks: wrap the forward, the backward
        and the whole step in torch.profiler.record_function ranges "bench:forward",
        "bench:backward", "bench:step" (profile mode), the step ending with a device
        synchronisation, so that its kernels run inside its range."""
        if not marks:
            return self._step(config)
        from torch.profiler import record_function
        with record_function("bench:step"):
            self._step(config, record_function)
            if self.shape.device == "cuda":
                torch.cuda.synchronize()

    def _step(self, config, record_function=None):
        mark = record_function or (lambda name: _NULL)
        with mark("bench:forward"):
            with self.shape.autocast():
                y = config.layer(self.x, attention_mask=None, position_ids=self.position_ids,
                                 position_embeddings=self.rope)
            y = y[0] if isinstance(y, tuple) else y
        with mark("bench:backward"):
            y.backward(self.grad_out.to(y.dtype))

    def reset(self, config):
        zero_grads(config.model)
        self.x.grad = None

    def attention(self):
        """The attention forward alone: the call a layer's recompute makes and the stash skips."""
        return attention_forward(self.shape, *self.qkv)

    def sdpa_backend(self):
        return backends.chosen_backend(*self.qkv, None, 0.0, **sdpa_flags(self.shape)).name

    def predicted_kept_bytes(self):
        """attnstash.backends.kept_bytes_of_call for the layer's attention call (None: not kept)."""
        return backends.kept_bytes_of_call(*self.qkv, None, **sdpa_flags(self.shape))

    def runner(self, config):
        def setup():
            self.reset(config)
            config.setup()
        return Runner(config.name, lambda: self.step(config), setup=setup, teardown=config.teardown)

    def attention_runner(self, calls=3):
        return Runner(ATTENTION, self.attention, calls=calls)

    def check(self, config, keep_grads=True):
        """One untimed step of `config`: its peak memory (measure.PeakMemory), what the stash
        kept (its peak_bytes) and did, and (keep_grads) its gradients [x.grad, parameters]."""
        self.reset(config)
        config.setup()
        try:
            ops.stash_reset_peak()
            before = attnstash.stash_stats()
            with collector_paused(), PeakMemory(self.shape.device) as peak:
                self.step(config)
            after = attnstash.stash_stats()
            grads = None
            if keep_grads:
                grads = [self.x.grad.detach().clone()] + [p.grad.detach().clone() if p.grad is not None else None
                                                          for p in config.model.parameters()]
        finally:
            config.teardown()
            self.reset(config)
        return {"peak_bytes": peak.bytes, "kept_bytes": after["peak_bytes"],
                "held_after_step": {"entries": after["entries"], "bytes": after["bytes"]},
                **{k: after[k] - before[k] for k in ("keeps", "declined", "replays", "misses")}}, grads


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def summarise(medians, attention_ms):
    """From {configuration: median ms}: per checkpointing mode, the ms saved per stashed layer
    and the efficiency; and the stash against SAC."""
    modes = {}
    for mode, (plain, stash) in MODES.items():
        if plain in medians and stash in medians:
            saved = medians[plain] - medians[stash]
            modes[mode] = {"plain_ms": medians[plain], "stash_ms": medians[stash], "saved_ms_per_layer": saved,
                           "efficiency": saved / attention_ms if attention_ms else float("nan")}
    if SAC in medians and "non-reentrant, no stash" in medians:
        saved = medians["non-reentrant, no stash"] - medians[SAC]
        modes["SAC"] = {"plain_ms": medians["non-reentrant, no stash"], "sac_ms": medians[SAC],
                        "saved_ms_per_layer": saved,
                        "efficiency": saved / attention_ms if attention_ms else float("nan")}
    return modes


def stash_vs_sac(medians, peaks):
    """{stash configuration: its median ms and peak bytes minus SAC's} (negative: the stash is
    faster, or smaller)."""
    if SAC not in medians:
        return {}
    out = {}
    for _, stash in MODES.values():
        if stash in medians:
            peak = (peaks[stash] - peaks[SAC]) if peaks.get(stash) is not None and peaks.get(SAC) is not None \
                else None
            out[stash] = {"ms": medians[stash] - medians[SAC], "stash_ms": medians[stash], "sac_ms": medians[SAC],
                          "peak_bytes": peak, "stash_peak_bytes": peaks.get(stash), "sac_peak_bytes": peaks.get(SAC)}
    return out


def run_layer_mode(shape, args, out_dir):
    """One decoder layer, forward + backward, in each configuration of --checkpointing,
    interleaved with the attention forward alone."""
    names = config_names(getattr(args, "checkpointing", "both"))
    clock = Clock(shape.device)
    bench = LayerBench(shape, names, seed=args.seed)
    one = bench.shape
    backend = bench.sdpa_backend()

    # Check steps: memory, what the stash did, gradients against the plain counterpart; a
    # second plain step gives each comparison's noise floor.
    checks, grads, noise_floor = {}, {}, {}
    for config in bench.configs:
        checks[config.name], grads[config.name] = bench.check(config)
    for plain in sorted(set(PLAIN_OF.values()) & set(grads)):
        _, again = bench.check(bench.by_name[plain])
        noise_floor[plain] = dict(zip(("grads_equal", "grad_max_rel_diff"), grad_difference(again, grads[plain])))
        del again
    for name, plain in PLAIN_OF.items():
        if name in grads and plain in grads:
            checks[name]["compared_with"] = plain
            checks[name]["grads_equal"], checks[name]["grad_max_rel_diff"] = grad_difference(grads[name], grads[plain])
    del grads

    runners = [bench.runner(c) for c in bench.configs] + [bench.attention_runner(calls=3)]
    repeats = args.repeats if args.repeats_given else max(args.repeats, 30)
    bar = progress(args.warmup + repeats, "layer rounds")
    interleave(runners, clock, args.warmup, repeats, bar)
    if bar is not None:
        bar.close()
    medians = {r.name: r.median_ms for r in runners}
    attn_ms = medians.pop(ATTENTION)
    modes = summarise(medians, attn_ms)
    peaks = {name: checks[name]["peak_bytes"] for name in medians}
    compared = [checks[n] for n in PLAIN_OF if n in checks and "grads_equal" in checks[n]]
    stashed = [checks[n] for _, n in MODES.values() if n in checks]
    headline = modes.get("reentrant") or modes.get("non-reentrant")
    report = {
        "mode": "layer", "preset": args.preset, "shape": dataclasses.asdict(one),
        "environment": environment(one, torch.get_num_threads()), "sdpa_backend": backend,
        "checkpointing": getattr(args, "checkpointing", "both"),
        "rounds": {"warmup": args.warmup, "repeats": repeats},
        "runs": {r.name: {"times_ms": r.times_ms, "median_ms": r.median_ms} for r in runners},
        "configs": {name: {"median_ms": medians[name], **checks[name]} for name in medians},
        "modes": modes, "stash_vs_sac": stash_vs_sac(medians, peaks),
        "grad_noise_floor": noise_floor,
        "predicted_kept_bytes_per_layer": bench.predicted_kept_bytes(),
        # The headline figures (reentrant's where it ran): layer.json's keys before issue 15.
        "saved_ms_per_layer": headline["saved_ms_per_layer"], "attention_forward_ms": attn_ms,
        "efficiency": headline["efficiency"],
        "grads_equal": all(c["grads_equal"] for c in compared),
        "grad_max_rel_diff": max((c["grad_max_rel_diff"] for c in compared), default=0.0),
        "replays_in_check_step": min((c["replays"] for c in stashed), default=0),
        "seed_pr_h100_saved_ms": 0.93,
    }
    reporting.print_layer_report(report, one.describe())
    if out_dir is not None:
        reporting.write_json(out_dir / "layer.json", report)
        print(f"wrote {out_dir / 'layer.json'}")
    return report
