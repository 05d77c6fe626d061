"""make demo: fine-tune small models without and with the attention stash, losses bitwise equal.

Each configuration trains two runs from the same seed on the same batches, alternating step by
step (so both see the same machine load): run A with activation checkpointing (every recompute
runs its attention forward again), run B the same with attnstash.install_attention_stash (the
recompute reuses the kept output). Nothing is downloaded: the decoder is a Qwen3 built from a
config (the "demo" preset of benchmarks.models) trained on examples/corpus.txt with a
byte-level tokenizer; the diffusion transformer is diffusers' FluxTransformer2DModel, built small.

    plain           the decoder, fp32, reentrant checkpointing, fixed-length batches, the stash
                    on the last --stash-layers layers (all by default)
    amp             fp32 weights under torch.autocast (--amp bf16|fp16; on a CPU without bf16
                    matrix instructions autocast is slow, so shorter sequences, fewer steps)
    budget          batches of --min-seq to --seq tokens and the stash on every layer under a
                    budget (--max-bytes, default half the layers of the longest batch): short
                    batches keep every layer, long ones some; the stash's peak is asserted never
                    above the budget
    diffusers-lora  a Flux transformer with PEFT LoRA adapters on its attention projections
                    (diffusers' add_adapter, peft.LoraConfig as diffusers' training scripts write
                    it), the base frozen, diffusers' default checkpointing (non-reentrant), a
                    flow-matching loss on random latents; the installer finds the blocks itself

Reported per configuration: every step's loss of both runs (on CPU bitwise equal, or the exit
status is 1), step times (forward + backward, the optimizer step excluded, the first step
dropped as warm-up), what the stash kept against the planner's prediction; demo.json, demo.png
(the plain configuration) and demo_budget.png (the bytes held per step against the budget).

    python examples/demo.py                              # all four: under a minute on 2 CPU cores
    python examples/demo.py --steps 60 --seq 512 --stash-layers 2
    python examples/demo.py --amp none --budget-steps 0 --lora-steps 0   # only the plain configuration
"""
import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.utils import benchmark

import attnstash

# The benchmark is part of the repository, not of the installed package: import it from the root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness, models  # noqa: E402

HERE = Path(__file__).resolve().parent


class ByteTokenizer:
    """Text <-> token ids with one token per UTF-8 byte: a vocabulary of 256 and no files."""
    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def corpus_batches(tokens, shape, steps, seed, min_seq=None):
    """`steps` micro-batches of input_ids [batch, length] at random (seeded) offsets of the token
    stream; length shape.seq, or drawn between min_seq and shape.seq (a multiple of 8 where it can)."""
    data = torch.tensor(tokens, dtype=torch.long)
    if len(data) <= shape.seq:
        raise SystemExit(f"demo: the corpus has {len(data)} tokens; --seq {shape.seq} needs more")
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        length = shape.seq
        if min_seq is not None:
            length = int(torch.randint(min_seq, shape.seq + 1, (1,), generator=g))
            length = max(min_seq, length - length % 8)
        starts = torch.randint(0, len(data) - length, (shape.batch,), generator=g)
        out.append(torch.stack([data[s:s + length] for s in starts.tolist()]).to(shape.device))
    return out


