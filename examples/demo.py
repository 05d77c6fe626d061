"""make demo: fine-tune a small Hugging Face decoder without and with the attention stash.

A Qwen3 decoder is built from a config (random weights, no download; the shape is the
"demo" preset of attnstash.bench.models) and trained on examples/corpus.txt with a
byte-level tokenizer (one token per UTF-8 byte, so nothing is fetched). Every run uses
Hugging Face reentrant gradient checkpointing; the two runs of a configuration start from
the same seed, see the same batches and alternate step by step (so both see the same
machine load). Three configurations:

    plain    fp32, fixed-length batches: run A (every layer's recompute runs its attention
             forward again) against run B, the same with attnstash.install_attention_stash
             on the last N layers (all by default): their recompute reuses the kept output
    amp      fp32 weights trained under torch.autocast (bfloat16 by default; on CUDA the
             device's autocast), without and with the stash on all layers. On a CPU without
             bf16/fp16 matrix instructions autocast is several times slower than fp32, so
             this one trains shorter sequences (--amp-seq) for fewer steps
    budget   batches of varying length (--min-seq to --seq tokens) and the stash on all
             layers under a budget (max_bytes) that holds half the layers of the longest
             batch: short batches keep every layer, long ones only some; the others are
             declined and their recomputes run attention as usual. The stash's peak must
             never pass the budget (asserted every step)

Reported per configuration: the loss of both runs at every step (on CPU the losses must be
bitwise equal), step times (forward + backward of one micro-batch, the optimizer step
excluded, the first step dropped as warm-up), what the stash kept; for the budget run the
bytes held after each forward, each step's peak and declined keeps, and a plot of them
against the budget (demo_budget.png). demo.png plots the plain configuration.

    python examples/demo.py                      # the defaults: under a minute on 2 CPU cores
    python examples/demo.py --steps 60 --seq 512 --stash-layers 2 --out out/demo
    python examples/demo.py --amp none --budget-steps 0      # only the plain configuration
"""
import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

import attnstash
from attnstash.bench import measure, models

HERE = Path(__file__).resolve().parent


class ByteTokenizer:
    """Text <-> token ids with one token per UTF-8 byte: a vocabulary of 256 and no files."""
    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def corpus_batches(tokens, shape, steps, seed, min_seq=None):
    """`steps` micro-batches of input_ids [batch, length]: windows of the token stream at random
    offsets (seeded, so both runs get the same ones). The ids are also the labels. length is
    shape.seq, or with min_seq, drawn for each batch between min_seq and shape.seq (a
    multiple of 8 where the range allows)."""
    data = torch.tensor(tokens, dtype=torch.long)
    if len(data) <= shape.seq:
        raise SystemExit(f"demo: the corpus has {len(data)} tokens; --seq {shape.seq} needs more")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        length = shape.seq
        if min_seq is not None:
            length = int(torch.randint(min_seq, shape.seq + 1, (1,), generator=g))
            length = max(min_seq, length - length % 8)
        starts = torch.randint(0, len(data) - length, (shape.batch,), generator=g)
        out.append(torch.stack([data[s:s + length] for s in starts.tolist()]).to(shape.device))
    return out


