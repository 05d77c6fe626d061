"""make demo: fine-tune a small Hugging Face decoder twice, without and with the attention stash.

A Qwen3 decoder is built from a config (random weights, no download; the shape is
attnstash.bench's "demo" preset) and trained on examples/corpus.txt with a byte-level
tokenizer (one token per UTF-8 byte, so nothing is fetched). Both runs use Hugging Face
reentrant gradient checkpointing, start from the same seed and see the same batches:

    run A   reentrant checkpointing: every layer's recompute runs its attention forward again
    run B   the same, with attnstash.install_attention_stash(model, N) on the last N layers
            (all by default): their recompute reuses the attention output kept in the forward

The two runs alternate step by step, so both see the same machine load. Reported: the loss
of both runs at every step (on CPU in fp32 they must be bitwise equal), the median step time
of each (forward + backward of one micro-batch, the optimizer step excluded, the first step
dropped as warm-up) and the time saved, the bytes the stash keeps per layer while a step is
between its forward and its backward, and a PNG of it all.

    python examples/demo.py                      # the defaults: about a minute on 2 CPU cores
    python examples/demo.py --steps 60 --seq 512 --stash-layers 2 --out out/demo
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import attnstash
from attnstash import bench

HERE = Path(__file__).resolve().parent


class ByteTokenizer:
    """Text <-> token ids with one token per UTF-8 byte: a vocabulary of 256 and no files."""
    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def corpus_batches(tokens, shape, steps, seed):
    """`steps` micro-batches of input_ids [batch, seq]: windows of the token stream at random
    offsets (seeded, so both runs get the same ones). The ids are also the labels."""
    data = torch.tensor(tokens, dtype=torch.long)
    if len(data) <= shape.seq:
        raise SystemExit(f"demo: the corpus has {len(data)} tokens; --seq {shape.seq} needs more")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - shape.seq, (shape.batch,), generator=g)
        out.append(torch.stack([data[s:s + shape.seq] for s in starts.tolist()]).to(shape.device))
    return out


class Run:
    """One training run: its model, its optimizer, and what each step measured."""

    def __init__(self, name, shape, seed, lr, stash_layers):
        self.name = name
        self.model = bench.enable_checkpointing(bench.build_model(shape, seed=seed), "reentrant")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.stash_layers = stash_layers
        self.stashed = attnstash.install_attention_stash(self.model, stash_layers) if stash_layers else []
        self.losses, self.times_ms, self.kept = [], [], []

    def step(self, input_ids, clock):
        """One optimizer step on one micro-batch; only forward + backward are timed."""
        self.optimizer.zero_grad(set_to_none=True)
        held = {}

        def after_forward():  # the stash holds its entries between the forward and the backward
            held["by_layer"] = attnstash.layer_stash_stats(self.model)
            held["bytes"] = attnstash.stash_stats()["bytes"]

        with bench.collector_paused():
            loss, ms = clock.time(lambda: bench.training_step(self.model, input_ids, after_forward))
        self.optimizer.step()
        self.losses.append(loss)
        self.times_ms.append(ms)
        self.kept.append(held)
        return loss

    def close(self):
        if self.stashed:
            attnstash.uninstall_attention_stash(self.model)
            self.stashed = []

    def median_ms(self):
        """Median step time with the first step (warm-up) dropped when there are others."""
        times = self.times_ms[1:] or self.times_ms
        return statistics.median(times)


def parse_args(argv=None):
    preset = bench.PRESETS["demo"]
    p = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {preset['hidden']})")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {preset['layers']})")
    p.add_argument("--heads", type=int, default=None, help=f"query heads (default {preset['heads']})")
    p.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads (default {preset['kv_heads']})")
    p.add_argument("--head-dim", type=int, default=None, help=f"head size (default {preset['head_dim']})")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {preset['seq']})")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per micro-batch (default {preset['batch']})")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default 30)")
    p.add_argument("--stash-layers", type=int, default=None, help="layers the stash keeps (default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default cpu (cuda trains in bf16)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (default 1: steadier timings on a small shared machine; 0 = torch's)")
    p.add_argument("--corpus", default=str(HERE / "corpus.txt"))
    p.add_argument("--out", default="out/demo", help="directory for demo.json and demo.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None):
    """Train both runs and report; returns the report (also written to --out/demo.json)."""
    args = parse_args(argv)
    tokenizer = ByteTokenizer()
    shape = bench.make_shape("demo", hidden=args.hidden, layers=args.layers, heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim, seq=args.seq, batch=args.batch,
                             vocab=tokenizer.vocab_size, device=args.device)
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("demo: --device cuda, but this torch cannot use CUDA")
    stash_layers = shape.layers if args.stash_layers is None else args.stash_layers
    out_dir = Path(args.out)
    tokens = tokenizer.encode(Path(args.corpus).read_text(encoding="utf-8"))
    with bench.cpu_threads(args.threads if shape.device == "cpu" else 0) as threads:
        report = train_both(shape, args, tokens, stash_layers, threads)
    report_and_plot(report, out_dir)
    return report


def train_both(shape, args, tokens, stash_layers, threads):
    batches = corpus_batches(tokens, shape, args.steps, args.seed + 1)
    clock = bench.Clock(shape.device)
    plain = Run("reentrant checkpointing", shape, args.seed, args.lr, 0)
    stash = Run(f"+ stash on {stash_layers} layers", shape, args.seed, args.lr, stash_layers)
    same_start = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), stash.model.parameters()))
    threads_note = f", {threads} CPU thread(s)" if shape.device == "cpu" else ""
    print(f"demo: {shape.describe()}; {len(tokens):,} corpus tokens (bytes), {args.steps} steps{threads_note}",
          flush=True)
    print(f"run A: {plain.name}; run B: {stash.name} (layers {stash.stashed}); same initial weights: {same_start}",
          flush=True)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc="training", unit="step", file=sys.stderr)
    try:
        for i, input_ids in enumerate(batches):
            order = (plain, stash) if i % 2 == 0 else (stash, plain)  # alternate who goes first
            for run in order:
                run.step(input_ids, clock)
            if bar is not None:
                bar.set_postfix(loss=f"{plain.losses[-1].item():.4f}",
                                ms=f"{plain.times_ms[-1]:.0f}/{stash.times_ms[-1]:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        stash.close()
    backend = bench.sdpa_backend(shape)
    per_layer, formula = bench.kept_bytes_per_layer(shape, backend)
    kept = stash.kept[-1]
    return {
        "shape": {**vars(shape)}, "steps": args.steps, "stash_layers": stash_layers, "stashed": stash.stashed,
        "environment": bench.environment(shape, threads), "sdpa_backend": backend,
        "same_initial_weights": same_start,
        "losses": {"plain": [x.item() for x in plain.losses], "stash": [x.item() for x in stash.losses]},
        "losses_bitwise_equal": [torch.equal(a, b) for a, b in zip(plain.losses, stash.losses)],
        "times_ms": {"plain": plain.times_ms, "stash": stash.times_ms},
        "median_ms": {"plain": plain.median_ms(), "stash": stash.median_ms()},
        "kept_by_layer": {str(i): b for i, (_, b) in sorted(kept["by_layer"].items())},
        "kept_bytes": kept["bytes"], "predicted_bytes_per_layer": per_layer, "prediction_formula": formula,
    }


def report_and_plot(report, out_dir):
    """Print the report, write demo.json and demo.png under out_dir."""
    losses, equal = report["losses"], report["losses_bitwise_equal"]
    print(f"\n{'step':>4}  {'loss A (no stash)':>18}  {'loss B (stash)':>18}  bitwise equal")
    for i, (a, b, e) in enumerate(zip(losses["plain"], losses["stash"], equal)):
        print(f"{i + 1:>4}  {a:>18.8f}  {b:>18.8f}  {'yes' if e else 'NO'}")
    if all(equal):
        print(f"The losses of both runs are bitwise equal at all {len(equal)} steps.")
    else:
        worst = max(abs(a - b) for a, b in zip(losses["plain"], losses["stash"]))
        print(f"The losses differ at {equal.count(False)} of {len(equal)} steps (largest difference {worst:.3g})"
              + ("; on CUDA cuDNN's dQ is not deterministic, so the runs drift apart after the first step."
                 if report["shape"]["device"] == "cuda" else "."))
    a, b = report["median_ms"]["plain"], report["median_ms"]["stash"]
    print(f"median step time (forward + backward, first step dropped): run A {a:.1f} ms, run B {b:.1f} ms; "
          f"saved {a - b:.1f} ms ({(a - b) / a * 100:.1f}% of run A's step) with {report['stash_layers']} "
          "stashed layers")
    kept = report["kept_by_layer"]
    print(f"kept by the stash between forward and backward: {report['kept_bytes']:,} bytes in total; per layer: "
          + ", ".join(f"{i}: {n:,}" for i, n in kept.items()))
    print(f"  prediction {report['prediction_formula']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot(report, out_dir / "demo.png")
    print(f"wrote {out_dir / 'demo.json'}" + (f"; plot: {png}" if png else ""))


def plot(report, path):
    """Loss curves of both runs; step times; bytes kept per layer. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_l, ax_t, ax_k) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = range(1, report["steps"] + 1)
    ax_l.plot(steps, report["losses"]["plain"], lw=3, alpha=0.5, label="A: reentrant checkpointing")
    ax_l.plot(steps, report["losses"]["stash"], "--", color="black", label="B: + attention stash")
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss")
    ax_l.set_title("training loss" + (" (bitwise equal)" if all(report["losses_bitwise_equal"]) else ""))
    ax_l.legend()
    for key, label in (("plain", "A: no stash"), ("stash", "B: stash")):
        median = report["median_ms"][key]
        ax_t.plot(steps, report["times_ms"][key], marker=".", label=f"{label}, median {median:.0f} ms")
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("forward + backward, ms")
    ax_t.set_title("step time")
    ax_t.legend()
    kept = report["kept_by_layer"]
    ax_k.bar([f"layer {i}" for i in kept], [n / 1e6 for n in kept.values()], label="kept")
    if report["predicted_bytes_per_layer"]:
        ax_k.axhline(report["predicted_bytes_per_layer"] / 1e6, color="gray", ls=":", label="predicted")
    ax_k.set_ylim(0, max([n / 1e6 for n in kept.values()] + [1e-6]) * 1.3)
    ax_k.set_ylabel("MB")
    ax_k.set_title(f"kept by the stash: {report['kept_bytes'] / 1e6:.2f} MB in total")
    ax_k.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    result = main()
    on_cpu = result["shape"]["device"] == "cpu"
    sys.exit(0 if all(result["losses_bitwise_equal"]) or not on_cpu else 1)