class Run:
    """One training run: a model (checkpointed), AdamW on its trainable parameters, and, with
    stash_layers (None: all), the stash under max_bytes (close() uninstalls, restoring the budget)."""

    def __init__(self, name, model, loss, lr, stash=False, stash_layers=None, max_bytes=None, amp=None):
        self.name, self.model, self.loss, self.amp = name, model, loss, amp
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.stashed = attnstash.install_attention_stash(model, stash_layers, max_bytes=max_bytes) if stash else []
        self.losses, self.times_ms, self.kept = [], [], []

    def step(self, batch):
        """One optimizer step; only forward + backward are timed."""
        self.optimizer.zero_grad(set_to_none=True)
        attnstash.stash_reset_peak()
        before, held = attnstash.stash_stats(), {}
        device = next(self.model.parameters()).device

        def forward_backward():
            with models.autocast(device, self.amp):
                loss = self.loss(self.model, batch)
            held["by_layer"] = {str(i): h.bytes for i, h in attnstash.layer_stash_stats(self.model).items()}
            held["bytes"] = attnstash.stash_stats()["bytes"]
            loss.backward()
            return loss.detach()

        with harness.collector_paused():
            start = benchmark.timer()
            loss = forward_backward()
            self.times_ms.append((benchmark.timer() - start) * 1e3)
        after = attnstash.stash_stats()
        held.update(peak_bytes=after["peak_bytes"],
                    **{k: after[k] - before[k] for k in ("keeps", "declined", "replays")})
        self.optimizer.step()
        self.losses.append(loss)
        self.kept.append(held)

    def close(self):
        if self.stashed:
            attnstash.uninstall_attention_stash(self.model)
            self.stashed = []

    def median_ms(self):
        return statistics.median(self.times_ms[1:] or self.times_ms)


def train_pair(make_run, batches, desc, progress, after_step=None):
    """Runs A (no stash) and B (stash) on the same batches, alternating which goes first; the
    common report of a configuration."""
    plain, stash = make_run(False), make_run(True)
    stashed = stash.stashed
    same_start = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), stash.model.parameters()))
    print(f"  run A: {plain.name}; run B: {stash.name} (layers {stash.stashed}); same initial weights: {same_start}",
          flush=True)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(batches), desc=desc, unit="step", file=sys.stderr, leave=False)
    try:
        for i, batch in enumerate(batches):
            for run in ((plain, stash) if i % 2 == 0 else (stash, plain)):
                run.step(batch)
            if after_step is not None:
                after_step(stash.kept[i], i)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        stash.close()
    return {"steps": len(batches), "same_initial_weights": same_start, "stashed": stashed,
            "losses": {"plain": [x.item() for x in plain.losses], "stash": [x.item() for x in stash.losses]},
            "losses_bitwise_equal": [torch.equal(a, b) for a, b in zip(plain.losses, stash.losses)],
            "times_ms": {"plain": plain.times_ms, "stash": stash.times_ms},
            "median_ms": {"plain": plain.median_ms(), "stash": stash.median_ms()},
            "total_ms": {"plain": sum(plain.times_ms[1:]), "stash": sum(stash.times_ms[1:])},
            "kept_by_layer": stash.kept[-1]["by_layer"], "kept_bytes": stash.kept[-1]["bytes"], "per_step": stash.kept}


def decoder_run(shape, args, stash_layers=None, max_bytes=None):
    def make(stash):
        model = models.enable_checkpointing(models.build_model(shape, seed=args.seed), "reentrant")
        name = "reentrant checkpointing" + (" + the stash" + (f" under {max_bytes:,} bytes" if max_bytes else "")
                                            if stash else "")
        return Run(name, model, lambda m, ids: m(input_ids=ids, labels=ids).loss, args.lr, stash, stash_layers,
                   max_bytes, shape.amp)
    return make


def prediction(model, shape):
    planned = models.plan(model, shape)
    return {"predicted_bytes_per_layer": planned.layers[-1].bytes,
            "prediction_formula": models.describe_call(planned.layers[-1].calls[0])}


def train_plain(shape, args, tokens, stash_layers):
    print(f"\nplain: {shape.describe()}; {len(tokens):,} corpus tokens (bytes), {args.steps} steps", flush=True)
    part = train_pair(decoder_run(shape, args, stash_layers), corpus_batches(tokens, shape, args.steps, args.seed + 1),
                      "plain", not args.no_progress)
    return {"shape": dataclasses.asdict(shape), "stash_layers": stash_layers,
            **prediction(models.build_model(shape), shape), **part}


