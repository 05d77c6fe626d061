"""What the experiments print and write.

Every mode prints a table or summary on stdout and, under --out (default out/bench),
writes its report dict as JSON with every raw timing: bench.json and bench.png (model mode:
step time and memory against the number of stashed layers), layer.json (layer mode),
soak.json (soak mode).
"""
import json
import math


def write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def mb(n):
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def _precision(shape):
    return f"{shape['dtype']} weights under autocast {shape['amp']}" if shape.get("amp") else shape["dtype"]


# ---- model mode -----------------------------------------------------------------------------

def print_model_report(report):
    shape = report["shape"]
    print(f"\nTraining step (forward + backward, no optimizer; {_precision(shape)}), medians of "
          f"{report['rounds']['repeats']} interleaved rounds after {report['rounds']['warmup']} warm-up; peak = live "
          f"tensor bytes above the step's start "
          f"({'CUDA allocator' if shape['device'] == 'cuda' else 'CPU allocations recorded by the profiler'}).")
    width = max(22, *(len(r["name"]) for r in report["configs"]))
    header = f"{'configuration':<{width}} {'step ms':>10} {'vs reentrant':>13} {'kept':>12} {'predicted':>12} " \
             f"{'peak memory':>13} {'replays':>8}  loss"
    print(header)
    print("-" * len(header))
    for r in report["configs"]:
        print(f"{r['name']:<{width}} {r['median_ms']:>10.2f} {r['vs_reentrant'] * 100:>+12.2f}% "
              f"{mb(r['kept_bytes']):>12} {mb(r['predicted_kept_bytes']):>12} {mb(r['peak_bytes']):>13} "
              f"{r['check']['replays']:>8}  {r['loss']:.6f}")
    t_attn = report["attention_forward_ms"]["median_ms"]
    print(f"\nattention forward of one layer ({report['sdpa_backend']}): {t_attn:.3f} ms (median)")
    print(f"kept-bytes prediction: k * [{report['prediction_formula']}]")
    for r in report["configs"]:
        if r["kind"] in ("stash", "stash-nr", "stash-budget"):
            match = "equal" if r["kept_bytes"] == r["predicted_kept_bytes"] else "DIFFERENT"
            if math.isnan(r["efficiency"]):
                saved = "no layer kept"
            else:
                saved = (f"saved {r['saved_ms_per_layer']:.3f} ms per kept layer, efficiency {r['efficiency']:.2f} "
                         "(1.0 = one attention forward per layer)")
            print(f"  {r['name']}: {saved}; kept bytes {match} to the prediction")
            if r["kind"] == "stash-budget":
                print(f"    budget {r['max_bytes']:,} bytes: {r['kept_layers']} of {r['stash_layers']} layers kept, "
                      f"{r['check']['declined']} declined; the stash's peak {r['kept_bytes']:,} bytes <= budget on "
                      "every step (asserted)")
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
            print(f"  {r['name']:<{width}} {describe(r['check'])}")


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_model_report(report, path):
    """Step time and peak memory against the number of stashed layers (0 = reentrant), with
    SAC, plain non-reentrant and no checkpointing as horizontal lines, and the budget rows
    at the number of layers they kept. Returns the path, or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = {r["name"]: r for r in report["configs"]}
    line = [rows["reentrant"]] + [r for r in report["configs"] if r["kind"] == "stash"]
    budgeted = [r for r in report["configs"] if r["kind"] == "stash-budget"]
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
    if budgeted:
        ax_t.scatter([r["kept_layers"] for r in budgeted], [r["median_ms"] for r in budgeted], marker="D",
                     color="tab:purple", zorder=3, label="stash all under a budget (x: layers kept)")
    ax_t.set_xticks(sorted(set(ks) | {r["kept_layers"] for r in budgeted}))
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
    for i, r in enumerate(budgeted):
        x = r["kept_layers"]
        ax_m.scatter([x], [to_mb(r["peak_bytes"])], marker="D", color="tab:purple", zorder=3,
                     label="budget rows: peak memory" if i == 0 else None)
        ax_m.scatter([x], [to_mb(r["kept_bytes"])], marker="d", color="tab:pink", zorder=3,
                     label="budget rows: kept" if i == 0 else None)
        ax_m.hlines(to_mb(r["max_bytes"]), x - 0.3, x + 0.3, color="tab:purple", ls="--",
                    label="budget" if i == 0 else None)
    ax_m.set_xticks(sorted(set(ks) | {r["kept_layers"] for r in budgeted}))
    ax_m.set_xlabel("stashed layers")
    ax_m.set_ylabel("MB (above the step's start)")
    ax_m.set_title("memory")
    ax_m.legend(fontsize=8)
    s = report["shape"]
    precision = f"fp32 + autocast {s['amp']}" if s.get("amp") else s["dtype"]
    fig.suptitle(f"attnstash, {s['layers']} layers, H{s['heads']}/{s['kv_heads']} D{s['head_dim']} "
                 f"S{s['seq']} B{s['batch']} {precision} on {report['environment'].get('gpu', s['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- layer mode -----------------------------------------------------------------------------

def print_layer_report(report, describe_shape):
    runs = report["runs"]
    plain_ms, stash_ms = runs["reentrant, no stash"]["median_ms"], runs["reentrant + stash"]["median_ms"]
    attn_ms, rounds = report["attention_forward_ms"], report["rounds"]
    print(f"one decoder layer: {describe_shape}\nSDPA backend picked: {report['sdpa_backend']}")
    print(f"forward + backward, medians of {rounds['repeats']} interleaved rounds after {rounds['warmup']} warm-up:")
    print(f"  reentrant, no stash   {plain_ms:9.3f} ms")
    print(f"  reentrant + stash     {stash_ms:9.3f} ms")
    print(f"  saved per stashed layer and micro-batch: {plain_ms - stash_ms:.3f} ms; attention forward alone "
          f"{attn_ms:.3f} ms (efficiency {report['efficiency']:.2f}); the seed PR measured 0.93 ms on an H100")
    grads = ("bitwise equal" if report["grads_equal"]
             else f"max relative difference {report['grad_max_rel_diff']:.3g}")
    print(f"  gradients with the stash vs without: {grads}")


# ---- soak mode ------------------------------------------------------------------------------

def print_soak_report(report, describe_shape):
    budget = report["max_bytes"]
    print(f"\nsoak: {report['steps']} steps under {' and under '.join(report['runs'])} checkpointing; "
          f"{describe_shape}" + (f"; budget {budget:,} bytes" if budget is not None else ""))
    for mode, run in report["runs"].items():
        s, rss = run["stash"], run["rss"]
        print(f"  {mode}: {run['steps']} steps in {run['seconds']:.1f} s; micro-batches {run['micro_batches']}")
        print(f"    stash keeps {s['keeps']}, replays {s['replays']}, released unused {s['released_unused']}, "
              f"declined {s['declined']}, misses {s['misses']}; peak {s['peak_bytes']:,} bytes"
              + (f" (budget {budget:,}: never passed, asserted)" if budget is not None else ""))
        print(f"    after every step: 0 entries, 0 bytes (asserted); at the end: {s['entries_at_end']} entries, "
              f"{s['bytes_at_end']} bytes")
        print(f"    RSS first {mb(rss['first'])}, last {mb(rss['last'])}, max {mb(rss['max'])}; second-half slope "
              f"{rss['second_half_slope_bytes_per_step'] / 1e3:+.2f} kB/step over {rss['second_half_steps']} steps "
              f"(one leaked entry per step would add {report['bytes_of_one_kept_entry'] / 1e3:.1f} kB/step)")
