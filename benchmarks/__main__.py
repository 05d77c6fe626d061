"""python -m benchmarks: what the attention stash saves, what it costs, and that it changes nothing.

    --mode model      (default) one training step of the whole decoder per configuration: decoder.py
    --mode layer      one decoder layer under reentrant and non-reentrant checkpointing, without and
                      with the stash, and SAC: decoder.py
    --mode profile    layer mode's configurations under torch.profiler: profile.py
    --mode seq-sweep  layer mode at each length of --seqs, the micro-batch fixed: decoder.py
    --mode soak       irregular steps under both checkpointing modes, the stash empty after each: soak.py
    --mode dit        a diffusers Flux transformer at --tokens image tokens: dit.py
    --mode host       the stash's host cost at tiny shapes, one thread: dit.py
    --mode compile    the decoder under torch.compile, with and without the stash, SAC: compiled.py
    --mode instructions  the host work per stashed layer, attnstash's and the seed's design's,
                      in instructions (callgrind) and time: instructions.py
    --mode opcodes    the Python of that work, in bytecode instructions counted exactly: opcodes.py

Every configuration of a run is measured side by side in one process (harness.py): interleaved
rounds, set-up outside the clock, medians, loss and every gradient checked bitwise. Output: tables
on stdout and, under --out, JSON with every raw time (and bench.png, seq_sweep.png, profile.md).
"""
import argparse
from pathlib import Path

import torch

from attnstash import budget

from .harness import cpu_threads
from .models import PRESETS, dtype_name, make_shape

MODES = ("model", "layer", "profile", "seq-sweep", "soak", "dit", "host", "compile", "instructions", "opcodes")


def _list(convert):
    def parse(text):
        values = [convert(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def _length(text):
    value = int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length")
    return value


def _budget(text):
    try:
        return text, budget.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None):
    from .dit import DIT_PRESETS
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="model")
    p.add_argument("--preset", choices=sorted({**PRESETS, **DIT_PRESETS}), default=None,
                   help="decoder: demo (default), qwen3-30b-a3b, tiny (soak's default); dit: dit (default), flux")
    for name in ("hidden", "intermediate", "layers", "single-layers", "heads", "kv-heads", "head-dim", "seq", "batch",
                 "vocab", "text-tokens"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--dtype", type=dtype_name, default=None, metavar="bf16|fp16|fp32", help="the weights' dtype")
    p.add_argument("--amp", type=dtype_name, default=None, metavar="bf16|fp16",
                   help="train fp32 weights under torch.autocast in this dtype (every configuration)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default: the preset's; layer mode at "
                   "least 30; host 300); profile mode: profiled steps (default 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first; profile mode: steps (default 2)")
    p.add_argument("--stash-points", type=_list(lambda s: s if s == "all" else int(s)), default=None,
                   help='model mode: stashed-layer counts, e.g. "1,2,all" (default 1, a quarter, half, all)')
    p.add_argument("--max-bytes", type=_list(_budget), default=[], metavar="BYTES[,BYTES]",
                   help='budgets, e.g. "2.2MB" or "1MiB,0": model mode adds a row "stash on all layers, budget X" '
                        "for each (its peak asserted never above X); soak mode runs under one")
    p.add_argument("--checkpointing", choices=["reentrant", "non-reentrant", "both"], default="both",
                   help="layer, profile, seq-sweep, soak, dit and host modes: the checkpointing to run")
    p.add_argument("--seqs", type=_list(_length), default=[1024, 4096, 16384, 32768],
                   help="seq-sweep mode: sequence lengths (default 1024,4096,16384,32768; 4k = 4096)")
    p.add_argument("--sweep-seconds", type=float, default=60.0, help="seq-sweep mode: seconds for the timed rounds")
    p.add_argument("--offload", action="store_true",
                   help="seq-sweep mode: every step under the user's activation offloading (on CUDA "
                        "transformers' activation_checkpointing_enable(offload=True) where it has it, else "
                        "torch.autograd.graph.save_on_cpu around the forward), plus the stash with its own offload")
    p.add_argument("--tokens", type=_list(_length), default=None, help="dit mode: image tokens (default: the preset's)")
    p.add_argument("--steps", type=int, default=300, help="soak mode: steps under each checkpointing mode")
    p.add_argument("--traces", action="store_true", help="profile mode: also write each Chrome trace (.json.gz)")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default 1 on CPU; 0: torch's)")
    p.add_argument("--pad", type=float, default=0.0, help="model mode: rows left-padded by up to this share of seq")
    p.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor",
                   help="compile mode: the torch.compile backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/bench", help="directory for the JSON and PNG ('' to write nothing)")
    args = p.parse_args(argv)
    dit = args.mode == "dit"
    args.preset = args.preset or {"soak": "tiny", "dit": "dit"}.get(args.mode, "demo")
    presets = DIT_PRESETS if dit else PRESETS
    if args.preset not in presets:
        p.error(f"--preset {args.preset} is not a{' dit' if dit else ' decoder'} preset: {', '.join(presets)}")
    args.repeats_given, args.warmup_given = args.repeats is not None, args.warmup is not None
    host = args.mode in ("host", "instructions", "opcodes")
    args.repeats = args.repeats if args.repeats_given else 300 if host else presets[args.preset]["repeats"]
    args.warmup = args.warmup if args.warmup_given else 20 if host else presets[args.preset]["warmup"]
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be at least 1 and --warmup at least 0")
    args.seqs, args.amp = sorted(set(args.seqs)), None if args.amp == "fp32" else args.amp
    return args


def main(argv=None):
    """Run the benchmark; returns its report (a dict, also written as JSON under --out)."""
    args = parse_args(argv)
    if args.mode == "dit":
        from .dit import dit_shape
        shape = dit_shape(args)
    else:
        shape = make_shape(args.preset, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                           heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, seq=args.seq,
                           batch=args.batch, vocab=args.vocab, dtype=args.dtype, device=args.device, amp=args.amp)
        if args.stash_points:
            args.stash_points = sorted({shape.layers if k == "all" else k for k in args.stash_points})
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks: the {args.preset} preset runs on CUDA, which this torch cannot use; "
                         "pass --device cpu (and a smaller shape) to run it here.")
    from . import compiled, decoder, dit, instructions, opcodes, profile, soak
    run = {"model": decoder.model_mode, "layer": decoder.layer_mode, "profile": profile.profile_mode,
           "seq-sweep": decoder.seq_sweep, "soak": soak.soak_mode, "dit": dit.dit_mode, "host": dit.host_mode,
           "compile": compiled.compile_mode, "instructions": instructions.instructions_mode,
           "opcodes": opcodes.opcodes_mode}
    threads = args.threads if args.threads is not None else (1 if shape.device == "cpu" else 0)
    with cpu_threads(threads):
        return run[args.mode](shape, args, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
