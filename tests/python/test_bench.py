"""benchmarks/ at tiny sizes on CPU (examples/demo.py: test_demo.py): every mode runs and
writes what it promises, losses and gradients are bitwise equal to plain checkpointing of the
same mode, the stash keeps exactly the bytes predicted (and never more than a budget), and the
profile's GPU analysis reads a CUDA-shaped event tree right. Timings are recorded, never
asserted."""
import ast
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attnstash
import compile_cases  # noqa: F401 (puts the repository root, which holds benchmarks/, on sys.path)
from benchmarks import models
from benchmarks.__main__ import main as bench_main
from helpers import nothing_installed

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, hidden 32, 4 query / 2 KV heads of 8, micro-batch 2 x 64 tokens, fp32 on CPU.
TINY = ["--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--seq", "64", "--batch", "2"]
ONCE = ["--repeats", "1", "--warmup", "0"]
B, H, S, D = 2, 4, 64, 8


def kept(batch, heads, seq, head_dim, out_bytes=4):
    """What the stash keeps for one CPU flash call: the output, and the fp32 log-sum-exp [B, H, S]."""
    return batch * heads * seq * head_dim * out_bytes + batch * heads * seq * 4


PER_LAYER, PER_LAYER_BF16 = kept(B, H, S, D), kept(B, H, S, D, 2)
LAYER_CONFIGS = ["reentrant", "reentrant + stash 1", "non-reentrant", "non-reentrant + stash 1", "SAC (non-reentrant)"]


def assert_stash_rows_exact(rows, per_layer):
    """Every configuration: kept bytes = the planner's prediction = what was computed here; the
    stash and SAC bitwise equal to plain checkpointing of their mode; nothing held after the step."""
    for r in rows:
        assert r["held_after_step"] == {"records": 0, "bytes": 0} and r["misses"] == 0, r["name"]
        assert r["loss_equal"], r["name"]
        if r["stash_layers"] is not None or r["checkpointing"] == "sac":
            plain = "non-reentrant" if r["checkpointing"] == "sac" else r["checkpointing"]
            assert r["compared_with"].endswith(plain) and r["grads_equal"], r["name"]
        k = r["replays"]
        assert r["kept_bytes"] == r["predicted_kept_bytes"] == k * per_layer, r["name"]
        assert r["keeps"] == k and k + r["declined"] == (r["stash_layers"] or 0), r["name"]


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    budget_before = attnstash.stash_max_bytes()
    report = bench_main([*TINY, *ONCE, "--max-bytes", f"{PER_LAYER * 3 // 2},0", "--out", str(out)])
    assert torch.get_num_threads() == threads and attnstash.stash_max_bytes() == budget_before
    return report, out


def test_model_mode_writes_its_files(model_run):
    report, out = model_run
    written = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0
    assert written["shape"]["layers"] == 2 and written["shape"]["dtype"] == "fp32" and written["shape"]["amp"] is None
    assert [r["name"] for r in written["configs"]] == [
        "no checkpointing", "reentrant", "reentrant, stash on 0 layers", "reentrant + stash 1", "reentrant + stash 2",
        f"reentrant + stash 2, budget {PER_LAYER * 3 // 2}", "reentrant + stash 2, budget 0", "SAC (non-reentrant)",
        "non-reentrant", "non-reentrant + stash 2"]
    for r in written["configs"]:
        assert len(r["times_ms"]) == 1 and r["median_ms"] == r["times_ms"][0] and r["peak_bytes"] > 0
    assert set(written["efficiency"]) == {"1", "2"} and isinstance(written["installed_overhead"], float)
    assert written["sdpa_backend"] == "FLASH_ATTENTION" and written["kept_bytes_per_layer"] == PER_LAYER
    assert nothing_installed()


