"""python -m attnstash.planner: what the attention stash keeps per attention layer for one
micro-batch, from a config.json alone (no weights), and how many layers fit a budget. It prints
the plan's table alone (or one line of error): other libraries' warnings, log lines and progress
bars are silenced while it runs (quiet.py)."""
import argparse
import sys

from . import plan
from .arguments import capability_of
from .quiet import others_silenced


def parser():
    p = argparse.ArgumentParser(
        prog="python -m attnstash.planner",
        description="What the attention stash keeps per attention layer for one micro-batch, from a config.json alone "
                    "(no weights), and how many layers fit a budget. A transformers config takes --batch and --seq; "
                    "a diffusers transformer config takes --batch, the latent's --latent-frames, --latent-height and "
                    "--latent-width, and --text-len.")
    p.add_argument("config", help="a transformers or diffusers config.json (or a folder with one), e.g. "
                                  "examples/configs/Qwen3-30B-A3B.json")
    p.add_argument("--batch", type=int, required=True, help="micro-batch size")
    p.add_argument("--seq", type=int, default=None, help="sequence length (transformers)")
    p.add_argument("--latent-frames", type=int, default=None, help="the latent's frames (diffusers video models)")
    p.add_argument("--latent-height", type=int, default=None, help="the latent's height (diffusers)")
    p.add_argument("--latent-width", type=int, default=None, help="the latent's width (diffusers)")
    p.add_argument("--text-len", type=int, default=None, help="text tokens (diffusers)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the config's dtype, else bf16)")
    p.add_argument("--max-bytes", default=None, help="a budget such as 8GiB, 512MB or 1000000: how many layers fit, "
                                                     "counted from the last")
    p.add_argument("--device", default="cuda", help="the device planned for: cuda (default; without a GPU here, "
                                                    "the rules for --sm) or cpu")
    p.add_argument("--backend", default=None, help="force a backend: cudnn, flash or efficient")
    p.add_argument("--padded", action="store_true", help="batches with padding (a 4-D attention mask; transformers)")
    p.add_argument("--sm", default="90", help="without a CUDA device: the compute capability planned for, e.g. "
                                              "90 (H100/H200, the default), 80 (A100), 100 (B200)")
    p.add_argument("--offload", action="store_true",
                   help="plan with the kept records moved to host memory: about two layers' records on the device "
                        "(--max-bytes counts those)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        with others_silenced(every_logger=True):
            result = plan(args.config, batch_size=args.batch, seq_len=args.seq, latent_frames=args.latent_frames,
                          latent_height=args.latent_height, latent_width=args.latent_width,
                          text_len=args.text_len, dtype=args.dtype, device=args.device, max_bytes=args.max_bytes,
                          padded=args.padded, backend=args.backend, cuda_capability=capability_of(args.sm),
                          offload=args.offload)
    except (ValueError, RuntimeError) as e:  # a config it cannot read (2), a forward that failed (1): one line
        # (ValueError: ArgumentError, InstallError and json's; RuntimeError: PlanError and torch's)
        print(f"python -m attnstash.planner: error: {str(e).removeprefix('attnstash.plan: ')}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
