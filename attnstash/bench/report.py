"""What the experiments print and write.

Every mode prints a table or summary on stdout and, under --out (default out/bench),
writes its report dict as JSON with every raw timing: bench.json and bench.png (model mode:
step time and memory against the number of stashed layers), layer.json (layer mode),
soak.json (soak mode), profile.json and profile.md (profile mode: the markdown tables and
the accounting), seq_sweep.json and seq_sweep.png (seq-sweep mode: saved ms and kept MB
against the sequence length).
"""
import json
import math


def write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def write_json_and_plot(out_dir, stem, report, plot):
    """out_dir/<stem>.json, and out_dir/<stem>.png by plot(report, path) (None without
    matplotlib); says what it wrote."""
    write_json(out_dir / f"{stem}.json", report)
    png = plot(report, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / (stem + '.json')}" + (f" and {png}" if png else ""))


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


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path, title):
    """Title the figure, write it to path and close it; returns path."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_model_report(report, path):
    """Step time and peak memory against the number of stashed layers (0 = reentrant), with
    SAC, plain non-reentrant and no checkpointing as horizontal lines, and the budget rows
    at the number of layers they kept. Returns the path, or None without matplotlib."""
    plt = pyplot()
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
    return _save(plt, fig, path, f"attnstash, {s['layers']} layers, H{s['heads']}/{s['kv_heads']} D{s['head_dim']} "
                 f"S{s['seq']} B{s['batch']} {_precision(s)} on {report['environment'].get('gpu', s['device'])}")


# ---- layer mode -----------------------------------------------------------------------------

def _grads(check):
    if "grads_equal" not in check:
        return ""
    return "bitwise equal" if check["grads_equal"] else f"max rel. diff {check['grad_max_rel_diff']:.3g}"


def _saved_line(modes):
    parts = []
    for mode, m in modes.items():
        label = "SAC vs plain non-reentrant" if mode == "SAC" else mode
        parts.append(f"{label} {m['saved_ms_per_layer']:.3f} ms (efficiency {m['efficiency']:.2f})")
    return "; ".join(parts)


def _sac_line(stash_vs_sac):
    parts = []
    for name, d in stash_vs_sac.items():
        peak = "" if d["peak_bytes"] is None else f", peak memory {d['peak_bytes'] / 1e6:+,.2f} MB"
        parts.append(f"{name} {d['ms']:+.3f} ms{peak}")
    return "; ".join(parts)


def print_layer_report(report, describe_shape):
    rounds, attn_ms = report["rounds"], report["attention_forward_ms"]
    print(f"one decoder layer: {describe_shape}\nSDPA backend picked: {report['sdpa_backend']}")
    print(f"forward + backward, medians of {rounds['repeats']} interleaved rounds after {rounds['warmup']} warm-up; "
          "peak = live tensor bytes above the step's start, in a separate check step:")
    print(f"  {'configuration':<25} {'step ms':>9} {'peak memory':>13} {'kept':>11} {'replays':>8}  "
          "gradients vs plain")
    for name, c in report["configs"].items():
        print(f"  {name:<25} {c['median_ms']:>9.3f} {mb(c['peak_bytes']):>13} {mb(c['kept_bytes']):>11} "
              f"{c['replays']:>8}  {_grads(c)}")
    print(f"  {'attention forward alone':<25} {attn_ms:>9.3f}")
    print(f"saved per stashed layer and micro-batch: {_saved_line(report['modes'])}; the seed PR measured "
          f"{report['seed_pr_h100_saved_ms']} ms on an H100")
    if report["stash_vs_sac"]:
        print(f"stash - SAC: {_sac_line(report['stash_vs_sac'])} (negative: the stash is faster / smaller)")
    floors = ", ".join(f"{k}: {_grads(v)}" for k, v in report["grad_noise_floor"].items())
    print(f"gradient noise floor (a second plain step vs the first): {floors}")


# ---- profile mode ---------------------------------------------------------------------------

def _short(name, width=90):
    name = " ".join(str(name).split())
    return name if len(name) <= width else name[: width - 1] + "\u2026"


def _cell(text):
    return str(text).replace("|", "\\|")


def _ms(x):
    return "-" if x is None else f"{x:.3f}"


def profile_summary_rows(report):
    """One row per profiled configuration: the figures profile.md's summary table shows."""
    rows = []
    for name in report["order"]:
        c = report["configs"][name]
        if "error" in c:
            rows.append({"name": name, "error": c["error"].strip().splitlines()[-1]})
            continue
        w, h = c["device"]["windows"], c["host"]
        rows.append({
            "name": name, "gpu_span": w["step"]["span_ms"], "gpu_busy": w["step"]["busy_ms"],
            "gpu_idle": w["step"]["idle_ms"], "bwd_span": w["backward"]["span_ms"],
            "bwd_idle": w["backward"]["idle_ms"],
            "rec_span": w["recompute"]["span_ms"], "rec_idle": w["recompute"]["idle_ms"],
            "host_step": h["range_ms"]["step"], "host_recompute": h["range_ms"]["recompute"],
            "stash_self": h["attnstash_self_ms"], "stash_total": h["attnstash_total_ms"],
            "syncs": c["syncs"]["count"], "allocs": c["allocator"]["calls"],
            "replays": (f"{c['stash']['replays'] / c['stash']['steps']:g}" if c.get("stash", {}).get("steps")
                        else "-"),
        })
    return rows