def test_model_mode_is_bitwise_and_keeps_what_is_predicted(model_run):
    report, _ = model_run
    assert report["losses_equal"] and report["grad_noise_floor"]["grads_equal"]
    assert len({r["loss"] for r in report["configs"]}) == 1
    assert all(r["grads_equal"] for r in report["configs"])  # a transformers decoder: plain modes agree too
    assert_stash_rows_exact(report["configs"], PER_LAYER)
    rows = {r["name"]: r for r in report["configs"]}
    # Between forward and backward the last k layers hold one output each: [records, bytes, declined].
    assert rows["reentrant + stash 1"]["held_after_forward"] == {"1": [1, PER_LAYER, 0]}
    assert rows["reentrant, stash on 0 layers"]["held_after_forward"] == {} and rows["no checkpointing"]["keeps"] == 0
    # A budget of 1.5 layers keeps the last layer and declines the first; 0 declines both.
    half = rows[f"reentrant + stash 2, budget {PER_LAYER * 3 // 2}"]
    assert half["replays"] == 1 and half["declined"] == 1 and half["kept_bytes"] <= half["max_bytes"]
    assert half["held_after_forward"] == {"0": [1, 0, 1], "1": [1, PER_LAYER, 0]}
    none = rows["reentrant + stash 2, budget 0"]
    assert none["declined"] == 2 and none["kept_bytes"] == 0


def test_shapes_and_dtype_spellings():
    shape = models.make_shape("demo", amp="bfloat16", device="cuda")
    assert shape.dtype == "fp32" and shape.amp == "bf16" and shape.compute_dtype == torch.bfloat16
    assert models.make_shape("demo", device="cuda").dtype == "bf16"
    assert models.make_shape("demo", dtype="half").dtype == "fp16"
    with pytest.raises(ValueError, match="fp32 weights"):
        models.make_shape("demo", amp="fp16", dtype="bf16")
    with pytest.raises(ValueError):
        models.dtype_name("int8")
    from attnstash.backends import KEPT_BACKENDS
    assert models.sac_ops("cpu") == [r.forward_op for r in KEPT_BACKENDS if r.device == "cpu"]
    assert len(models.sac_ops("cuda")) == 3


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    return bench_main([*TINY, "--mode", "layer", *ONCE, "--out", str(out)]), out


def test_layer_mode(layer_run):
    report, out = layer_run
    written = json.loads((out / "layer.json").read_text())
    assert [r["name"] for r in written["configs"]] == LAYER_CONFIGS
    assert list(written["modes"]) == ["reentrant + stash 1", "non-reentrant + stash 1", "SAC (non-reentrant)"]
    assert written["kept_bytes_per_layer"] == PER_LAYER and written["grads_equal"] and written["losses_equal"]
    assert_stash_rows_exact(written["configs"], PER_LAYER)
    rows = {r["name"]: r for r in written["configs"]}
    assert rows["SAC (non-reentrant)"]["compared_with"] == "non-reentrant"
    assert written["saved_ms_per_layer"] == written["modes"]["reentrant + stash 1"]["saved_ms_per_layer"]
    assert all(len(r["times_ms"]) == 1 for r in written["configs"])
    assert nothing_installed()


def test_layer_mode_runs_one_checkpointing_mode():
    report = bench_main([*TINY, "--mode", "layer", "--checkpointing", "non-reentrant", *ONCE, "--out", ""])
    assert [r["name"] for r in report["configs"]] == ["non-reentrant", "non-reentrant + stash 1", "SAC (non-reentrant)"]
    assert report["saved_ms_per_layer"] == report["modes"]["non-reentrant + stash 1"]["saved_ms_per_layer"]
    assert_stash_rows_exact(report["configs"], PER_LAYER)