class Run:
    """One training run: its model, its optimizer, and what each step measured. With
    stash_layers, the stash is installed on the last that many layers (under max_bytes, the
    process-wide budget, which close() restores)."""

    def __init__(self, name, shape, seed, lr, stash_layers, max_bytes=None):
        self.name, self.amp = name, shape.amp
        self.model = models.enable_checkpointing(models.build_model(shape, seed=seed), "reentrant")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.stash_layers = stash_layers
        self.budget_before = attnstash.stash_max_bytes()
        self.stashed = (attnstash.install_attention_stash(self.model, stash_layers, max_bytes=max_bytes)
                        if stash_layers else [])
        self.losses, self.times_ms, self.kept = [], [], []

    def step(self, input_ids, clock):
        """One optimizer step on one micro-batch; only forward + backward are timed."""
        self.optimizer.zero_grad(set_to_none=True)
        held = {}
        if self.stashed:
            attnstash.stash_reset_peak()
            before = attnstash.stash_stats()

        def after_forward():  # the stash holds its entries between the forward and the backward
            held["by_layer"] = attnstash.layer_stash_stats(self.model)
            held["bytes"] = attnstash.stash_stats()["bytes"]

        with measure.collector_paused():
            loss, ms = clock.time(lambda: models.training_step(self.model, input_ids, after_forward, amp=self.amp))
        if self.stashed:
            after = attnstash.stash_stats()
            held["peak_bytes"] = after["peak_bytes"]
            held.update({k: after[k] - before[k] for k in ("keeps", "declined", "replays")})
        self.optimizer.step()
        self.losses.append(loss)
        self.times_ms.append(ms)
        self.kept.append(held)
        return loss

    def close(self):
        if self.stashed:
            attnstash.uninstall_attention_stash(self.model)
            attnstash.stash_set_max_bytes(self.budget_before)
            self.stashed = []

    def median_ms(self):
        """Median step time with the first step (warm-up) dropped when there are others."""
        times = self.times_ms[1:] or self.times_ms
        return statistics.median(times)

    def total_ms(self):
        """Sum of the step times with the first step (warm-up) dropped when there are others."""
        return sum(self.times_ms[1:] or self.times_ms)


