"""attnstash.bench and examples/demo.py at tiny sizes on CPU: they run, write what they
promise, report equal losses, and the stash keeps exactly the predicted bytes. Timings are
recorded but never asserted on (they are noise at these sizes)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import attnstash
from attnstash import bench, huggingface

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, hidden 32, 4 query / 2 KV heads of 8, micro-batch 2 x 64 tokens, fp32 on CPU.
TINY = ["--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--seq", "64", "--batch", "2"]
B, H, S, D = 2, 4, 64, 8


def stash_is_uninstalled():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return huggingface._patched is None and ALL_ATTENTION_FUNCTIONS["sdpa"] is not huggingface._stashed_sdpa


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    report = bench.main([*TINY, "--repeats", "1", "--warmup", "0", "--out", str(out)])
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
    per_layer = B * H * S * D * 4 + B * H * S * 4  # fp32 output + fp32 log-sum-exp [B, H, S]
    assert report["kept_bytes_per_layer"] == per_layer
    for config in report["configs"]:
        check = config["check"]
        assert check["held_after_step"] == {"entries": 0, "bytes": 0}
        if config["kind"] not in ("stash", "stash-nr"):
            assert config["kept_bytes"] == 0 and check["keeps"] == 0 and check["replays"] == 0
            continue
        k = config["stash_layers"]
        assert config["kept_bytes"] == config["predicted_kept_bytes"] == k * per_layer
        assert check["keeps"] == check["replays"] == k and check["misses"] == 0
        # Between forward and backward the last k layers each hold one output.
        assert check["held_after_forward"]["by_layer"] == {str(i): [1, per_layer] for i in range(2 - k, 2)}


def test_stash_points():
    assert bench.stash_points(None, 4) == [1, 2, 4]
    assert bench.stash_points(None, 48) == [1, 12, 24, 48]
    assert bench.stash_points("1, all", 6) == [1, 6]
    with pytest.raises(ValueError, match="between 1 and the 4 layers"):
        bench.stash_points("0,2", 4)


def test_predictions_for_the_cuda_backends():
    shape = bench.make_shape("qwen3-30b-a3b")
    total, formula = bench.kept_bytes_per_layer(shape, "CUDNN_ATTENTION")
    assert total == 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16 == 136_314_896
    assert "philox" in formula
    # CUDA flash and memory-efficient attention: output + float32 log-sum-exp + the two extras.
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        total, formula = bench.kept_bytes_per_layer(shape, backend)
        assert 0 <= total - (4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4) <= 64 and "meta" in formula
    assert bench.kept_bytes_per_layer(shape, "MATH")[0] is None


def test_layer_mode_runs(tmp_path):
    report = bench.main([*TINY, "--mode", "layer", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "layer.json").read_text())
    assert written["sdpa_backend"] == "FLASH_ATTENTION"
    assert set(written["runs"]) == {"reentrant, no stash", "reentrant + stash", "attention forward"}
    assert report["grads_equal"] and report["replays_in_check_step"] >= 1
    assert stash_is_uninstalled()


def test_soak_runs_a_handful_of_steps_and_ends_with_an_empty_stash(tmp_path):
    pytest.importorskip("psutil")
    report = bench.main([*TINY, "--mode", "soak", "--steps", "6", "--seed", "3", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "soak.json").read_text())
    assert written["steps"] == 6 and len(written["log"]) == 6
    assert written["stash"]["entries_at_end"] == 0 and written["stash"]["bytes_at_end"] == 0
    stash = report["stash"]
    assert stash["keeps"] == stash["replays"] + stash["released_unused"] and stash["misses"] == 0
    assert set(written["rss"]) == {"first", "last", "max", "second_half_slope_bytes_per_step"}
    assert attnstash.stash_stats()["entries"] == 0
    assert stash_is_uninstalled()


def load_demo():
    spec = importlib.util.spec_from_file_location("attnstash_demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_trains_two_steps_with_equal_losses(tmp_path):
    demo = load_demo()
    report = demo.main(["--steps", "2", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "8", "--seq", "64", "--no-progress", "--out", str(tmp_path)])
    assert report["same_initial_weights"]
    assert report["losses_bitwise_equal"] == [True, True]
    assert report["losses"]["plain"] == report["losses"]["stash"]
    per_layer = 1 * H * S * D * 4 + 1 * H * S * 4  # the demo preset's micro-batch is 1
    assert report["kept_by_layer"] == {"0": per_layer, "1": per_layer}
    assert report["kept_bytes"] == 2 * per_layer == 2 * report["predicted_bytes_per_layer"]
    assert json.loads((tmp_path / "demo.json").read_text())["steps"] == 2
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert stash_is_uninstalled()


def test_the_demo_tokenizer_round_trips_bytes():
    tok = load_demo().ByteTokenizer()
    text = "Low water, ferry — 7 passengers"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < tok.vocab_size


def test_model_mode_runs_padded_batches_with_equal_losses(tmp_path):
    report = bench.main(["--preset", "tiny", "--layers", "2", "--repeats", "1", "--warmup", "0", "--pad", "0.25",
                         "--stash-points", "2", "--out", str(tmp_path)])
    assert report["pad"] == 0.25
    assert report["losses_equal"]
    for config in report["configs"]:
        assert config["check"]["grads_equal"], config["name"]
        if config["kind"] in ("stash", "stash-nr"):
            assert config["check"]["replays"] == 2
    assert stash_is_uninstalled()
