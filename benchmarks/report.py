"""What the modes print and write: times through torch.utils.benchmark.Compare, the other figures
in one plain table, JSON with every raw time under --out, bench.png and seq_sweep.png."""
import json

from torch.utils import benchmark


def write(out, stem, result, plot=None):
    """out/<stem>.json, and out/<stem>.png by plot(result, path) where matplotlib is installed."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plot = None
    if plot is not None:
        fig = plot(plt, result)
        s = result["shape"]
        fig.suptitle(f"attnstash, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, hidden {s['hidden']}, batch "
                     f"{s['batch']}, {s['amp'] or s['dtype']} on {result['environment'].get('gpu', s['device'])}")
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=110)
        plt.close(fig)
    print(f"wrote {out / stem}.json" + (f" and {out / stem}.png" if plot else ""))


def print_measurements(measurements):
    """The medians by torch.utils.benchmark.Compare: configurations as rows, columns by description."""
    compare = benchmark.Compare(list(measurements.values() if isinstance(measurements, dict) else measurements))
    compare.highlight_warnings()
    print(compare, flush=True)


def table(rows, columns):
    """A text table: columns = [(header, row -> value)], the first left-aligned."""
    cells = [[h for h, _ in columns]] + [[str(cell(r)) for _, cell in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def mb(n):
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def num(x, f=".3f"):
    return "-" if x is None else format(x, f)


def grads(r):
    return "bitwise equal" if r["grads_equal"] else f"max rel. diff {r['grad_max_rel_diff']:.3g}"


COLUMNS = [("configuration", lambda r: r["name"]), ("ms", lambda r: num(r["median_ms"], ".2f")),
           ("vs ref.", lambda r: f"{r['vs_reference']:+.1%}"),
           ("saved/layer", lambda r: num(r.get("saved_ms_per_layer"))),
           ("efficiency", lambda r: num(r.get("efficiency"), ".2f")), ("kept", lambda r: mb(r["kept_bytes"])),
           ("predicted", lambda r: mb(r["predicted_kept_bytes"])), ("peak memory", lambda r: mb(r["peak_bytes"])),
           ("kept/declined", lambda r: f"{r['keeps']}/{r['declined']}"),
           ("vs SAC ms", lambda r: num(r.get("vs_sac_ms"), "+.2f")),
           ("vs SAC peak", lambda r: "-" if r.get("vs_sac_peak_bytes") is None
            else f"{r['vs_sac_peak_bytes'] / 1e6:+.2f} MB"),
           ("gradients", lambda r: f"{grads(r)} to {r['compared_with']}")]


def print_rows(point):
    """Every configuration's figures, and what holds across them."""
    rows = point["configs"]
    print(table(rows, COLUMNS))
    reference = next(r["name"] for r in rows if r["compared_with"] == r["name"])
    print(f"vs ref.: against {reference}; saved/layer "
          "(ms): plain checkpointing of the mode - this, per layer the stash kept (SAC: per attention layer); "
          f"efficiency: saved/layer / one attention forward alone ({point['attention_forward_ms']:.3f} ms, "
          f"{point['sdpa_backend']}); kept: the stash's peak; peak memory: live tensor bytes above the step's start")
    wrong = [r["name"] for r in rows if r["kept_bytes"] != r["predicted_kept_bytes"]]
    print(f"predicted per layer (attnstash.plan): {point['prediction_formula']}; kept bytes "
          + (f"DIFFER from it: {', '.join(wrong)}" if wrong else "equal it in every configuration")
          + f"; losses {'bitwise equal' if point['losses_equal'] else 'NOT equal'} at every step of every "
          "configuration;"
          f" noise floor (the reference twice): {grads(point['grad_noise_floor'])}", flush=True)


def _of(point, mode):
    return next((m for name, m in point["modes"].items() if name.startswith(mode + " +") or name.startswith(mode)), {})


def plot_model(plt, result):
    """Step time and memory against the stashed layers under reentrant checkpointing."""
    rows = {r["name"]: r for r in result["configs"]}
    line = [r for r in result["configs"] if r["checkpointing"] == "reentrant" and r["stash_layers"] != 0
            and not r["budget"]]
    ks = [r["stash_layers"] or 0 for r in line]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_t.plot(ks, [r["median_ms"] for r in line], marker="o", label="reentrant + stash (median)")
    ax_t.plot(ks, [line[0]["median_ms"] - k * result["attention_forward_ms"] for k in ks], ":", color="gray",
              label="limit: one attention forward saved per layer")
    ax_m.plot(ks, [r["peak_bytes"] / 1e6 for r in line], marker="o", label="peak memory, reentrant + stash")
    ax_m.plot(ks, [r["kept_bytes"] / 1e6 for r in line], marker="s", label="kept by the stash")
    ax_m.plot(ks, [r["predicted_kept_bytes"] / 1e6 for r in line], ":", color="gray", label="predicted")
    for name, color in (("SAC (non-reentrant)", "tab:green"), ("non-reentrant", "tab:olive"),
                        ("no checkpointing", "tab:red")):
        ax_t.axhline(rows[name]["median_ms"], color=color, ls="--", label=name)
        ax_m.axhline(rows[name]["peak_bytes"] / 1e6, color=color, ls="--", label=f"{name}: peak")
    for r in result["configs"]:
        if r["budget"]:
            ax_t.scatter([r["replays"]], [r["median_ms"]], marker="D", zorder=3, label=r["name"])
            ax_m.scatter([r["replays"]], [r["peak_bytes"] / 1e6], marker="D", zorder=3, label=r["name"])
    for ax, ylabel, title in ((ax_t, "ms", "training step (forward + backward)"),
                              (ax_m, "MB above the step's start", "memory")):
        ax.set(xlabel="stashed layers", ylabel=ylabel, title=title, xticks=ks)
        ax.legend(fontsize=8)
    return fig


def plot_sweep(plt, result):
    """Saved ms per stashed layer (the attention forward alone is the limit) and kept bytes per
    layer (measured, predicted) against the sequence length."""
    points = [p for p in result["points"] if "error" not in p]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    seqs = [p["seq"] for p in points]
    ax_t.plot(seqs, [p["attention_forward_ms"] for p in points], ":", marker=".", color="gray",
              label="attention forward alone (the limit)")
    for mode in ("reentrant", "non-reentrant", "SAC"):
        got = [(p["seq"], _of(p, mode)["saved_ms_per_layer"]) for p in points if _of(p, mode)]
        if got:
            ax_t.plot(*zip(*got), marker="o", label=f"{mode}: saved per layer")
        got = [(p["seq"], p["kept_bytes_measured"][mode] / 1e6) for p in points if mode in p["kept_bytes_measured"]]
        if got:
            ax_m.plot(*zip(*got), marker="o", label=f"kept ({mode})")
    ax_m.plot(seqs, [p["kept_bytes_per_layer"] / 1e6 for p in points], ":", color="gray", label="predicted")
    for ax, ylabel, title in ((ax_t, "ms per layer and micro-batch", "time saved per stashed layer"),
                              (ax_m, "MB per layer and micro-batch", "kept bytes per layer")):
        ax.set(xlabel="sequence length", ylabel=ylabel, title=title, xscale="log")
        ax.minorticks_off()
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.legend(fontsize=8)
    return fig