def train_pair(plain, stash, batches, clock, desc, progress, after_step=None):
    """Both runs on the same batches, alternating which goes first; after_step(i) after each pair."""
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(batches), desc=desc, unit="step", file=sys.stderr)
    try:
        for i, input_ids in enumerate(batches):
            order = (plain, stash) if i % 2 == 0 else (stash, plain)  # alternate who goes first
            for run in order:
                run.step(input_ids, clock)
            if after_step is not None:
                after_step(i)
            if bar is not None:
                bar.set_postfix(loss=f"{plain.losses[-1].item():.4f}",
                                ms=f"{plain.times_ms[-1]:.0f}/{stash.times_ms[-1]:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        stash.close()


def compare(plain, stash):
    """The losses of both runs and whether they are bitwise equal, step by step."""
    return {"losses": {"plain": [x.item() for x in plain.losses], "stash": [x.item() for x in stash.losses]},
            "losses_bitwise_equal": [torch.equal(a, b) for a, b in zip(plain.losses, stash.losses)]}


def parse_args(argv=None):
    preset = models.PRESETS["demo"]
    p = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {preset['hidden']})")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {preset['layers']})")
    p.add_argument("--heads", type=int, default=None, help=f"query heads (default {preset['heads']})")
    p.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads (default {preset['kv_heads']})")
    p.add_argument("--head-dim", type=int, default=None, help=f"head size (default {preset['head_dim']})")
    p.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {preset['seq']})")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per micro-batch (default {preset['batch']})")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each plain run (default 30)")
    p.add_argument("--stash-layers", type=int, default=None, help="layers the stash keeps (default: all)")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"], default="bf16",
                   help="the amp configuration's autocast dtype (default bf16; none skips it)")
    p.add_argument("--amp-steps", type=int, default=8, help="steps of each amp run (default 8; 0 skips)")
    p.add_argument("--amp-seq", type=int, default=None,
                   help="the amp runs' sequence length (default: a quarter of --seq on CPU, --seq on CUDA)")
    p.add_argument("--budget-steps", type=int, default=12, help="steps of each budget run (default 12; 0 skips)")
    p.add_argument("--min-seq", type=int, default=None,
                   help="the budget runs' shortest batch (default: a quarter of --seq; the longest is --seq)")
    p.add_argument("--max-bytes", default=None,
                   help='the budget (e.g. "2MB"; default: half the layers of the longest batch)')
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default cpu (cuda trains in bf16)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (default 1: steadier timings on a small shared machine; 0 = torch's)")
    p.add_argument("--corpus", default=str(HERE / "corpus.txt"))
    p.add_argument("--out", default="out/demo", help="directory for demo.json, demo.png and demo_budget.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv=None):
    """Train every configuration and report; returns the report (also written to --out/demo.json)."""
    args = parse_args(argv)
    tokenizer = ByteTokenizer()
    shape = models.make_shape("demo", hidden=args.hidden, layers=args.layers, heads=args.heads,
                              kv_heads=args.kv_heads, head_dim=args.head_dim, seq=args.seq, batch=args.batch,
                              vocab=tokenizer.vocab_size, device=args.device)
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("demo: --device cuda, but this torch cannot use CUDA")
    stash_layers = shape.layers if args.stash_layers is None else args.stash_layers
    out_dir = Path(args.out)
    tokens = tokenizer.encode(Path(args.corpus).read_text(encoding="utf-8"))
    with measure.cpu_threads(args.threads if shape.device == "cpu" else 0) as threads:
        report = train_both(shape, args, tokens, stash_layers, threads)
        if args.amp != "none" and args.amp_steps > 0:
            report["amp"] = train_amp(shape, args, tokens)
        if args.budget_steps > 0:
            report["budget"] = train_budget(shape, args, tokens)
    report_and_plot(report, out_dir)
    return report


def train_both(shape, args, tokens, stash_layers, threads):
    """The plain configuration: fp32 (bf16 on CUDA), fixed-length batches."""
    batches = corpus_batches(tokens, shape, args.steps, args.seed + 1)
    clock = measure.Clock(shape.device)
    plain = Run("reentrant checkpointing", shape, args.seed, args.lr, 0)
    stash = Run(f"+ stash on {stash_layers} layers", shape, args.seed, args.lr, stash_layers)
    same_start = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), stash.model.parameters()))
    threads_note = f", {threads} CPU thread(s)" if shape.device == "cpu" else ""
    print(f"demo: {shape.describe()}; {len(tokens):,} corpus tokens (bytes), {args.steps} steps{threads_note}",
          flush=True)
    print(f"run A: {plain.name}; run B: {stash.name} (layers {stash.stashed}); same initial weights: {same_start}",
          flush=True)
    train_pair(plain, stash, batches, clock, "plain", not args.no_progress)
    backend = models.sdpa_backend(shape)
    per_layer, formula = models.kept_bytes_per_layer(shape)
    kept = stash.kept[-1]
    return {
        "shape": {**vars(shape)}, "steps": args.steps, "stash_layers": stash_layers, "stashed": stash.stashed,
        "environment": measure.environment(shape, threads), "sdpa_backend": backend,
        "same_initial_weights": same_start,
        **compare(plain, stash),
        "times_ms": {"plain": plain.times_ms, "stash": stash.times_ms},
        "median_ms": {"plain": plain.median_ms(), "stash": stash.median_ms()},
        "kept_by_layer": {str(i): held.bytes for i, held in sorted(kept["by_layer"].items())},
        "kept_bytes": kept["bytes"], "predicted_bytes_per_layer": per_layer, "prediction_formula": formula,
    }


