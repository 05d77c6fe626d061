"""The fine-tuning tools' own command lines, on the tiny local assets (tiny_assets.py), without
and with ATTNSTASH_LAYERS=all in their environment: `trl sft` (reentrant, non-reentrant, PEFT
LoRA) and `accelerate launch` with two CPU processes over gloo. Each pair of runs logs the same
losses, saves bitwise the same weights, and the run with the stash logs its figures (keeps and
replays every step, on every rank) and ends with the stash's summary line. LLaMA-Factory and
axolotl, which pin other transformers releases, run in tests/tools/run.sh (make test-tools)."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import tiny_assets

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
PTH = Path(sysconfig.get_paths()["purelib"]) / "attnstash-autostash.pth"
pytestmark = pytest.mark.skipif(not (BIN / "trl").exists(), reason="trl is not installed here")


def require_start_up_line():
    """A missing start-up line fails the test (never skips it): after `make build` it must be there."""
    if not PTH.exists():
        pytest.fail(f"{PTH.name} is missing from site-packages ({PTH.parent}): `make build` puts it there "
                    "(copied for an editable install; pip installs it with a regular one)", pytrace=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets.write(tmp_path_factory.mktemp("assets"))


def tool(args, cwd, stash):
    require_start_up_line()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTASH_")}
    environ.update(OFFLINE, PYTHONPATH=str(ROOT / "tests" / "python"), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if stash:
        environ["ATTNSTASH_LAYERS"] = "all"
    done = subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def logged(output):
    """The training logs the trainer printed (its dicts with a loss)."""
    import ast
    return [ast.literal_eval(line) for line in output.splitlines()
            if line.startswith("{") and "'loss'" in line and "train_runtime" not in line]


def weights(folder):
    from safetensors.torch import load_file
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


TRL = {"non-reentrant": [], "reentrant": ["--gradient_checkpointing_kwargs", '{"use_reentrant": true}'],
       "peft": ["--use_peft", "--lora_r", "4", "--lora_alpha", "8"],
       "peft-reentrant": ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--gradient_checkpointing_kwargs",
                          '{"use_reentrant": true}']}


@pytest.mark.parametrize("setup", list(TRL))
def test_trl_sft(setup, assets, tmp_path):
    runs = {}
    for stash in (False, True):
        out = tmp_path / ("with" if stash else "without")
        output = tool([str(BIN / "trl"), "sft", "--model_name_or_path", str(assets["model"]), "--dataset_name",
                       str(assets["chat"].parent), "--output_dir", str(out), "--use_cpu", "--bf16", "false",
                       "--report_to", "none", "--logging_steps", "1", "--max_steps", "3",
                       "--per_device_train_batch_size", "2", "--save_strategy", "no", "--disable_tqdm", "true",
                       "--seed", "0", *TRL[setup]], tmp_path, stash)
        runs[stash] = (logged(output), weights(out), output)
    (logs_without, weights_without, _), (logs_with, weights_with, output) = runs[False], runs[True]
    assert [log["loss"] for log in logs_with] == [log["loss"] for log in logs_without] and len(logs_with) == 3
    assert weights_with.keys() == weights_without.keys()
    assert all(weights_with[k].equal(weights_without[k]) for k in weights_with)
    assert all(log["attnstash/keeps"] == log["attnstash/replays"] == 2 for log in logs_with)
    assert not any("attnstash/keeps" in log for log in logs_without)
    assert "attnstash: 2 layers stashed; 6 keeps, 6 replays, 0 declined; peak " in output


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_accelerate_launch_two_cpu_processes_every_rank_stashes(mode, assets, tmp_path):
    results = {}
    for stash in (False, True):
        output = tool([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port",
                       "0", str(ROOT / "tests" / "tools" / "train_script.py"), str(assets["model"].parent),
                       str(tmp_path / str(stash)), mode], tmp_path, stash)
        results[stash] = sorted((json.loads(f.read_text()) for f in (tmp_path / str(stash)).glob("result-*.json")),
                                key=lambda r: r["rank"])
        if stash:
            assert "attnstash (rank 0): 2 layers stashed" in output and "attnstash (rank 1): 2 layers stashed" in output
    assert [r["rank"] for r in results[True]] == [0, 1] and all(r["world"] == 2 for r in results[True])
    for with_it, without in zip(results[True], results[False]):
        assert with_it["losses"] == without["losses"] and with_it["params"] == without["params"]
        assert with_it["keeps"] == with_it["replays"] == [2, 2, 2] and without["keeps"] == [None] * 3