def profile_markdown(report, top=40, host_top=20):
    """profile.md: the summary per configuration, the attnstash ops' host time, and for each
    comparison the accounting paragraph and the kernel (and host op) tables, sorted by
    |difference|. Every figure is milliseconds per profiled step."""
    s, env = report["shape"], report["environment"]
    cuda = "CUDA" in report["activities"]
    out = ["# attnstash profile: one checkpointed decoder layer, forward + backward", ""]
    out.append(f"Shape: {s['heads']} query / {s['kv_heads']} KV heads x {s['head_dim']}, hidden {s['hidden']}, MLP "
               f"{s['intermediate']}, micro-batch {s['batch']} x seq {s['seq']}, {_precision(s)} on "
               f"{env.get('gpu', s['device'])}; SDPA backend {report['sdpa_backend']}; torch {env['torch']}"
               + (f", cuDNN {env['cudnn']}" if env.get("cudnn") else "") + ".")
    out.append(f"Per configuration {report['warmup']} warm-up steps, then {report['steps']} steps under torch.profiler "
               f"({' + '.join(report['activities'])}); every figure below is **milliseconds per step** (summed over "
               "the profiled steps, divided by their number). The profiler slows the host; kernel times are the "
               "device's own.")
    if not cuda:
        out.append("")
        out.append("**CPU only (no CUDA): there are no kernels, so every GPU figure is 0 and the kernel tables are "
                   "empty; the host figures are real.**")
    ref = report["attention_forward_alone"]
    out += ["", f"Attention forward alone: GPU kernel time {_ms(ref['gpu_ms_per_call'])} ms per call, host "
            f"{_ms(ref['host_ms_per_call'])} ms per call.", ""]

    out += ["## Per configuration", "",
            "GPU span = first kernel start to last kernel end of the step; busy = union of kernel intervals; "
            "idle = span - busy. Backward = recompute + backward (kernels launched inside `loss.backward()`); "
            "recompute = the layer's forward run inside the backward. Host = CPU time of the range. attnstash "
            "self / total = host time of the attnstash::* ops (self excludes nested ops and runtime calls; total "
            "counts outermost calls). Syncs = synchronising calls inside forward/backward; allocs = "
            "cudaMalloc/cudaFree (and cuMem*) calls.", "",
            "| configuration | GPU span | GPU busy | GPU idle | bwd span | bwd idle | recompute span | recompute idle "
            "| host step | host recompute | attnstash self | attnstash total | syncs | allocs | replays |",
            "|---|" + "---:|" * 14]
    for r in profile_summary_rows(report):
        if "error" in r:
            out.append(f"| {r['name']} | analysis failed: {_cell(r['error'])} |" + " |" * 13)
            continue
        out.append(f"| {r['name']} | {r['gpu_span']:.3f} | {r['gpu_busy']:.3f} | {r['gpu_idle']:.3f} | "
                   f"{r['bwd_span']:.3f} | {r['bwd_idle']:.3f} | {r['rec_span']:.3f} | {r['rec_idle']:.3f} | "
                   f"{r['host_step']:.3f} | {r['host_recompute']:.3f} | {r['stash_self']:.3f} | "
                   f"{r['stash_total']:.3f} | {r['syncs']:g} | {r['allocs']:g} | {r['replays']} |")

    out += ["", "## attnstash ops (host)", "", "| configuration | op | calls | self ms | total ms |",
            "|---|---|---:|---:|---:|"]
    any_op = False
    for name in report["order"]:
        for op, v in report["configs"][name].get("host", {}).get("attnstash_ops", {}).items():
            any_op = True
            out.append(f"| {name} | `{op}` | {v['calls']:g} | {v['self_ms']:.3f} | {v['total_ms']:.3f} |")
    if not any_op:
        out.append("| (none) | | | | |")

    extra = []
    for name in report["order"]:
        c = report["configs"][name]
        for kind in ("syncs", "allocator"):
            for call, v in c.get(kind, {}).get("by_name", {}).items():
                extra.append(f"| {name} | {kind} | `{call}` | {v['count']:g} | {v['ms']:.3f} |")
        for counter, v in c.get("allocator_counters", {}).items():
            if v:
                extra.append(f"| {name} | caching allocator (all profiled steps) | {counter} | {v:g} | |")
    out += ["", "## Synchronisations and allocator calls", ""]
    if extra:
        out += ["| configuration | kind | call | per step | ms per step |", "|---|---|---|---:|---:|"] + extra
    else:
        out.append("None inside the profiled steps" + ("." if cuda else " (CPU only: no CUDA runtime calls)."))

    for label, c in report["comparisons"].items():
        a = c["accounting"]
        out += ["", f"## {label}: {c['other']} vs {c['base']}", ""]
        idle = a["idle_diff_by_window_ms"]
        out.append(
            f"**Accounting.** {c['other']} step GPU time - {c['base']} step GPU time = "
            f"{a['other_span_ms']:.3f} - {a['base_span_ms']:.3f} = **{a['span_diff_ms']:+.3f} ms** = "
            f"({a['attention_forward_diff_ms']:+.3f}: attention forward kernels, negative where removed; first "
            f"forward {a['attention_forward_diff_by_phase_ms']['forward']:+.3f}, recompute "
            f"{a['attention_forward_diff_by_phase_ms']['recompute']:+.3f}) "
            f"+ ({a['grown_ms']:.3f}: other kernels added or grown) - ({a['shrunk_ms']:.3f}: other kernels shrunk "
            f"or gone) - ({a['overlap_diff_ms']:+.3f}: difference in kernel overlap) + ({a['idle_diff_ms']:+.3f}: "
            f"difference in GPU idle time; forward {idle['forward']:+.3f}, backward {idle['backward']:+.3f}, of "
            f"which recompute {idle['recompute']:+.3f}); residual {a['residual_ms']:+.2g} ms. The kernels' summed "
            f"time differs by {a['kernel_sum_diff_ms']:+.3f} ms. Host: step {c['host_range_diff_ms']['step']:+.3f} "
            f"ms, recompute {c['host_range_diff_ms']['recompute']:+.3f} ms; synchronisations "
            f"{c['syncs_diff']:+g} and allocator calls {c['allocator_calls_diff']:+g} per step.")
        removed = a["removed_attention_forward_kernels"]
        if removed:
            out.append("")
            out.append("Attention forward kernels removed: " + "; ".join(
                f"{r['phase']} `{_short(r['name'], 70)}` {r['diff_ms']:+.3f} ms" for r in removed))
        out += ["", f"Kernels (GPU ms per step), top {top} by |difference| of {len(c['kernels'])}:", ""]
        if c["kernels"]:
            out += [f"| phase | class | launched by | kernel | {c['base']} | {c['other']} | difference | calls "
                    "| change |",
                    "|---|---|---|---|---:|---:|---:|---|---|"]
            for r in c["kernels"][:top]:
                out.append(f"| {r['phase']} | {r['class']} | `{_cell(_short(r['op'], 50))}` | "
                           f"`{_cell(_short(r['name']))}` | {r['base_ms']:.3f} | {r['other_ms']:.3f} | "
                           f"{r['diff_ms']:+.3f} | {r['base_calls']:g} -> {r['other_calls']:g} | {r['change']} |")
        else:
            out.append("(no kernels" + (")" if cuda else ": CPU only)"))
        out += ["", f"Host ops (self CPU ms per step), top {host_top} by |difference|:", "",
                f"| phase | op | {c['base']} | {c['other']} | difference | calls |", "|---|---|---:|---:|---:|---|"]
        for r in c["host_ops"][:host_top]:
            out.append(f"| {r['phase']} | `{_cell(_short(r['name'], 70))}` | {r['base_ms']:.3f} | "
                       f"{r['other_ms']:.3f} | {r['diff_ms']:+.3f} | {r['base_calls']:g} -> {r['other_calls']:g} |")
    return "\n".join(out) + "\n"