def test_profile_mode_on_cpu(tmp_path):
    report = bench_main([*TINY, "--mode", "profile", "--repeats", "2", "--warmup", "1", "--traces", "--out",
                         str(tmp_path)])
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["activities"] == ["CPU"] and list(written["configs"]) == LAYER_CONFIGS
    attention = "aten::_scaled_dot_product_flash_attention_for_cpu"
    for name, c in written["configs"].items():
        plain_or_stash = name != "SAC (non-reentrant)"  # (SAC's recompute calls the op too: SAC answers it)
        assert c["ranges_found"] == {"bench:step": 2, "bench:forward": 2, "bench:backward": 2, "bench:recompute": 2}
        assert c["gpu"]["step"] == {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0}  # CPU: no kernels
        stashed = name.endswith("stash 1")
        assert c["stash"] == {"steps": 3, "keeps": 3 * stashed, "replays": 3 * stashed, "declined": 0, "misses": 0}
        # The attention forward runs in the forward and again in the recompute; with the stash, only in the forward
        # (inside attnstash::sdpa_fwd_keep, called in both).
        assert not plain_or_stash or c["ops"][attention]["calls"] == (1 if stashed else 2), name
        assert ("attnstash::sdpa_fwd_keep" in c["attnstash_ops"]) == stashed
        if stashed:
            assert c["attnstash_ops"]["attnstash::sdpa_fwd_keep"]["calls"] == 2 and c["host_ms"]["attnstash"] > 0
    assert set(written["comparisons"]) == {
        "reentrant + stash 1 vs reentrant", "non-reentrant + stash 1 vs non-reentrant",
        "SAC (non-reentrant) vs non-reentrant", "reentrant + stash 1 vs SAC (non-reentrant)",
        "non-reentrant + stash 1 vs SAC (non-reentrant)"}
    rows = {r["name"]: r for r in written["comparisons"]["reentrant + stash 1 vs reentrant"]["ops"]}
    assert (rows[attention]["base_calls"], rows[attention]["other_calls"]) == (2, 1)
    markdown = (tmp_path / "profile.md").read_text()
    assert "## reentrant + stash 1 vs reentrant" in markdown and "Self CPU" in markdown  # torch's own table
    traces = sorted(tmp_path.glob("profile_trace_*.json.gz"))
    assert len(traces) == 5 and "traceEvents" in json.loads(gzip.open(traces[0]).read())
    assert nothing_installed()


def _event(name, start, end, parent=None, device=False, kernels=(), ident=0, link=0, cpu=0.0, gpu=0.0, user=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           device_type=torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU,
                           kernels=list(kernels), id=ident, linked_correlation_id=link, self_cpu_time_total=cpu,
                           self_device_time_total=gpu, is_user_annotation=user)


def test_profile_analysis_of_a_cuda_event_tree():
    """The GPU half of --mode profile, which this CPU cannot run: kernels classed by the op that launched
    them, GPU idle of the kernels launched in the step and in the recompute (by their launch's time)."""
    from benchmarks import profile
    step = _event("bench:step", 0, 1000, user=True)
    recompute = _event("bench:recompute", 300, 500, step, user=True)
    mm, sdpa = _event("aten::mm", 20, 40, step), _event("aten::_scaled_dot_product_cudnn_attention", 60, 80, step)
    keep = _event("attnstash::sdpa_fwd_keep", 320, 360, recompute, cpu=40)
    launches = [_event("cudaLaunchKernel", 25, 30, mm, kernels=["gemm"], ident=1, gpu=100),
                _event("cudaLaunchKernel", 65, 70, sdpa, kernels=["fprop"], ident=2, gpu=100),
                _event("cudaLaunchKernel", 330, 335, keep, kernels=["copy"], ident=3, gpu=20)]
    kernels = [_event("gemm", 50, 150, device=True, link=1), _event("fprop", 150, 250, device=True, link=2),
               _event("copy", 510, 530, device=True, link=3),
               _event("bench:step", 45, 600, device=True, user=True)]  # the range's GPU-side annotation
    assert profile.kind(launches[1]) == "attention forward" and profile.kind(launches[2]) == "attnstash"
    assert profile.kind(mm) == "other"
    prof = SimpleNamespace(events=lambda: [step, recompute, mm, sdpa, keep, *launches, *kernels],
                           key_averages=lambda: _Averages())
    figures = profile.analyse(prof, 1)
    assert figures["device_ms"] == pytest.approx({"attention forward": 0.1, "attention backward": 0.0,
                                                  "attnstash": 0.02, "other": 0.1})
    # step: kernels 50-150, 150-250, 510-530: span 480, busy 220; recompute: the copy alone
    assert figures["gpu"]["step"] == pytest.approx({"span_ms": 0.48, "busy_ms": 0.22, "idle_ms": 0.26})
    assert figures["gpu"]["recompute"] == pytest.approx({"span_ms": 0.02, "busy_ms": 0.02, "idle_ms": 0.0})
    assert profile.span_and_busy([(0, 10), (5, 15), (20, 30)]) == (30, 25)
    assert figures["step_ms"] == 1.0 and figures["recompute_host_ms"] == pytest.approx(0.2)
    assert figures["ranges_found"] == {"bench:step": 1, "bench:forward": 0, "bench:backward": 0, "bench:recompute": 1}


