"""LLaMA-Factory (`llamafactory-cli train` on a YAML, its default reentrant checkpointing, with
ATTNSTASH_LAYERS) and axolotl (`axolotl train` on a YAML, with the AttentionStashPlugin), each on
the tiny local assets (tests/python/tiny_assets.py), without and with the stash: the same logged
losses, bitwise the same saved weights, the stash's figures in the logs. Each tool pins its own
transformers, so each runs in a venv of its own: tests/tools/run.sh (make test-tools) runs this
file in each; a test whose tool is not installed in the running venv is skipped."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
import tiny_assets  # noqa: E402

BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "DO_NOT_TRACK": "1", "AXOLOTL_DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "DISABLE_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets.write(tmp_path_factory.mktemp("assets"))


def run(args, cwd, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTASH_")}
    environ.update(OFFLINE, PYTHONPATH=str(ROOT), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **env)
    done = subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


def logged(output):
    logs = []
    for line in output.splitlines():
        start = line.find("{'loss'")
        if start >= 0 and "train_runtime" not in line:
            logs.append(ast.literal_eval(line[start:line.rindex("}") + 1]))
    return logs


def weights(folder):
    from safetensors.torch import load_file
    for name in ("adapter_model.safetensors", "model.safetensors"):
        if (folder / name).exists():
            return load_file(folder / name)
    raise AssertionError(f"no weights saved in {folder}: {sorted(os.listdir(folder))}")


def assert_same_training(without, with_it, out_without, out_with, layers=2, steps=2):
    logs_without, logs_with = logged(without), logged(with_it)
    assert len(logs_with) == steps and [log["loss"] for log in logs_with] == [log["loss"] for log in logs_without]
    assert all(log["attnstash/keeps"] == log["attnstash/replays"] == layers for log in logs_with), logs_with
    a, b = weights(out_without), weights(out_with)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.skipif(shutil.which("llamafactory-cli", path=str(BIN)) is None, reason="LLaMA-Factory is not installed here")
@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_llamafactory_cli_train_with_its_default_reentrant_checkpointing(finetuning, assets, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(assets["alpaca"], data / "alpaca.jsonl")
    (data / "dataset_info.json").write_text('{"tiny": {"file_name": "alpaca.jsonl", "columns": {"prompt": '
                                            '"instruction", "query": "input", "response": "output"}}}')
    outputs = {}
    for stash in (False, True):
        out = tmp_path / f"out-{stash}"
        config = tmp_path / f"sft-{stash}.yaml"
        config.write_text("\n".join([
            f"model_name_or_path: {assets['model']}", "stage: sft", "do_train: true", f"finetuning_type: {finetuning}",
            "lora_rank: 4", "lora_target: all", "dataset: tiny", f"dataset_dir: {data}", "template: chatml",
            "cutoff_len: 64", "overwrite_cache: true", "preprocessing_num_workers: 1", "dataloader_num_workers: 0",
            f"output_dir: {out}", "logging_steps: 1", "save_strategy: 'no'", "overwrite_output_dir: true",
            "report_to: none", "per_device_train_batch_size: 2", "learning_rate: 1.0e-3", "max_steps: 2",
            "lr_scheduler_type: constant", "bf16: false", "use_cpu: true", "seed: 0", "disable_tqdm: true"]))
        env = {"ATTNSTASH_LAYERS": "all"} if stash else {}
        outputs[stash] = (run([str(BIN / "llamafactory-cli"), "train", str(config)], tmp_path, **env), out)
    assert_same_training(outputs[False][0], outputs[True][0], outputs[False][1], outputs[True][1])
    assert "attnstash: 2 layers stashed; 4 keeps, 4 replays, 0 declined" in outputs[True][0]


def axolotl_config(assets, out, prepared, plugin, extra=()):
    return "\n".join([
        f"base_model: {assets['model']}", f"tokenizer_config: {assets['model']}", "model_type: AutoModelForCausalLM",
        "tokenizer_type: AutoTokenizer", "chat_template: tokenizer_default", "datasets:",
        f"  - path: {assets['chat']}", "    ds_type: json", "    type: chat_template", "    field_messages: messages",
        f"dataset_prepared_path: {prepared}", "val_set_size: 0", f"output_dir: {out}", "sequence_len: 64",
        "sample_packing: false", "micro_batch_size: 2", "gradient_accumulation_steps: 1", "max_steps: 2",
        "num_epochs: 1", "optimizer: adamw_torch", "lr_scheduler: constant", "learning_rate: 0.001", "bf16: false",
        "fp16: false", "tf32: false", "gradient_checkpointing: true", "logging_steps: 1", "save_strategy: 'no'",
        "sdp_attention: true", "flash_attention: false", "special_tokens: {pad_token: '<pad>'}", "seed: 42",
        *(["plugins:", "  - attnstash.integrations.axolotl.AttentionStashPlugin", "attnstash_layers: all"]
          if plugin else []), *extra])


def saved_adapter(model_dir, out):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(out)
    return out


@pytest.mark.skipif(shutil.which("axolotl", path=str(BIN)) is None, reason="axolotl is not installed here")
@pytest.mark.parametrize("setup", ["full", "lora"])
def test_axolotl_train_with_the_plugin(setup, assets, tmp_path):
    # axolotl's LoRA initialisation is not seeded (two runs without the plugin differ): both runs
    # start from one adapter saved here, nonzero on both sides so that it shapes the first step.
    lora = ["adapter: lora", "lora_r: 4", "lora_alpha: 8", "lora_target_linear: true", "lora_mlp_kernel: false",
            "lora_qkv_kernel: false", "lora_o_kernel: false", "lora_embedding_kernel: false",
            f"lora_model_dir: {saved_adapter(assets['model'], tmp_path / 'adapter')}"] if setup == "lora" else []
    outputs = {}
    for plugin in (False, True):
        out = tmp_path / f"out-{plugin}"
        config = tmp_path / f"axolotl-{plugin}.yml"
        config.write_text(axolotl_config(assets, out, tmp_path / "prepared", plugin, lora))
        outputs[plugin] = (run([str(BIN / "axolotl"), "train", str(config)], tmp_path), out)
    assert_same_training(outputs[False][0], outputs[True][0], outputs[False][1], outputs[True][1])


@pytest.mark.skipif(shutil.which("axolotl", path=str(BIN)) is None, reason="axolotl is not installed here")
def test_axolotl_with_its_selective_checkpointing_of_attention_is_refused(assets, tmp_path):
    config = tmp_path / "both.yml"
    config.write_text(axolotl_config(assets, tmp_path / "out", tmp_path / "prepared", True,
                                     ["selective_checkpointing: true",
                                      "gradient_checkpointing_kwargs: {use_reentrant: false}"]))
    done = subprocess.run([str(BIN / "axolotl"), "train", str(config)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT),
                                   "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}, timeout=900)
    assert done.returncode != 0
    assert "both attnstash" in done.stderr + done.stdout and "selective_checkpointing saving attention" in \
        done.stderr + done.stdout
