"""attnstash.bench and examples/demo.py at tiny sizes on CPU: they run, write what they
promise, report equal losses, and the stash keeps exactly the predicted bytes (and never
more than a budget). Timings are recorded but never asserted on (they are noise at these
sizes)."""
import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnstash
from attnstash import huggingface
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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return huggingface._patched is None and ALL_ATTENTION_FUNCTIONS["sdpa"] is not huggingface._stashed_sdpa


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
    # CUDA flash and memory-efficient attention: output + float32 log-sum-exp + the two extras.
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        total, formula = models.kept_bytes_per_layer(shape, backend)
        assert 0 <= total - (4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4) <= 64 and "meta" in formula
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


def test_layer_mode_runs(tmp_path):
    report = bench_main([*TINY, "--mode", "layer", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "layer.json").read_text())
    assert written["sdpa_backend"] == "FLASH_ATTENTION"
    assert set(written["runs"]) == {"reentrant, no stash", "reentrant + stash", "attention forward"}
    assert report["grads_equal"] and report["replays_in_check_step"] >= 1
    assert stash_is_uninstalled()


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