def train_amp(shape, args, tokens):
    seq = args.amp_seq or (shape.seq if shape.device == "cuda" else max(16, shape.seq // 4))
    amp_shape = dataclasses.replace(shape, seq=seq, dtype="fp32", amp=args.amp)
    print(f"\namp: {amp_shape.describe()}; {args.amp_steps} steps", flush=True)
    part = train_pair(decoder_run(amp_shape, args), corpus_batches(tokens, amp_shape, args.amp_steps, args.seed + 2),
                      f"amp {args.amp}", not args.no_progress)
    return {"shape": dataclasses.asdict(amp_shape), "autocast": args.amp,
            **prediction(models.build_model(amp_shape), amp_shape), **part}


def train_budget(shape, args, tokens):
    min_seq = args.min_seq or max(8, shape.seq // 4)
    if not 1 <= min_seq <= shape.seq:
        raise SystemExit(f"demo: --min-seq {min_seq} must be between 1 and --seq {shape.seq}")
    model = models.build_model(shape)
    longest = models.plan(model, shape).layers[-1].bytes
    budget = attnstash.parse_bytes(args.max_bytes) if args.max_bytes else max(1, shape.layers // 2) * longest
    batches = corpus_batches(tokens, shape, args.budget_steps, args.seed + 3, min_seq=min_seq)
    plans = {n: models.plan(model, dataclasses.replace(shape, seq=n)) for n in {ids.shape[1] for ids in batches}}
    print(f"\nbudget: {shape.describe().replace(f'seq {shape.seq}', f'seq {min_seq}-{shape.seq}')}; "
          f"{args.budget_steps} steps; the stash on all {shape.layers} layers under {budget:,} bytes "
          f"({budget / longest:.2f} layers of the longest batch)", flush=True)

    def check(step, i):
        assert step["peak_bytes"] <= budget, \
            f"budget run, step {i + 1}: the stash held {step['peak_bytes']:,} bytes, over its budget of {budget:,}"

    part = train_pair(decoder_run(shape, args, max_bytes=budget), batches, "budget", not args.no_progress, check)
    for ids, step in zip(batches, part["per_step"]):
        planned = plans[ids.shape[1]]
        step.update(seq=ids.shape[1], all_layers_bytes=planned.total_bytes,
                    predicted_held=planned.layers_within(budget) * planned.layers[-1].bytes)
    return {"shape": dataclasses.asdict(shape), "min_seq": min_seq, "max_bytes": budget,
            "predicted_bytes_per_layer": longest, **part,
            "peak_bytes": max(s["peak_bytes"] for s in part["per_step"]),
            "declined": sum(s["declined"] for s in part["per_step"]),
            "keeps": sum(s["keeps"] for s in part["per_step"])}


def train_lora(args):
    """The diffusers-lora configuration (see the module docstring)."""
    from peft import LoraConfig
    from benchmarks.dit import DiTShape, DiTStep, build_dit
    device = args.device or "cpu"
    shape = DiTShape(heads=4, head_dim=32, layers=2, single_layers=2, tokens=args.lora_tokens, text_tokens=64, batch=1,
                     in_channels=16, joint_dim=64, pooled_dim=32, dtype="fp32" if device == "cpu" else "bf16",
                     device=device)
    batches = [DiTStep(shape, seed=args.seed + 10 + i) for i in range(args.lora_steps)]
    targets = ["to_k", "to_q", "to_v", "to_out.0"]
    config = LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian", lora_dropout=0.0, target_modules=targets)

    def make(stash):
        model = build_dit(shape, seed=args.seed).requires_grad_(False)
        torch.manual_seed(args.seed + 1)
        model.add_adapter(config)
        model.enable_gradient_checkpointing()
        return Run("LoRA on a Flux transformer, diffusers' checkpointing" + (" + the stash" if stash else ""), model,
                   lambda m, step: step.forward(m), 1e-3, stash)

    print(f"\ndiffusers-lora: {shape.describe()}; LoRA r=8 on {', '.join(targets)}; "
          f"{args.lora_steps} steps", flush=True)
    part = train_pair(make, batches, "diffusers-lora", not args.no_progress)
    planned = models.plan(build_dit(shape), **batches[0].kwargs)
    return {"shape": dataclasses.asdict(shape), "predicted_bytes_per_layer": planned.layers[-1].bytes,
            "prediction_formula": models.describe_call(planned.layers[-1].calls[0]), **part}


def parse_args(argv=None):
    preset = models.PRESETS["demo"]
    p = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    for name in ("hidden", "layers", "heads", "kv-heads", "head-dim", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"default {preset[name.replace('-', '_')]}")
    p.add_argument("--steps", type=int, default=30, help="steps of each plain run (default 30)")
    p.add_argument("--stash-layers", type=int, default=None, help="layers the stash keeps (default: all)")
    p.add_argument("--amp", type=lambda s: None if s in ("none", "fp32") else models.dtype_name(s), default="bf16",
                   metavar="bf16|fp16|none", help="the amp configuration's autocast dtype (none or fp32 skips it)")
    p.add_argument("--amp-steps", type=int, default=8, help="steps of each amp run (default 8; 0 skips)")
    p.add_argument("--amp-seq", type=int, default=None, help="the amp runs' length (default a quarter of --seq on CPU)")
    p.add_argument("--budget-steps", type=int, default=12, help="steps of each budget run (default 12; 0 skips)")
    p.add_argument("--min-seq", type=int, default=None, help="the budget runs' shortest batch (default --seq / 4)")
    p.add_argument("--max-bytes", default=None, help='the budget (e.g. "2MB"; default half the layers of the longest)')
    p.add_argument("--lora-steps", type=int, default=8, help="steps of each diffusers-lora run (default 8; 0 skips)")
    p.add_argument("--lora-tokens", type=int, default=1024, help="the diffusers-lora runs' image tokens (default 1024)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default cpu (cuda trains in bf16)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1; 0 = torch's)")
    p.add_argument("--corpus", default=str(HERE / "corpus.txt"))
    p.add_argument("--out", default="out/demo", help="directory for demo.json, demo.png and demo_budget.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv=None):
    """Train every configuration and report; returns the report (also written to --out/demo.json)."""
    args = parse_args(argv)
    tokenizer = ByteTokenizer()
    shape = models.make_shape("demo", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                              head_dim=args.head_dim, seq=args.seq, batch=args.batch, vocab=tokenizer.vocab_size,
                              device=args.device)
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("demo: --device cuda, but this torch cannot use CUDA")
    tokens = tokenizer.encode(Path(args.corpus).read_text(encoding="utf-8"))
    report = {}
    with harness.cpu_threads(args.threads if shape.device == "cpu" else 0) as threads:
        report["environment"] = {**harness.environment(shape.device), "cpu threads": threads}
        report["plain"] = train_plain(shape, args, tokens, args.stash_layers)
        if args.amp and args.amp_steps > 0:
            report["amp"] = train_amp(shape, args, tokens)
        if args.budget_steps > 0:
            report["budget"] = train_budget(shape, args, tokens)
        if args.lora_steps > 0:
            report["diffusers-lora"] = train_lora(args)
    print_report(report)
    write(report, Path(args.out))
    return report


def print_report(report):
    print()
    for name, part in report.items():
        if name == "environment":
            continue
        equal = part["losses_bitwise_equal"]
        a, b = part["median_ms"]["plain"], part["median_ms"]["stash"]
        verdict = "bitwise equal at all" if all(equal) else f"DIFFERENT at {equal.count(False)} of"
        print(f"{name}: losses {verdict} {len(equal)} steps; median step (first dropped) {a:.1f} ms without, {b:.1f} "
              f"ms with the stash ({(b - a) / a * 100:+.1f}%); kept after the last forward {part['kept_bytes']:,} "
              "bytes "
              f"({', '.join(f'layer {i}: {n:,}' for i, n in part['kept_by_layer'].items())}); predicted per layer "
              f"{part['predicted_bytes_per_layer']:,} ({part.get('prediction_formula', 'the longest batch')})")
        if name == "budget":
            print(f"  per step (seq: held after the forward / predicted / peak / declined): "
                  + "; ".join(f"{s['seq']}: {s['bytes']:,}/{s['predicted_held']:,}/{s['peak_bytes']:,}/{s['declined']}"
                              for s in part["per_step"]))
            a, b = part["total_ms"]["plain"], part["total_ms"]["stash"]
            print(f"  peak {part['peak_bytes']:,} <= budget {part['max_bytes']:,} bytes (asserted every step); "
                  f"{part['keeps']} keeps, {part['declined']} declined; total step time {a:.0f} -> {b:.0f} ms "
                  f"({(b - a) / a * 100:+.1f}%)")
    plain = report["plain"]
    print("plain losses, step by step (A, B): " + " ".join(f"{a:.4f}{'=' if a == b else '!='}{b:.4f}" for a, b in
                                                       zip(plain["losses"]["plain"], plain["losses"]["stash"])))


def write(report, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / 'demo.json'}")
        return
    plain = report["plain"]
    fig, (ax_l, ax_t, ax_k) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = range(1, plain["steps"] + 1)
    ax_l.plot(steps, plain["losses"]["plain"], lw=3, alpha=0.5, label="A: reentrant checkpointing")
    ax_l.plot(steps, plain["losses"]["stash"], "--", color="black", label="B: + attention stash")
    equal = " (bitwise equal)" if all(plain["losses_bitwise_equal"]) else ""
    ax_l.set(xlabel="step", ylabel="loss", title="training loss" + equal)
    for key, label in (("plain", "A: no stash"), ("stash", "B: stash")):
        ax_t.plot(steps, plain["times_ms"][key], marker=".", label=f"{label}, median {plain['median_ms'][key]:.0f} ms")
    ax_t.set(xlabel="step", ylabel="forward + backward, ms", title="step time")
    kept = plain["kept_by_layer"]
    ax_k.bar([f"layer {i}" for i in kept], [n / 1e6 for n in kept.values()], label="kept")
    ax_k.axhline(plain["predicted_bytes_per_layer"] / 1e6, color="gray", ls=":", label="predicted")
    ax_k.set(ylabel="MB", title=f"kept by the stash: {plain['kept_bytes'] / 1e6:.2f} MB in total")
    for ax in (ax_l, ax_t, ax_k):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)
    plt.close(fig)
    written = [out / "demo.json", out / "demo.png"]
    budget = report.get("budget")
    if budget:
        per = budget["per_step"]
        fig, ax = plt.subplots(figsize=(8, 4.4))
        x = range(1, len(per) + 1)
        ax.bar(x, [s["bytes"] / 1e6 for s in per], alpha=0.6, label="held after the forward")
        ax.plot(x, [s["peak_bytes"] / 1e6 for s in per], "o", label="peak during the step")
        ax.plot(x, [s["all_layers_bytes"] / 1e6 for s in per], "_", ms=18, mew=2, color="gray",
                label="all layers would need")
        ax.axhline(budget["max_bytes"] / 1e6, color="tab:red", ls="--", label=f"budget {budget['max_bytes']:,} bytes")
        ax.set(xlabel="step", ylabel="MB held by the stash", title="bytes held against the budget (declined: "
               + ", ".join(str(s["declined"]) for s in per) + ")")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "demo_budget.png", dpi=110)
        plt.close(fig)
        written.append(out / "demo_budget.png")
    print("wrote " + ", ".join(map(str, written)))


def all_equal(report):
    """Whether every configuration's losses were bitwise equal at every step."""
    return all(all(part["losses_bitwise_equal"]) for name, part in report.items() if name != "environment")


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all_equal(result) or result["plain"]["shape"]["device"] != "cpu" else 1)
