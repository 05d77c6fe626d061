"""python -m attnstash.bench: what the attention stash saves, what it costs, and that it
changes nothing.

    --mode model   (default) one training step of the whole model per configuration,
                   interleaved: attnstash/bench/model_mode.py
    --mode layer   one decoder layer under reentrant and non-reentrant checkpointing,
                   without and with the stash, and SAC: layer_mode.py
    --mode profile one decoder layer's configurations under torch.profiler: kernels side
                   by side, GPU idle time, host time of the attnstash ops, syncs, and the
                   accounting of the step's difference: profile.py
    --mode seq-sweep   layer mode at each sequence length of --seqs, the micro-batch held
                   fixed: seq_sweep.py
    --mode soak    irregular steps under both checkpointing modes, the stash empty after
                   every one: soak.py
    --amp bf16|fp16    float32 weights trained under torch.autocast in that dtype, in every
                   configuration of the run (a separate run from the fp32 one)
    --max-bytes X[,Y]  model mode: one more row per budget, "stash all, budget X" (the
                   stash on every layer, keeps past X declined; its peak never above X,
                   asserted); soak mode: the whole soak under budget X
    --checkpointing reentrant|non-reentrant|both   soak, layer, profile and seq-sweep modes
                   (default both; for the last three non-reentrant includes SAC)
    --seqs 1024,4096,16384,32768   seq-sweep mode's sequence lengths; --sweep-seconds its
                   time for the timed rounds (default 60)
    --traces       profile mode: also write the Chrome traces (profile_traces.tar.gz)

Output: a table on stdout and, under --out, JSON (and model mode's and seq-sweep mode's PNG,
profile mode's markdown): report.py.
Shapes come from a preset (models.py) with any field overridden.
"""
import argparse
from pathlib import Path

import torch

from .measure import cpu_threads
from .models import AMP, DTYPES, PRESETS, make_shape


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m attnstash.bench", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["model", "layer", "profile", "seq-sweep", "soak"], default="model")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: demo (tiny for --mode soak)")
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "head-dim", "seq", "batch", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the weights' dtype")
    p.add_argument("--amp", choices=sorted(AMP), default=None,
                   help="train float32 weights under torch.autocast in this dtype (every configuration)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds (default: the preset's; layer mode 30; seq-sweep: what --sweep-seconds fits, "
                        "5 to 30 per length); profile mode: profiled steps (default 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds first (default: the preset's); profile mode: unprofiled steps (default 2)")
    p.add_argument("--stash-points", default=None, help='stashed-layer counts to time, e.g. "1,2,4" or "1,all"')
    p.add_argument("--max-bytes", default=None,
                   help='stash budgets, e.g. "2.2MB" or "1MiB,2MiB": model mode adds a row "stash all, budget X" '
                        "for each; soak mode runs under one")
    p.add_argument("--steps", type=int, default=300, help="soak steps (under each checkpointing mode)")
    p.add_argument("--checkpointing", choices=["reentrant", "non-reentrant", "both"], default="both",
                   help="soak mode: the checkpointing to soak under (default both, one after the other); layer, "
                        "profile and seq-sweep modes: the configurations to run (non-reentrant includes SAC)")
    p.add_argument("--seqs", default=None,
                   help='seq-sweep mode: sequence lengths, e.g. "1024,4096,16384,32768" (the default) or "64,128"')
    p.add_argument("--sweep-seconds", type=float, default=60.0,
                   help="seq-sweep mode: seconds for the timed rounds of the whole sweep (default 60)")
    p.add_argument("--traces", action="store_true",
                   help="profile mode: also write the profiler's Chrome traces as profile_traces.tar.gz")
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
    args.warmup_given = args.warmup is not None
    args.repeats = preset["repeats"] if args.repeats is None else args.repeats
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be at least 1 and --warmup at least 0")
    if args.mode == "seq-sweep":
        from .seq_sweep import parse_seqs
        try:
            parse_seqs(args.seqs)
        except ValueError as e:
            p.error(str(e))
    if args.max_bytes is not None:
        from attnstash import budget
        try:
            for part in args.max_bytes.split(","):
                if part.strip():
                    budget.parse_bytes(part.strip())
        except ValueError as e:
            p.error(f"--max-bytes: {e}")
    return args


def main(argv=None):
    """Run the benchmark; returns its report (a dict, also written as JSON under --out)."""
    args = parse_args(argv)
    shape = make_shape(args.preset, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                       heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, seq=args.seq,
                       batch=args.batch, vocab=args.vocab, dtype=args.dtype, device=args.device, amp=args.amp)
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"attnstash.bench: the {args.preset} preset runs on CUDA, which this torch cannot use; "
                         "pass --device cpu (and a smaller shape) to run it here.")
    threads = args.threads if args.threads is not None else (1 if shape.device == "cpu" else 0)
    out_dir = Path(args.out) if args.out else None
    if args.mode == "model":
        from .model_mode import run_model_mode as run
    elif args.mode == "layer":
        from .layer_mode import run_layer_mode as run
    elif args.mode == "profile":
        from .profile import run_profile_mode as run
    elif args.mode == "seq-sweep":
        from .seq_sweep import run_seq_sweep as run
    else:
        from .soak import run_soak as run
    with cpu_threads(threads):
        return run(shape, args, out_dir)


if __name__ == "__main__":
    main()