def train_amp(shape, args, tokens):
    """The amp configuration: float32 weights under torch.autocast, the stash on every layer."""
    seq = args.amp_seq or (shape.seq if shape.device == "cuda" else max(16, shape.seq // 4))
    amp_shape = dataclasses.replace(shape, seq=seq, dtype="float32", amp=models.AMP[args.amp])
    batches = corpus_batches(tokens, amp_shape, args.amp_steps, args.seed + 2)
    plain = Run("reentrant checkpointing, autocast", amp_shape, args.seed, args.lr, 0)
    stash = Run("+ stash on all layers, autocast", amp_shape, args.seed, args.lr, amp_shape.layers)
    print(f"\namp: {amp_shape.describe()}; {args.amp_steps} steps", flush=True)
    train_pair(plain, stash, batches, measure.Clock(shape.device), f"amp {args.amp}", not args.no_progress)
    per_layer, formula = models.kept_bytes_per_layer(amp_shape)
    kept = stash.kept[-1]
    return {
        "shape": {**vars(amp_shape)}, "steps": args.amp_steps, "autocast": amp_shape.amp,
        **compare(plain, stash),
        "times_ms": {"plain": plain.times_ms, "stash": stash.times_ms},
        "median_ms": {"plain": plain.median_ms(), "stash": stash.median_ms()},
        "kept_by_layer": {str(i): held.bytes for i, held in sorted(kept["by_layer"].items())},
        "kept_bytes": kept["bytes"], "predicted_bytes_per_layer": per_layer, "prediction_formula": formula,
    }


def train_budget(shape, args, tokens):
    """The budget configuration: variable-length batches, the stash on every layer under max_bytes."""
    min_seq = args.min_seq or max(8, shape.seq // 4)
    if not 1 <= min_seq <= shape.seq:
        raise SystemExit(f"demo: --min-seq {min_seq} must be between 1 and --seq {shape.seq}")
    layers = shape.layers
    longest, _ = models.kept_bytes_per_layer(shape)
    budget = attnstash.parse_bytes(args.max_bytes) if args.max_bytes else max(1, layers // 2) * longest
    batches = corpus_batches(tokens, shape, args.budget_steps, args.seed + 3, min_seq=min_seq)
    per_layer = {}  # sequence length -> bytes one layer keeps (attnstash.backends.kept_bytes)
    for ids in batches:
        n = ids.shape[1]
        if n not in per_layer:
            per_layer[n] = models.kept_bytes_per_layer(dataclasses.replace(shape, seq=n))[0]
    plain = Run("reentrant checkpointing", shape, args.seed, args.lr, 0)
    stash = Run(f"+ stash on all {layers} layers, budget {budget:,} bytes", shape, args.seed, args.lr, layers,
                max_bytes=budget)
    print(f"\nbudget: {shape.describe().replace(f'seq {shape.seq}', f'seq {min_seq}-{shape.seq}')}; "
          f"{args.budget_steps} steps; the stash on all {layers} layers under a budget of {budget:,} bytes "
          f"({budget / longest:.2f} layers of the longest batch)", flush=True)

    def check(i):
        step = stash.kept[i]
        assert step["peak_bytes"] <= budget, \
            f"budget run, step {i + 1}: the stash held {step['peak_bytes']:,} bytes, over its budget of {budget:,}"

    train_pair(plain, stash, batches, measure.Clock(shape.device), "budget", not args.no_progress, check)
    steps = []
    for ids, k in zip(batches, stash.kept):
        n = ids.shape[1]
        fitting = min(layers, budget // per_layer[n])
        steps.append({"seq": n, "held_after_forward": k["bytes"], "peak_bytes": k["peak_bytes"],
                      "declined": k["declined"], "keeps": k["keeps"], "replays": k["replays"],
                      "all_layers_bytes": layers * per_layer[n], "predicted_held": fitting * per_layer[n]})
    return {
        "shape": {**vars(shape)}, "steps": args.budget_steps, "min_seq": min_seq, "max_bytes": budget,
        "budget_in_layers_of_longest": budget / longest, **compare(plain, stash),
        "times_ms": {"plain": plain.times_ms, "stash": stash.times_ms},
        "total_ms": {"plain": plain.total_ms(), "stash": stash.total_ms()},
        "per_step": steps, "peak_bytes": max(s["peak_bytes"] for s in steps),
        "declined": sum(s["declined"] for s in steps), "keeps": sum(s["keeps"] for s in steps),
    }


def _equal_line(label, part):
    losses, equal = part["losses"], part["losses_bitwise_equal"]
    if all(equal):
        return f"{label}: the losses of both runs are bitwise equal at all {len(equal)} steps."
    worst = max(abs(a - b) for a, b in zip(losses["plain"], losses["stash"]))
    return f"{label}: the losses differ at {equal.count(False)} of {len(equal)} steps (largest difference {worst:.3g})"


def report_and_plot(report, out_dir):
    """Print the report, write demo.json, demo.png and (with a budget run) demo_budget.png under out_dir."""
    losses, equal = report["losses"], report["losses_bitwise_equal"]
    print(f"\nplain configuration, {report['shape']['dtype']}:")
    print(f"{'step':>4}  {'loss A (no stash)':>18}  {'loss B (stash)':>18}  bitwise equal")
    for i, (a, b, e) in enumerate(zip(losses["plain"], losses["stash"], equal)):
        print(f"{i + 1:>4}  {a:>18.8f}  {b:>18.8f}  {'yes' if e else 'NO'}")
    on_cuda = report["shape"]["device"] == "cuda"
    print(_equal_line("plain", report) + ("; on CUDA cuDNN's dQ is not deterministic, so the runs drift apart after "
                                          "the first step." if on_cuda and not all(equal) else ""))
    a, b = report["median_ms"]["plain"], report["median_ms"]["stash"]
    print(f"median step time (forward + backward, first step dropped): run A {a:.1f} ms, run B {b:.1f} ms; "
          f"saved {a - b:.1f} ms ({(a - b) / a * 100:.1f}% of run A's step) with {report['stash_layers']} "
          "stashed layers")
    kept = report["kept_by_layer"]
    print(f"kept by the stash between forward and backward: {report['kept_bytes']:,} bytes in total; per layer: "
          + ", ".join(f"{i}: {n:,}" for i, n in kept.items()))
    print(f"  prediction {report['prediction_formula']}")

    amp = report.get("amp")
    if amp:
        a, b = amp["median_ms"]["plain"], amp["median_ms"]["stash"]
        print(f"\namp configuration, float32 weights under autocast {amp['autocast']}, seq {amp['shape']['seq']}:")
        print(_equal_line("amp", amp))
        print(f"median step time: run A {a:.1f} ms, run B {b:.1f} ms; saved {a - b:.1f} ms ({(a - b) / a * 100:.1f}%)")
        print(f"kept between forward and backward: {amp['kept_bytes']:,} bytes; per layer "
              f"{amp['predicted_bytes_per_layer']:,} predicted ({amp['prediction_formula']})")

    budget = report.get("budget")
    if budget:
        limit = budget["max_bytes"]
        print(f"\nbudget configuration, batches of {budget['min_seq']}-{budget['shape']['seq']} tokens, the stash on "
              f"all {budget['shape']['layers']} layers under max_bytes = {limit:,} bytes:")
        print(f"{'step':>4} {'seq':>5} {'held after forward':>19} {'predicted':>10} {'step peak':>10} "
              f"{'all layers need':>16} {'declined':>8}  loss equal")
        for i, (s, e) in enumerate(zip(budget["per_step"], budget["losses_bitwise_equal"])):
            print(f"{i + 1:>4} {s['seq']:>5} {s['held_after_forward']:>19,} {s['predicted_held']:>10,} "
                  f"{s['peak_bytes']:>10,} {s['all_layers_bytes']:>16,} {s['declined']:>8}  {'yes' if e else 'NO'}")
        print(_equal_line("budget", budget))
        a, b = budget["total_ms"]["plain"], budget["total_ms"]["stash"]
        print(f"peak held {budget['peak_bytes']:,} bytes <= budget {limit:,} (asserted every step); "
              f"{budget['keeps']} keeps, {budget['declined']} declined; total step time (first step dropped): "
              f"run A {a:.0f} ms, run B {b:.0f} ms ({(a - b) / a * 100:.1f}% saved)")

    print("\nsummary:")
    for name, part in (("plain", report), ("amp", amp), ("budget", budget)):
        if part:
            timing = part.get("median_ms") or part["total_ms"]
            a, b = timing["plain"], timing["stash"]
            print(f"  {name:<7} {len(part['losses_bitwise_equal']):>3} steps  losses "
                  f"{'bitwise equal' if all(part['losses_bitwise_equal']) else 'DIFFERENT'}  "
                  f"{'median' if 'median_ms' in part else 'total'} step {a:.1f} -> {b:.1f} ms "
                  f"({(b - a) / a * 100:+.1f}%)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot(report, out_dir / "demo.png")
    budget_png = plot_budget(budget, out_dir / "demo_budget.png") if budget else None
    print(f"wrote {out_dir / 'demo.json'}" + (f"; plots: {png}" if png else "")
          + (f", {budget_png}" if budget_png else ""))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(report, path):
    """Loss curves of both runs; step times; bytes kept per layer. None without matplotlib."""
    plt = _pyplot()
    if plt is None:
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


def plot_budget(budget, path):
    """The budget run per step: bytes held after the forward and the step's peak against the
    budget (and what all layers would need); declined keeps and the batch's length."""
    plt = _pyplot()
    if plt is None:
        return None
    per_step = budget["per_step"]
    steps = list(range(1, len(per_step) + 1))
    fig, (ax_b, ax_d) = plt.subplots(1, 2, figsize=(13, 4.4))
    to_mb = lambda n: n / 1e6  # noqa: E731
    ax_b.bar(steps, [to_mb(s["held_after_forward"]) for s in per_step], color="tab:blue", alpha=0.6,
             label="held after the forward")
    ax_b.plot(steps, [to_mb(s["peak_bytes"]) for s in per_step], "o", color="tab:orange", label="peak during the step")
    ax_b.plot(steps, [to_mb(s["all_layers_bytes"]) for s in per_step], "_", ms=18, mew=2, color="gray",
              label="all layers would need")
    ax_b.axhline(to_mb(budget["max_bytes"]), color="tab:red", ls="--", label=f"budget {budget['max_bytes']:,} bytes")
    ax_b.set_ylim(0, to_mb(max(s["all_layers_bytes"] for s in per_step + [{"all_layers_bytes": budget["max_bytes"]}]))
                  * 1.4)
    ax_b.set_xticks(steps)
    ax_b.set_xlabel("step")
    ax_b.set_ylabel("MB held by the stash")
    ax_b.set_title("bytes held against the budget")
    ax_b.legend(fontsize=8, loc="upper left")
    ax_d.bar(steps, [s["declined"] for s in per_step], color="tab:red", alpha=0.6, label="declined keeps")
    ax_d.set_xticks(steps)
    ax_d.set_xlabel("step")
    ax_d.set_ylabel("declined keeps (layers)")
    ax_d.set_ylim(0, budget["shape"]["layers"] + 0.5)
    ax_d.set_yticks(range(budget["shape"]["layers"] + 1))
    ax_s = ax_d.twinx()
    ax_s.plot(steps, [s["seq"] for s in per_step], "k.-", label="batch length")
    ax_s.set_ylabel("tokens per sequence")
    ax_s.set_ylim(0, budget["shape"]["seq"] * 1.1)
    handles = ax_d.get_legend_handles_labels()[0] + ax_s.get_legend_handles_labels()[0]
    ax_d.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    equal = "bitwise equal" if all(budget["losses_bitwise_equal"]) else "NOT equal"
    ax_d.set_title(f"declined keeps per step (losses {equal} to the run without the stash)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def all_equal(report):
    """Whether every configuration's losses were bitwise equal at every step."""
    parts = [report] + [report[k] for k in ("amp", "budget") if k in report]
    return all(all(p["losses_bitwise_equal"]) for p in parts)


if __name__ == "__main__":
    result = main()
    on_cpu = result["shape"]["device"] == "cpu"
    sys.exit(0 if all_equal(result) or not on_cpu else 1)