class _Averages(list):
    def table(self, **kwargs):
        return "torch's table"


def test_seq_sweep(tmp_path, monkeypatch):
    from benchmarks import decoder
    real = decoder.measure

    def failing_at_48(runs, reference, planned, *args, **kwargs):
        if planned.layers[0].calls[0].query[2] == 48:
            raise RuntimeError("CUDA out of memory (pretend)")
        return real(runs, reference, planned, *args, **kwargs)

    monkeypatch.setattr(decoder, "measure", failing_at_48)
    bench_main([*TINY, "--mode", "seq-sweep", "--seqs", "64,32,48", "--sweep-seconds", "0.5", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "seq_sweep.json").read_text())
    assert (tmp_path / "seq_sweep.png").stat().st_size > 0
    assert written["seqs"] == [32, 48, 64] and written["batch"] == B
    assert written["points"][1]["seq"] == 48 and "out of memory" in written["points"][1]["error"]
    for point in (written["points"][0], written["points"][2]):
        per_layer = kept(B, H, point["seq"], D)
        assert point["rounds"]["repeats"] >= 5 and point["losses_equal"]
        assert point["kept_bytes_per_layer"] == per_layer
        assert point["kept_bytes_measured"] == {"reentrant": per_layer, "non-reentrant": per_layer}
        assert_stash_rows_exact(point["configs"], per_layer)
    assert nothing_installed()


def test_seq_sweep_under_the_users_offloading(tmp_path, monkeypatch):
    # --offload on a CPU: every step under save_on_cpu, whose hooks pack what each step saves,
    # the stash's records included; the stash rows still keep and match plain checkpointing
    # bitwise; the rows with the stash's own offload (which takes the place of the hooks for what
    # the stash keeps) move nothing on a CPU.
    from benchmarks import harness
    packed = []
    real = torch.autograd.graph.save_on_cpu

    def counting_save_on_cpu(**kwargs):
        context = real(**kwargs)
        pack = context.pack_hook
        context.pack_hook = lambda t: (packed.append(1), pack(t))[1]
        return context

    monkeypatch.setattr(harness.torch.autograd.graph, "save_on_cpu", counting_save_on_cpu)
    bench_main([*TINY, "--mode", "seq-sweep", "--offload", "--seqs", "32", "--sweep-seconds", "0.5",
                "--out", str(tmp_path)])
    written = json.loads((tmp_path / "seq_sweep.json").read_text())
    point = written["points"][0]
    assert written["offload"] == "save_on_cpu" and packed
    assert point["losses_equal"] and all(row["grads_equal"] for row in point["configs"])
    stash_rows = {row["name"]: row for row in point["configs"] if row["stash_layers"]}
    assert sorted(stash_rows) == ["non-reentrant + stash 1", "non-reentrant + stash 1, offload", "reentrant + stash 1",
                                  "reentrant + stash 1, offload"]
    for name, row in stash_rows.items():
        assert (row["moved_bytes_after_forward"] == 0) == name.endswith(", offload"), (name, row)
        assert row["offload_waits"] == 0
    assert point["kept_bytes_measured"] == {"reentrant": kept(B, H, 32, D), "non-reentrant": kept(B, H, 32, D)}
    assert nothing_installed()


