"""--mode layer: one decoder layer, without and with the stash.

One decoder layer (its input [batch, seq, hidden] requires grad, a fixed output gradient)
forward + backward under reentrant checkpointing, without and with the stash (installed
for its turn only), interleaved with the attention forward alone (measure.interleave): the
milliseconds saved per stashed layer and micro-batch, against the attention forward at
that shape, and the SDPA backend torch picked for it. Under --amp the layer's forward runs
under torch.autocast (its weights and input stay float32). The gradients of one check step
with the stash are compared bitwise with one without.
"""
import dataclasses

import torch

import attnstash

from . import report as reporting
from .measure import Clock, Runner, environment, grad_difference, interleave, progress
from .models import (attention_forward, attention_inputs, build_model, enable_checkpointing, sdpa_backend,
                     zero_grads)


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
        with one.autocast():
            y = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(grad_out.to(y.dtype))

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
        before = attnstash.stash_stats()["replays"]
        step()
        stashed = grads()
        replays = attnstash.stash_stats()["replays"] - before
    finally:
        attnstash.uninstall_attention_stash(model)
    grads_equal, grad_diff = grad_difference(stashed, plain)
    del plain, stashed

    q, k, v = attention_inputs(one)
    runners = [Runner("reentrant, no stash", step, setup=reset),
               Runner("reentrant + stash", step, setup=stash_on,
                      teardown=lambda: attnstash.uninstall_attention_stash(model)),
               Runner("attention forward", lambda: attention_forward(one, q, k, v), calls=3)]
    repeats = args.repeats if args.repeats_given else max(args.repeats, 30)
    bar = progress(args.warmup + repeats, "layer rounds")
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
    reporting.print_layer_report(report, one.describe())
    if out_dir is not None:
        reporting.write_json(out_dir / "layer.json", report)
        print(f"wrote {out_dir / 'layer.json'}")
    return report
