"""attnstash.bench and examples/demo.py at tiny sizes on CPU: they run, write what they
promise, report equal losses, and the stash keeps exactly the predicted bytes (and never
more than a budget). Timings are recorded but never asserted on (they are noise at these
sizes)."""
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnstash
from attnstash.bench import models
from attnstash.bench.__main__ import main as bench_main
from attnstash.bench.model_mode import budgets, stash_points

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, hidden 32, 4 query / 2 KV heads of 8, micro-batch 2 x 64 tokens, fp32 on CPU.
TINY = ["--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--seq", "64", "--batch", "2"]
B, H, S, D = 2, 4, 64, 8
PER_LAYER = B * H * S * D * 4 + B * H * S * 4  # fp32 output + fp32 log-sum-exp [B, H, S]
PER_LAYER_BF16 = B * H * S * D * 2 + B * H * S * 4  # bf16 output + fp32 log-sum-exp
# The demo at tiny sizes: 2 layers, micro-batch 1 x 64 tokens.
DEMO_TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--seq", "64",
             "--no-progress"]


def stash_is_uninstalled():
    from tiny_models import nothing_installed
    return nothing_installed()


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    report = bench_main([*TINY, "--repeats", "1", "--warmup", "0", "--out", str(out)])
    assert torch.get_num_threads() == threads  # the benchmark's thread setting is undone
    return report, out


def test_model_mode_writes_json_and_png_with_the_expected_keys(model_run):
    report, out = model_run
    written = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    for key in ("mode", "preset", "shape", "environment", "sdpa_backend", "rounds", "attention_forward_ms",
                "kept_bytes_per_layer", "prediction_formula", "configs", "losses_equal", "max_loss_diff",
                "grad_noise_floor", "wrapper_overhead", "efficiency"):
        assert key in written, key
    assert written["shape"]["layers"] == 2 and written["shape"]["device"] == "cpu"
    assert written["shape"]["amp"] is None
    names = [c["name"] for c in written["configs"]]
    assert names == ["no checkpointing", "reentrant", "reentrant, wrapped", "stash 1", "stash 2",
                     "SAC (non-reentrant)", "non-reentrant", "non-reentrant, stash 2"]
    for config in written["configs"]:
        for key in ("kind", "stash_layers", "times_ms", "median_ms", "vs_reentrant", "loss", "peak_bytes",
                    "kept_bytes", "predicted_kept_bytes", "check"):
            assert key in config, (config["name"], key)
        assert len(config["times_ms"]) == 1  # --repeats 1, --warmup 0: raw timings are kept
        assert config["peak_bytes"] is None or config["peak_bytes"] > 0
    assert len(written["attention_forward_ms"]["times_ms"]) >= 1
    assert set(written["efficiency"]) == {"1", "2"}  # against reentrant; the non-reentrant row has its own
    assert stash_is_uninstalled()


def test_every_configuration_gives_the_same_loss_and_gradients(model_run):
    report, _ = model_run
    assert report["losses_equal"] and report["max_loss_diff"] == 0.0
    assert len({c["loss"] for c in report["configs"]}) == 1
    assert report["grad_noise_floor"]["grads_equal"]
    for config in report["configs"]:  # CPU fp32: the stash's gradients are bitwise the recompute's
        assert config["check"]["grads_equal"], config["name"]


def test_kept_bytes_equal_the_prediction(model_run):
    report, _ = model_run
    assert report["kept_bytes_per_layer"] == PER_LAYER
    for config in report["configs"]:
        check = config["check"]
        assert check["held_after_step"] == {"entries": 0, "bytes": 0}
        if config["kind"] not in ("stash", "stash-nr"):
            assert config["kept_bytes"] == 0 and check["keeps"] == 0 and check["replays"] == 0
            continue
        k = config["stash_layers"]
        assert config["kept_bytes"] == config["predicted_kept_bytes"] == k * PER_LAYER
        assert check["keeps"] == check["replays"] == k and check["misses"] == 0 and check["declined"] == 0
        # Between forward and backward the last k layers each hold one output.
        assert check["held_after_forward"]["by_layer"] == {str(i): [1, PER_LAYER, 0] for i in range(2 - k, 2)}  # entries, bytes, declined


def test_stash_points_and_budgets():
    assert stash_points(None, 4) == [1, 2, 4]
    assert stash_points(None, 48) == [1, 12, 24, 48]
    assert stash_points("1, all", 6) == [1, 6]
    with pytest.raises(ValueError, match="between 1 and the 4 layers"):
        stash_points("0,2", 4)
    assert budgets(None) == [] and budgets("2MB, 1KiB") == [("2MB", 2_000_000), ("1KiB", 1024)]
    with pytest.raises(ValueError):
        budgets("lots")