def print_profile_report(report):
    print(f"\nprofile ({' + '.join(report['activities'])}; {report['steps']} steps after {report['warmup']} "
          "warm-up), ms per step:")
    print(f"  {'configuration':<25} {'GPU span':>9} {'GPU idle':>9} {'bwd idle':>9} {'host step':>10} "
          f"{'attnstash':>10} {'syncs':>6}")
    for r in profile_summary_rows(report):
        if "error" in r:
            print(f"  {r['name']:<25} analysis failed: {r['error']}")
            continue
        print(f"  {r['name']:<25} {r['gpu_span']:>9.3f} {r['gpu_idle']:>9.3f} {r['bwd_idle']:>9.3f} "
              f"{r['host_step']:>10.3f} {r['stash_total']:>10.3f} {r['syncs']:>6g}")
    for label, c in report["comparisons"].items():
        a = c["accounting"]
        print(f"  {label}: GPU span {a['span_diff_ms']:+.3f} = attention forward {a['attention_forward_diff_ms']:+.3f} "
              f"+ grown {a['grown_ms']:.3f} - shrunk {a['shrunk_ms']:.3f} - overlap {a['overlap_diff_ms']:+.3f} "
              f"+ idle {a['idle_diff_ms']:+.3f}; host step {c['host_range_diff_ms']['step']:+.3f}")