def test_soak_runs_both_checkpointing_modes_and_ends_with_an_empty_stash(tmp_path):
    report = bench_main([*TINY, "--mode", "soak", "--steps", "6", "--seed", "3", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["steps"] == 6 and set(written["runs"]) == {"reentrant", "non-reentrant"}
    for mode, run in report["runs"].items():
        stash = run["stash"]
        assert len(run["log"]) == 6 and stash["records_at_end"] == 0 and stash["bytes_at_end"] == 0
        assert stash["keeps"] == stash["replays"] + stash["released_unused"] and stash["misses"] == 0
        assert stash["keeps"] > 0 and stash["declined"] == 0
    assert nothing_installed()


def test_soak_under_non_reentrant_checkpointing_and_a_budget_ends_empty():
    budget_before = attnstash.stash_max_bytes()
    budget = PER_LAYER_BF16 * 3 // 2  # one bf16 entry fits, two do not
    report = bench_main([*TINY, "--mode", "soak", "--steps", "5", "--seed", "5", "--checkpointing", "non-reentrant",
                         "--max-bytes", str(budget), "--amp", "bf16", "--out", ""])
    stash = report["runs"]["non-reentrant"]["stash"]
    assert list(report["runs"]) == ["non-reentrant"] and report["max_bytes"] == budget
    assert stash["records_at_end"] == 0 and stash["misses"] == 0 and stash["peak_bytes"] == PER_LAYER_BF16
    assert stash["declined"] > 0 and stash["replays"] <= stash["keeps"]
    assert stash["keeps"] <= stash["replays"] + stash["released_unused"] <= stash["keeps"] + stash["declined"]
    assert attnstash.stash_max_bytes() == budget_before


DIT = ["--mode", "dit", "--heads", "2", "--head-dim", "16", "--layers", "1", "--single-layers", "1", "--tokens", "48",
       "--text-tokens", "16", *ONCE]


def test_dit_mode(tmp_path):
    report = bench_main([*DIT, "--out", str(tmp_path)])
    written = json.loads((tmp_path / "dit.json").read_text())
    assert written["blocks"] == 2 and len(written["points"]) == 1
    point = written["points"][0]
    names = [r["name"] for r in point["configs"]]
    assert names == ["no checkpointing", "non-reentrant", "non-reentrant + stash 2", "SAC (non-reentrant)",
                     "reentrant", "reentrant + stash 2"]
    per_block = kept(1, 2, 48 + 16, 16)  # one joint attention over image + text tokens
    assert point["kept_bytes_per_layer"] == per_block and point["losses_equal"]
    assert_stash_rows_exact(point["configs"], per_block)
    assert all(r["replays"] == 2 for r in point["configs"] if r["stash_layers"])
    assert report["points"][0]["sdpa_backend"] == "FLASH_ATTENTION" and nothing_installed()


def test_host_mode_measures_each_path(tmp_path):
    report = bench_main(["--mode", "host", "--layers", "2", "--seq", "16", *ONCE, "--out", str(tmp_path)])
    assert set(report["installed_overhead"]) == {"transformers, reentrant", "diffusers, reentrant",
                                               "transformers, non-reentrant", "diffusers, non-reentrant"}
    assert set(report["per_stashed_layer"]) == {"reentrant", "non-reentrant"}
    assert all(report["losses_equal"].values())
    for name, c in report["checks"].items():
        assert c["held_after_step"] == {"records": 0, "bytes": 0} and c["loss_equal"], name
        assert c["grads_equal"] or c["compared_with"] != name.split(",")[0].split(" +")[0], name
        assert c["replays"] == (2 if name.endswith("stash 2") else 0), name
    assert report["sdpa_call"]["without_attnstash_us"] > 0 and report["sdpa_call"]["with_attnstash_us"] > 0
    assert (tmp_path / "host.json").exists()
    assert nothing_installed()


def test_instructions_mode_compares_designs_that_give_the_plain_step_bitwise(monkeypatch):
    # Its callgrind counts take minutes a process, so only what decides whether they may be
    # compared runs here: each configuration's step bitwise the plain one's, nothing left installed,
    # and the interleaved timing of every configuration; a prototype that replays a wrong output
    # is refused.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks import instructions, seed_design
    for mode in ("reentrant", "non-reentrant"):
        instructions.check(mode)
        assert set(instructions.timed(mode, 1)) == {c for c in instructions.CONFIGS
                                                    if mode == "reentrant" or not c.startswith("seed")}
    assert nothing_installed() and attnstash.stash_stats()["records"] == 0
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    replay = seed_design._Replay.forward
    monkeypatch.setattr(seed_design._Replay, "forward", staticmethod(
        lambda ctx, q, k, v, out, lse, causal, scale: replay(ctx, q, k, v, out * 1.001, lse, causal, scale)))
    with pytest.raises(SystemExit, match="seed-all .reentrant. does not give the plain run's loss"):
        instructions.check("reentrant")
    assert nothing_installed() and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_opcodes_mode_counts_each_design_s_python_exactly(tmp_path):
    """Opcodes mode's counts are exact (the same step counted twice gives the same counts) and
    name what each design runs: attnstash's frames in every stashed layer's forward and recompute,
    the seed's design in place of transformers' attention entry, which it skips."""
    from benchmarks import opcodes
    assert opcodes.count("attnstash-all", "reentrant") == opcodes.count("attnstash-all", "reentrant")
    report = bench_main(["--mode", "opcodes", "--out", str(tmp_path)])
    assert set(report["per_stashed_layer"]["reentrant"]) == {"attnstash", "modulecall", "seed"}
    assert set(report["per_stashed_layer"]["non-reentrant"]) == {"attnstash", "modulecall"}
    for mode in ("reentrant", "non-reentrant"):
        for design in ("attnstash", "modulecall"):
            # two frames a stashed layer and step: its first forward's and its recompute's
            assert report["by_function"][mode][design]["attnstash/install/core.py:run_frame"] > 0, (mode, design)
    seed = report["by_function"]["reentrant"]["seed"]
    assert seed["transformers/integrations/sdpa_attention.py:sdpa_attention_forward"] < 0
    assert (tmp_path / "opcodes.json").exists()
    assert nothing_installed() and attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("config", ["entry", "bare"])
def test_instructions_mode_s_entry_count_runs_transformers_entry_around_its_stand_in(config):
    """run_entry (in a process of its own, as callgrind runs it: it replaces F.sdpa there) checks
    that the entry it counts called its stand-in for F.sdpa once a pass."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "benchmarks.instructions", "--run", config, "entry", "2", "1"],
                          cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("config", ["held-0", "held-3"])
def test_instructions_mode_s_held_count_keeps_and_replays_once_a_step_with_others_held(config):
    """run_held (a process of its own, as callgrind runs it) checks that its step kept and replayed
    once and left the other records held; their tokens go with run_held, and their records with them."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, attnstash; from benchmarks.instructions import run_held; "
            f"run_held({config!r}, 2, 1); print(attnstash.stash_stats()['records'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0"]


def test_the_module_call_path_is_reached_as_a_module_call():
    """Host mode's two paths are what they claim: the decoder's layers through transformers' checkpoint
    function, the same layers in a plain Block as a module call."""
    from benchmarks.dit import Block, PlainDecoder
    from attnstash.install import core, found
    hf = models.build_model(models.make_shape("tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8))
    plain = PlainDecoder(hf)
    for model, kwargs, reach in ((hf, {}, found.CHECKPOINT_FUNCTION), (plain, {"layers": Block}, found.MODULE_CALL)):
        attnstash.install_attention_stash(model, **kwargs)
        try:
            stashed = [core.stash_of(m) for m in model.modules() if core.stash_of(m) is not None]
            assert len(stashed) == 2 and {s.reach for s in stashed} == {reach}
        finally:
            attnstash.uninstall_attention_stash(model)


def test_the_cli_runs_as_a_package_with_amp_and_padding(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "benchmarks", *TINY, *ONCE, "--stash-points", "all",
                           "--amp", "bf16", "--pad", "0.25", "--max-bytes", str(PER_LAYER_BF16),
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fp32 weights under autocast bf16" in done.stdout and "losses bitwise equal" in done.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["shape"]["amp"] == "bf16" and report["pad"] == 0.25 and report["losses_equal"]
    for r in report["configs"]:
        assert r["grads_equal"], r["name"]
        if r["stash_layers"] and not r["budget"]:
            assert r["replays"] == 2
    # Padded rows: the planner predicts the masked call's bytes, and the stash keeps them.
    assert all(r["kept_bytes"] == r["predicted_kept_bytes"] for r in report["configs"])


def test_the_package_layout():
    package = ROOT / "benchmarks"
    for path in [*package.glob("*.py"), ROOT / "examples" / "demo.py"]:
        assert len(path.read_text().splitlines()) <= 450, path
    experiments = {"decoder", "profile", "soak", "dit", "report", "__main__"}
    for library in ("models.py", "harness.py", "__init__.py"):  # the library half imports no experiment
        assert not imported_bench_modules(package / library) & experiments, library
    assert imported_bench_modules(ROOT / "examples" / "demo.py") == {"models", "harness", "dit"}


def imported_bench_modules(path):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.module == "benchmarks" or (node.level == 1 and node.module is None):
                found |= {a.name for a in node.names}
            elif node.module and node.module.startswith("benchmarks."):
                found.add(node.module.split(".")[1])
            elif node.level == 1:
                found.add(node.module.split(".")[0])
    return found