def test_predictions_come_from_the_backend_table():
    shape = models.make_shape("qwen3-30b-a3b")
    total, formula = models.kept_bytes_per_layer(shape, "CUDNN_ATTENTION")
    assert total == 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16 == 136_314_896
    assert "philox seed" in formula and "cudnn_attention" in formula
    # CUDA flash and memory-efficient attention: output + float32 log-sum-exp + the two extras
    # (flash: its rng state, two uint64, and an unused uint64; efficient: two int64 philox scalars).
    for backend, extras in (("FLASH_ATTENTION", 24), ("EFFICIENT_ATTENTION", 16)):
        total, formula = models.kept_bytes_per_layer(shape, backend)
        assert total == 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + extras and "meta" in formula
        # every kept tensor is a named term of the printed formula, and the terms add up
        terms = [int(t.replace(",", "")) for t in re.findall(r"\(([\d,]+)\)", formula)]
        assert len(terms) == 4 and sum(terms) == total and "extra" not in formula
    assert models.kept_bytes_per_layer(shape, "MATH")[0] is None
    # On this machine's device: attnstash.backends.kept_bytes, for the weights' or the autocast dtype.
    tiny = models.make_shape("tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, seq=64, batch=2)
    assert models.kept_bytes_per_layer(tiny)[0] == PER_LAYER
    assert models.kept_bytes_per_layer(models.make_shape("tiny", heads=4, kv_heads=2, head_dim=8, seq=64, batch=2,
                                                         amp="bf16"))[0] == PER_LAYER_BF16
    from attnstash.backends import KEPT_BACKENDS
    assert models.sac_ops("cpu") == [r.forward_op for r in KEPT_BACKENDS if r.device == "cpu"]
    assert len(models.sac_ops("cuda")) == 3


def test_amp_shapes_keep_float32_weights():
    shape = models.make_shape("demo", amp="bf16", device="cuda")
    assert shape.dtype == "float32" and shape.amp == "bfloat16" and shape.compute_dtype == torch.bfloat16
    assert "autocast bfloat16" in shape.describe()
    with pytest.raises(ValueError, match="float32 weights"):
        models.make_shape("demo", amp="fp16", dtype="bfloat16")


LAYER_CONFIGS = ["reentrant, no stash", "reentrant + stash", "non-reentrant, no stash", "non-reentrant + stash",
                 "SAC (non-reentrant)"]


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    report = bench_main([*TINY, "--mode", "layer", "--repeats", "1", "--warmup", "0", "--out", str(out)])
    return report, out


def test_layer_mode_runs(layer_run):
    report, out = layer_run
    written = json.loads((out / "layer.json").read_text())
    assert written["sdpa_backend"] == "FLASH_ATTENTION"
    assert set(written["runs"]) == {*LAYER_CONFIGS, "attention forward"}
    assert report["grads_equal"] and report["replays_in_check_step"] >= 1
    for key in ("saved_ms_per_layer", "attention_forward_ms", "efficiency", "grad_max_rel_diff", "rounds", "shape",
                "environment", "configs", "modes", "stash_vs_sac", "grad_noise_floor", "checkpointing",
                "predicted_kept_bytes_per_layer"):
        assert key in written, key
    assert list(written["configs"]) == LAYER_CONFIGS
    assert set(written["modes"]) == {"reentrant", "non-reentrant", "SAC"}
    for mode in ("reentrant", "non-reentrant"):
        m = written["modes"][mode]
        assert m["saved_ms_per_layer"] == pytest.approx(m["plain_ms"] - m["stash_ms"])
        assert m["efficiency"] == pytest.approx(m["saved_ms_per_layer"] / written["attention_forward_ms"])
    assert written["saved_ms_per_layer"] == written["modes"]["reentrant"]["saved_ms_per_layer"]
    assert set(written["stash_vs_sac"]) == {"reentrant + stash", "non-reentrant + stash"}
    for name, d in written["stash_vs_sac"].items():
        assert d["ms"] == pytest.approx(written["configs"][name]["median_ms"]
                                        - written["configs"]["SAC (non-reentrant)"]["median_ms"])
        assert d["peak_bytes"] == d["stash_peak_bytes"] - d["sac_peak_bytes"]
    assert stash_is_uninstalled()


def test_layer_mode_configurations_give_bitwise_equal_gradients(layer_run):
    """Every configuration's check step against its plain counterpart (the stash and SAC against plain
    checkpointing of the same mode): bitwise equal on CPU fp32; the stash keeps and replays exactly one
    layer's output and log-sum-exp, the other configurations nothing."""
    report, _ = layer_run
    compared = {"reentrant + stash": "reentrant, no stash", "non-reentrant + stash": "non-reentrant, no stash",
                "SAC (non-reentrant)": "non-reentrant, no stash"}
    for name, config in report["configs"].items():
        assert config["peak_bytes"] is None or config["peak_bytes"] > 0
        assert config["held_after_step"] == {"entries": 0, "bytes": 0} and config["misses"] == 0
        if name in compared:
            assert config["compared_with"] == compared[name]
            assert config["grads_equal"] and config["grad_max_rel_diff"] == 0.0, name
        if name.endswith("+ stash"):
            assert config["keeps"] == config["replays"] == 1 and config["kept_bytes"] == PER_LAYER
        else:
            assert config["keeps"] == config["replays"] == 0 and config["kept_bytes"] == 0
    assert report["predicted_kept_bytes_per_layer"] == PER_LAYER
    assert set(report["grad_noise_floor"]) == {"reentrant, no stash", "non-reentrant, no stash"}
    assert all(f["grads_equal"] for f in report["grad_noise_floor"].values())


def test_layer_mode_runs_one_checkpointing_mode(tmp_path):
    report = bench_main([*TINY, "--mode", "layer", "--checkpointing", "reentrant", "--repeats", "1", "--warmup", "0",
                         "--out", ""])
    assert set(report["runs"]) == {"reentrant, no stash", "reentrant + stash", "attention forward"}
    assert set(report["modes"]) == {"reentrant"} and report["stash_vs_sac"] == {}
    assert report["grads_equal"] and report["replays_in_check_step"] == 1
    report = bench_main([*TINY, "--mode", "layer", "--checkpointing", "non-reentrant", "--repeats", "1", "--warmup",
                         "0", "--out", ""])
    assert list(report["configs"]) == ["non-reentrant, no stash", "non-reentrant + stash", "SAC (non-reentrant)"]
    assert report["saved_ms_per_layer"] == report["modes"]["non-reentrant"]["saved_ms_per_layer"]
    assert report["grads_equal"] and report["replays_in_check_step"] == 1
    assert stash_is_uninstalled()


# ---- profile mode ---------------------------------------------------------------------------------

PROFILE_KEYS = ("mode", "preset", "shape", "environment", "sdpa_backend", "checkpointing", "activities", "steps",
                "warmup", "order", "attention_forward_alone", "configs", "comparisons")
COMPARISONS = ("reentrant: stash vs plain", "non-reentrant: stash vs plain", "SAC vs non-reentrant plain",
               "reentrant + stash vs SAC", "non-reentrant + stash vs SAC")
ACCOUNTING_KEYS = ("base_span_ms", "other_span_ms", "span_diff_ms", "attention_forward_diff_ms", "grown_ms",
                   "shrunk_ms", "attention_forward_diff_by_phase_ms", "kernel_sum_diff_ms", "overlap_diff_ms",
                   "idle_diff_ms", "idle_diff_by_window_ms", "residual_ms", "removed_attention_forward_kernels")


def test_profile_mode_writes_its_files_on_cpu(tmp_path):
    """The CPU dry run of --mode profile: the same files as on a GPU, host figures filled, no kernels."""
    report = bench_main([*TINY, "--mode", "profile", "--repeats", "2", "--warmup", "1", "--traces",
                         "--out", str(tmp_path)])
    written = json.loads((tmp_path / "profile.json").read_text())
    for key in PROFILE_KEYS:
        assert key in written, key
    assert written["activities"] == ["CPU"] and written["steps"] == 2 and written["warmup"] == 1
    assert written["order"] == ["attention forward alone", *LAYER_CONFIGS]
    for name in written["order"]:
        config = written["configs"][name]
        assert "error" not in config, config.get("error")
        for key in ("steps", "ranges_found", "device", "host", "syncs", "allocator", "profiled_seconds"):
            assert key in config, (name, key)
        assert config["device"]["events"] == 0 and config["device"]["kernels"] == []  # CPU: no kernels
        assert set(config["device"]["windows"]) == {"step", "forward", "backward", "recompute"}
        assert config["syncs"]["count"] == 0 and config["host"]["range_ms"]["step"] > 0
        if name == "attention forward alone":
            continue
        # Every profiled step has its ranges, the recompute included.
        assert config["ranges_found"] == {"bench:step": 2, "bench:forward": 2, "bench:backward": 2,
                                          "bench:recompute": 2}, name
        stashed = name.endswith("+ stash")
        assert config["stash"] == {"steps": 3, "keeps": 3 * stashed, "replays": 3 * stashed, "declined": 0,
                                   "misses": 0}
        ops = config["host"]["attnstash_ops"]
        assert ("attnstash::sdpa_fwd_keep" in ops) == stashed, name
        if stashed:
            assert ops["attnstash::sdpa_fwd_keep"]["calls"] == 2  # one per step: the first forward and the recompute
            assert 0 < config["host"]["attnstash_self_ms"] and 0 < config["host"]["attnstash_total_ms"]
        for op in config["host"]["ops"]:
            assert op["self_ms"] >= 0, (name, op)
    assert set(written["comparisons"]) == set(COMPARISONS)
    for label, comparison in written["comparisons"].items():
        for key in ACCOUNTING_KEYS:
            assert key in comparison["accounting"], (label, key)
        assert comparison["accounting"]["residual_ms"] == pytest.approx(0.0, abs=1e-9)
    # What the stash changes is visible on the host: the recompute no longer runs the attention forward.
    for label in ("reentrant: stash vs plain", "non-reentrant: stash vs plain"):
        rows = {(r["phase"], r["name"]): r for r in written["comparisons"][label]["host_ops"]}
        attention = rows[("recompute", "aten::_scaled_dot_product_flash_attention_for_cpu")]
        assert attention["base_calls"] == 1 and attention["other_calls"] == 0 and attention["change"] == "disappears"
    markdown = (tmp_path / "profile.md").read_text()
    for text in ("## Per configuration", "## attnstash ops (host)", "**Accounting.**", "CPU only", *LAYER_CONFIGS,
                 *COMPARISONS):
        assert text in markdown, text
    import tarfile
    with tarfile.open(tmp_path / "profile_traces.tar.gz") as tar:
        names = tar.getnames()
        assert len(names) == 6 and all(n.endswith(".json") for n in names)
        assert "traceEvents" in json.load(tar.extractfile(names[0]))
    assert report["comparisons"].keys() == written["comparisons"].keys()
    assert stash_is_uninstalled()


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _gpu_trace(stash):
    """A Chrome trace shaped like the CUDA profiler's, for one step: the forward launches a GEMM and
    the attention forward; the backward (on the autograd thread, 2) recomputes (a GEMM and, without the
    stash, the attention forward again, 100 us; with it, a 20 us copy inside an attnstash op, and the
    later kernels run 80 us earlier), then the attention backward, a synchronisation and a cudaMalloc.
    A memset has no launch event, only the External id of its op. Times in microseconds."""
    ev = [_x("user_annotation", "bench:step", 0, 1000), _x("user_annotation", "bench:forward", 10, 290),
          _x("user_annotation", "bench:backward", 300, 690),
          _x("cpu_op", "aten::mm", 20, 20), _x("cuda_runtime", "cudaLaunchKernel", 25, 5, correlation=1),
          _x("kernel", "gemm", 50, 100, tid=7, correlation=1),
          _x("cpu_op", "aten::_scaled_dot_product_cudnn_attention", 60, 20),
          _x("cuda_runtime", "cudaLaunchKernel", 65, 5, correlation=2),
          _x("kernel", "cudnn_fprop", 150, 100, tid=7, correlation=2),
          _x("user_annotation", "bench:recompute", 320, 180, tid=2),
          _x("cpu_op", "aten::mm", 330, 10, tid=2),
          _x("cuda_runtime", "cudaLaunchKernel", 332, 2, tid=2, correlation=3),
          _x("kernel", "gemm", 400, 100, tid=7, correlation=3),
          _x("cpu_op", "aten::_scaled_dot_product_cudnn_attention_backward", 600, 20, tid=2, **{"External id": 9}),
          _x("cuda_runtime", "cudaLaunchKernel", 605, 5, tid=2, correlation=5),
          _x("kernel", "cudnn_bprop", 540 if stash else 620, 200, tid=7, correlation=5),
          _x("gpu_memset", "Memset (Device)", 750 if stash else 830, 10, tid=7, correlation=77, **{"External id": 9}),
          _x("cuda_runtime", "cudaStreamSynchronize", 700, 10, tid=2),
          _x("cuda_runtime", "cudaMalloc", 720, 10, tid=2),
          {"ph": "s", "cat": "ac2g", "name": "flow", "id": 1, "ts": 25}]
    if stash:
        ev += [_x("cpu_op", "attnstash::sdpa_fwd_keep", 350, 30, tid=2), _x("cpu_op", "aten::copy_", 355, 10, tid=2),
               _x("cuda_runtime", "cudaLaunchKernel", 357, 2, tid=2, correlation=4),
               _x("kernel", "copy_kernel", 510, 20, tid=7, correlation=4)]
    else:
        ev += [_x("cpu_op", "aten::_scaled_dot_product_cudnn_attention", 350, 20, tid=2),
               _x("cuda_runtime", "cudaLaunchKernel", 355, 5, tid=2, correlation=4),
               _x("kernel", "cudnn_fprop", 510, 100, tid=7, correlation=4)]
    return ev


def test_profile_analysis_of_a_cuda_trace():
    """The GPU half of --mode profile, which the CPU cannot run: kernels attributed to the range their
    launch was made in and to the attention op around it, the windows' idle time, the synchronisations
    and allocator calls, and an accounting that adds up."""
    from attnstash.bench import profile, report as reporting
    plain, stash = profile.analyse_trace(_gpu_trace(False), 1), profile.analyse_trace(_gpu_trace(True), 1)
    rows = {(r["phase"], r["class"], r["name"]): r for r in plain["device"]["kernels"]}
    assert rows[("forward", "attention forward", "cudnn_fprop")]["ms"] == pytest.approx(0.1)
    assert rows[("recompute", "attention forward", "cudnn_fprop")]["op"] == "aten::_scaled_dot_product_cudnn_attention"
    assert rows[("backward", "attention backward", "cudnn_bprop")]["ms"] == pytest.approx(0.2)
    assert rows[("backward", "attention backward", "Memset (Device)")]["calls"] == 1  # via its External id
    assert rows[("recompute", "other", "gemm")]["op"] == "aten::mm"
    assert plain["device"]["without_launch_event"] == 1 and plain["device"]["without_host_origin"] == 0
    w = plain["device"]["windows"]
    # step: kernels 50-150, 150-250, 400-500, 510-610, 620-820, 830-840: span 790, busy 610
    assert w["step"]["span_ms"] == pytest.approx(0.79) and w["step"]["busy_ms"] == pytest.approx(0.61)
    assert w["step"]["idle_ms"] == pytest.approx(0.18) and w["step"]["overlap_ms"] == pytest.approx(0.0)
    assert w["backward"]["span_ms"] == pytest.approx(0.44) and w["backward"]["idle_ms"] == pytest.approx(0.03)
    assert w["recompute"]["span_ms"] == pytest.approx(0.21) and w["recompute"]["idle_ms"] == pytest.approx(0.01)
    assert plain["device"]["lead_ms"] == pytest.approx(0.05)
    # Kernels on two streams overlap: span = sum - overlap + idle.
    assert profile.window([(0, 10), (5, 15), (20, 30)]) == {"span": 30, "busy": 25, "sum": 30, "overlap": 5,
                                                             "idle": 5}
    assert plain["syncs"]["count"] == 1 and plain["allocator"]["by_name"] == {"cudaMalloc": {"count": 1, "ms": 0.01}}
    assert stash["device"]["ms_by_class"]["attnstash"] == pytest.approx(0.02)
    assert stash["host"]["attnstash_ops"]["attnstash::sdpa_fwd_keep"]["self_ms"] == pytest.approx(0.02)

    c = profile.compare(plain, stash)
    a = c["accounting"]
    assert a["span_diff_ms"] == pytest.approx(-0.08)  # 50-840 -> 50-760
    assert a["attention_forward_diff_ms"] == pytest.approx(-0.1) and a["grown_ms"] == pytest.approx(0.02)
    assert a["shrunk_ms"] == pytest.approx(0.0) and a["idle_diff_ms"] == pytest.approx(0.0)
    assert a["attention_forward_diff_by_phase_ms"]["recompute"] == pytest.approx(-0.1)
    assert a["attention_forward_diff_by_phase_ms"]["forward"] == 0.0
    assert a["residual_ms"] == pytest.approx(0.0, abs=1e-12)
    assert [r["name"] for r in a["removed_attention_forward_kernels"]] == ["cudnn_fprop"]
    changes = {(r["phase"], r["name"]): r["change"] for r in c["kernels"]}
    assert changes[("recompute", "cudnn_fprop")] == "disappears" and changes[("recompute", "copy_kernel")] == "appears"
    assert changes[("forward", "cudnn_fprop")] == "same"

    report = {"shape": dataclasses_shape(), "environment": {"torch": "x", "gpu": "a GPU", "cudnn": 1},
              "activities": ["CPU", "CUDA"], "steps": 1, "warmup": 0, "sdpa_backend": "CUDNN_ATTENTION",
              "attention_forward_alone": {"gpu_ms_per_call": 0.1, "host_ms_per_call": 0.02},
              "order": ["plain", "stash"], "configs": {"plain": plain, "stash": stash},
              "comparisons": {"stash vs plain": {"base": "plain", "other": "stash", **c}}}
    markdown = reporting.profile_markdown(report)
    assert "**-0.080 ms**" in markdown and "`cudnn_fprop`" in markdown and "disappears" in markdown
    assert "`cudaStreamSynchronize`" in markdown and "`cudaMalloc`" in markdown


def dataclasses_shape():
    import dataclasses
    return dataclasses.asdict(models.make_shape("qwen3-30b-a3b"))


# ---- seq-sweep mode -------------------------------------------------------------------------------

def test_seq_sweep_writes_its_files_on_cpu(tmp_path, monkeypatch):
    """--mode seq-sweep at tiny lengths: per length layer mode's figures and the kept bytes (measured =
    predicted); at least 5 rounds per length; a length that fails is recorded and the sweep goes on."""
    from attnstash.bench import seq_sweep
    real = seq_sweep.sweep_point

    def failing_at_48(bench, shape, *args, **kwargs):
        if shape.seq == 48:
            raise RuntimeError("CUDA out of memory (pretend)")
        return real(bench, shape, *args, **kwargs)

    monkeypatch.setattr(seq_sweep, "sweep_point", failing_at_48)
    report = bench_main([*TINY, "--mode", "seq-sweep", "--seqs", "64,32,48", "--sweep-seconds", "0.5",
                         "--out", str(tmp_path)])
    written = json.loads((tmp_path / "seq_sweep.json").read_text())
    assert (tmp_path / "seq_sweep.png").stat().st_size > 0
    for key in ("mode", "preset", "shape", "environment", "checkpointing", "seqs", "batch", "batch_note",
                "sweep_seconds", "points", "seconds"):
        assert key in written, key
    assert written["seqs"] == [32, 48, 64] and written["batch"] == B and f"held at {B}" in written["batch_note"]
    failed = written["points"][1]
    assert failed["seq"] == 48 and "out of memory" in failed["error"]
    for point in (written["points"][0], written["points"][2]):
        seq = point["seq"]
        for key in ("tokens", "sdpa_backend", "rounds", "attention_forward_ms", "runs", "configs", "modes",
                    "stash_vs_sac", "kept_bytes_measured", "kept_bytes_predicted", "round_seconds"):
            assert key in point, key
        assert point["batch"] == B and point["tokens"] == B * seq
        assert point["rounds"]["repeats"] >= 5
        assert all(len(run["times_ms"]) == point["rounds"]["repeats"] for run in point["runs"].values()
                   if run is not point["runs"]["attention forward"])
        per_layer = B * H * seq * D * 4 + B * H * seq * 4
        assert point["kept_bytes_predicted"] == per_layer
        assert point["kept_bytes_measured"] == {"reentrant": per_layer, "non-reentrant": per_layer}
        assert set(point["modes"]) == {"reentrant", "non-reentrant", "SAC"}
        for mode in ("reentrant", "non-reentrant"):
            m = point["modes"][mode]
            assert m["efficiency"] == pytest.approx(m["saved_ms_per_layer"] / point["attention_forward_ms"])
    assert report["points"][0]["seq"] == 32
    assert stash_is_uninstalled()


def test_seq_sweep_rounds_and_lengths():
    from attnstash.bench.seq_sweep import parse_seqs, rounds_for
    assert parse_seqs(None) == [1024, 4096, 16384, 32768]
    assert parse_seqs("4k, 1024,32k") == [1024, 4096, 32768]
    with pytest.raises(ValueError):
        parse_seqs("0")
    assert rounds_for(2.2, 32.0) == 14 and rounds_for(0.1, 20.0) == 30 and rounds_for(3.0, 1.0) == 5
    assert rounds_for(3.0, 1.0, fixed=2) == 2


def test_soak_runs_both_checkpointing_modes_and_ends_with_an_empty_stash(tmp_path):
    pytest.importorskip("psutil")
    report = bench_main([*TINY, "--mode", "soak", "--steps", "6", "--seed", "3", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["steps"] == 6 and set(written["runs"]) == {"reentrant", "non-reentrant"}
    for mode, run in written["runs"].items():
        assert run["checkpointing"] == mode and len(run["log"]) == 6
        assert run["stash"]["entries_at_end"] == 0 and run["stash"]["bytes_at_end"] == 0
        stash = report["runs"][mode]["stash"]
        assert stash["keeps"] == stash["replays"] + stash["released_unused"] and stash["misses"] == 0
        assert stash["declined"] == 0 and stash["keeps"] > 0
        assert set(run["rss"]) == {"first", "last", "max", "second_half_slope_bytes_per_step", "second_half_steps"}
    assert attnstash.stash_stats()["entries"] == 0
    assert stash_is_uninstalled()


def test_soak_under_non_reentrant_checkpointing_and_a_budget_ends_empty(tmp_path):
    pytest.importorskip("psutil")
    budget_before = attnstash.stash_max_bytes()
    budget = PER_LAYER_BF16 * 3 // 2  # one bf16 entry fits, two do not
    report = bench_main([*TINY, "--mode", "soak", "--steps", "5", "--seed", "5", "--checkpointing", "non-reentrant",
                         "--max-bytes", str(budget), "--amp", "bf16", "--out", ""])
    assert list(report["runs"]) == ["non-reentrant"] and report["max_bytes"] == budget
    stash = report["runs"]["non-reentrant"]["stash"]
    assert stash["entries_at_end"] == 0 and stash["bytes_at_end"] == 0 and stash["misses"] == 0
    assert stash["peak_bytes"] == PER_LAYER_BF16 and stash["declined"] > 0 and stash["keeps"] > 0
    # Every record, kept or declined, is recomputed or released with its graph (a declined
    # record's recompute runs attention: no replay).
    assert stash["replays"] <= stash["keeps"]
    assert stash["keeps"] <= stash["replays"] + stash["released_unused"] <= stash["keeps"] + stash["declined"]
    assert attnstash.stash_max_bytes() == budget_before  # the budget is restored
    assert attnstash.stash_stats()["entries"] == 0
    assert stash_is_uninstalled()


def test_model_mode_under_a_budget_keeps_within_it_with_equal_losses(tmp_path):
    budget_before = attnstash.stash_max_bytes()
    # One layer's entry fits 1.5 layers' budget, two do not; 0 bytes declines every keep.
    report = bench_main([*TINY, "--repeats", "1", "--warmup", "0", "--stash-points", "2",
                         "--max-bytes", f"{PER_LAYER * 3 // 2},0", "--out", str(tmp_path)])
    assert attnstash.stash_max_bytes() == budget_before  # each row restores the budget it found
    assert report["losses_equal"] and report["max_loss_diff"] == 0.0
    rows = {r["name"]: r for r in report["configs"]}
    half, none = rows[f"stash all, budget {PER_LAYER * 3 // 2}"], rows["stash all, budget 0"]
    for row, kept in ((half, 1), (none, 0)):
        check = row["check"]
        assert row["kind"] == "stash-budget" and row["stash_layers"] == 2 and check["grads_equal"]
        assert row["kept_bytes"] <= row["max_bytes"] and row["peak_over_budget"] == []
        assert row["kept_bytes"] == row["predicted_kept_bytes"] == kept * PER_LAYER
        assert check["keeps"] == check["replays"] == row["kept_layers"] == kept
        assert check["declined"] == 2 - kept and check["misses"] == 0
        assert check["held_after_step"] == {"entries": 0, "bytes": 0}
    assert "2" in report["efficiency"] and (tmp_path / "bench.png").stat().st_size > 0
    assert stash_is_uninstalled()


def test_the_cli_runs_as_a_package_with_amp(tmp_path):
    """python -m attnstash.bench in a subprocess: the package layout, --amp bf16 (every row under
    autocast: bitwise-equal losses and gradients, bf16 entries) and a budget row."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "attnstash.bench", *TINY, "--repeats", "1", "--warmup", "0",
                           "--stash-points", "2", "--amp", "bf16", "--max-bytes", str(PER_LAYER_BF16),
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "float32 weights under autocast bfloat16" in done.stdout
    assert "loss: bitwise equal across every step of every configuration" in done.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["shape"]["amp"] == "bfloat16" and report["shape"]["dtype"] == "float32"
    assert report["losses_equal"] and report["kept_bytes_per_layer"] == PER_LAYER_BF16
    for row in report["configs"]:
        assert row["check"]["grads_equal"], row["name"]
        if row["kind"] in ("stash", "stash-nr"):
            assert row["kept_bytes"] == row["predicted_kept_bytes"] == 2 * PER_LAYER_BF16
    budget_row = next(r for r in report["configs"] if r["kind"] == "stash-budget")
    assert budget_row["kept_bytes"] == PER_LAYER_BF16 <= budget_row["max_bytes"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_the_bench_package_is_split_into_a_library_half_and_experiments():
    package = ROOT / "attnstash" / "bench"
    assert not (ROOT / "attnstash" / "bench.py").exists()
    assert {p.name for p in package.glob("*.py")} >= {"__init__.py", "__main__.py", "models.py", "measure.py",
                                                       "model_mode.py", "layer_mode.py", "soak.py", "report.py"}
    experiments = {"model_mode", "layer_mode", "soak", "report", "__main__"}
    for library in ("models.py", "measure.py", "__init__.py"):  # the library half imports no experiment
        assert not imported_bench_modules(package / library) & experiments, library
    demo = imported_bench_modules(ROOT / "examples" / "demo.py")
    assert demo and demo <= {"models", "measure"}, demo


def imported_bench_modules(path):
    """The attnstash.bench modules a file imports (relative imports within the package included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.module == "attnstash.bench" or (node.level == 1 and node.module is None):
                found |= {a.name for a in node.names}
            elif node.module and node.module.startswith("attnstash.bench."):
                found.add(node.module.split(".")[2])
            elif node.level == 1:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("attnstash.bench.")}
    return found


def load_demo():
    spec = importlib.util.spec_from_file_location("attnstash_demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_trains_two_steps_with_equal_losses(tmp_path):
    demo = load_demo()
    report = demo.main(["--steps", "2", *DEMO_TINY, "--amp", "none", "--budget-steps", "0", "--out", str(tmp_path)])
    assert report["same_initial_weights"]
    assert report["losses_bitwise_equal"] == [True, True]
    assert report["losses"]["plain"] == report["losses"]["stash"]
    per_layer = 1 * H * S * D * 4 + 1 * H * S * 4  # the demo preset's micro-batch is 1
    assert report["kept_by_layer"] == {"0": per_layer, "1": per_layer}
    assert report["kept_bytes"] == 2 * per_layer == 2 * report["predicted_bytes_per_layer"]
    assert "amp" not in report and "budget" not in report
    assert json.loads((tmp_path / "demo.json").read_text())["steps"] == 2
    assert (tmp_path / "demo.png").stat().st_size > 0 and not (tmp_path / "demo_budget.png").exists()
    assert stash_is_uninstalled()


def test_demo_amp_and_budget_configurations(tmp_path):
    demo = load_demo()
    budget_before = attnstash.stash_max_bytes()
    report = demo.main(["--steps", "1", *DEMO_TINY, "--amp-steps", "2", "--amp-seq", "32", "--budget-steps", "6",
                        "--min-seq", "16", "--out", str(tmp_path)])
    assert attnstash.stash_max_bytes() == budget_before
    assert demo.all_equal(report)
    # amp: float32 weights under autocast bfloat16, the stash keeping bf16 outputs.
    amp = report["amp"]
    assert amp["autocast"] == "bfloat16" and amp["shape"]["dtype"] == "float32" and amp["shape"]["seq"] == 32
    assert amp["losses_bitwise_equal"] == [True, True] and amp["losses"]["plain"] == amp["losses"]["stash"]
    per_layer_bf16 = 1 * H * 32 * D * 2 + 1 * H * 32 * 4
    assert amp["kept_bytes"] == 2 * per_layer_bf16 == 2 * amp["predicted_bytes_per_layer"]
    # budget: half the layers of the longest batch; lengths between 16 and 64 tokens.
    budget = report["budget"]
    longest = 1 * H * S * D * 4 + 1 * H * S * 4
    assert budget["max_bytes"] == longest and budget["min_seq"] == 16
    assert budget["losses_bitwise_equal"] == [True] * 6 and budget["losses"]["plain"] == budget["losses"]["stash"]
    for step in budget["per_step"]:
        assert 16 <= step["seq"] <= 64
        assert step["peak_bytes"] <= budget["max_bytes"]
        assert step["held_after_forward"] == step["predicted_held"] <= budget["max_bytes"]
        assert step["keeps"] + step["declined"] == 2 and step["replays"] == step["keeps"]
    assert budget["peak_bytes"] <= budget["max_bytes"]
    assert budget["declined"] > 0 and budget["keeps"] > 0  # some batches fit every layer, some do not
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["budget"]["per_step"] == budget["per_step"] and written["amp"]["steps"] == 2
    assert (tmp_path / "demo_budget.png").stat().st_size > 0
    assert stash_is_uninstalled()


def test_the_demo_tokenizer_round_trips_bytes():
    tok = load_demo().ByteTokenizer()
    text = "Low water, ferry — 7 passengers"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < tok.vocab_size


def test_model_mode_runs_padded_batches_with_equal_losses(tmp_path):
    report = bench_main(["--preset", "tiny", "--layers", "2", "--repeats", "1", "--warmup", "0", "--pad", "0.25",
                         "--stash-points", "2", "--out", str(tmp_path)])
    assert report["pad"] == 0.25
    assert report["losses_equal"]
    for config in report["configs"]:
        assert config["check"]["grads_equal"], config["name"]
        if config["kind"] in ("stash", "stash-nr"):
            assert config["check"]["replays"] == 2
    assert stash_is_uninstalled()