# ---- seq-sweep mode -------------------------------------------------------------------------

def print_sweep_report(report):
    print(f"\nsequence sweep ({report['batch_note']}), one decoder layer, medians:")
    header = (f"  {'seq':>6} {'attn fwd ms':>11} {'saved re.':>10} {'eff':>6} {'saved n-r':>10} {'eff':>6} "
              f"{'stash-SAC re.':>13} {'kept MB':>9} {'predicted':>10} {'rounds':>6}")
    print(header)
    for p in report["points"]:
        if "error" in p:
            print(f"  {p['seq']:>6} failed: {p['error'].splitlines()[0][:150]}")
            continue
        m = p["modes"]
        re_, nr = m.get("reentrant", {}), m.get("non-reentrant", {})
        fmt = lambda d, k, f: (format(d[k], f) if k in d else "-")  # noqa: E731
        sac = p["stash_vs_sac"].get("reentrant + stash", {})
        kept = next(iter(p["kept_bytes_measured"].values()), None)
        print(f"  {p['seq']:>6} {p['attention_forward_ms']:>11.3f} {fmt(re_, 'saved_ms_per_layer', '.3f'):>10} "
              f"{fmt(re_, 'efficiency', '.2f'):>6} {fmt(nr, 'saved_ms_per_layer', '.3f'):>10} "
              f"{fmt(nr, 'efficiency', '.2f'):>6} {fmt(sac, 'ms', '+.3f'):>13} "
              f"{(kept or 0) / 1e6:>9.2f} {(p['kept_bytes_predicted'] or 0) / 1e6:>10.2f} {p['rounds']['repeats']:>6}")
    print(f"  the sweep took {report['seconds']:.1f} s")


def plot_sweep(report, path):
    """Saved ms per stashed layer (and the attention forward, the limit) and kept MB per layer
    (measured and predicted) against the sequence length. Returns the path, or None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    points = [p for p in report["points"] if "error" not in p]
    seqs = [p["seq"] for p in points]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_t.plot(seqs, [p["attention_forward_ms"] for p in points], ":", marker=".", color="gray",
              label="attention forward alone (the limit)")
    styles = {"reentrant": ("o", "tab:blue", "reentrant: plain - stash"),
              "non-reentrant": ("s", "tab:orange", "non-reentrant: plain - stash"),
              "SAC": ("^", "tab:green", "SAC: plain non-reentrant - SAC")}
    for mode, (marker, color, label) in styles.items():
        pts = [(p["seq"], p["modes"][mode]["saved_ms_per_layer"]) for p in points if mode in p["modes"]]
        if pts:
            ax_t.plot(*zip(*pts), marker=marker, color=color, label=label)
    ax_t.set_xscale("log", base=2)
    plotted = [y for line in ax_t.get_lines() for y in line.get_ydata()]
    if plotted and min(plotted) > 0:  # quadratic in the length: a log scale shows every length
        ax_t.set_yscale("log")
    ax_t.set_xlabel("sequence length")
    ax_t.set_ylabel("ms per layer and micro-batch")
    ax_t.set_title("time saved per stashed layer")
    ax_t.legend(fontsize=8)
    for mode, (marker, color, _) in styles.items():
        pts = [(p["seq"], p["kept_bytes_measured"][mode] / 1e6) for p in points
               if p["kept_bytes_measured"].get(mode) is not None]
        if pts:
            ax_m.plot(*zip(*pts), marker=marker, color=color, label=f"kept by the stash ({mode})")
    pred = [(p["seq"], p["kept_bytes_predicted"] / 1e6) for p in points if p["kept_bytes_predicted"] is not None]
    if pred:
        ax_m.plot(*zip(*pred), ":", color="gray", label="predicted (attnstash.backends.kept_bytes)")
    ax_m.set_xscale("log", base=2)
    if ax_m.get_lines():
        ax_m.set_yscale("log")
    ax_m.set_xlabel("sequence length")
    ax_m.set_ylabel("MB per layer and micro-batch")
    ax_m.set_title("kept bytes per layer")
    ax_m.legend(fontsize=8)
    for ax in (ax_t, ax_m):
        if seqs:
            ax.set_xticks(seqs)
            ax.set_xticklabels([str(x) for x in seqs])
    s = report["shape"]
    return _save(plt, fig, path, f"attnstash, one layer, H{s['heads']}/{s['kv_heads']} D{s['head_dim']} "
                 f"hidden {s['hidden']}, {report['batch_note']}, {_precision(s)} on "
                 f"{report['environment'].get('gpu', s['device'])}")


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
