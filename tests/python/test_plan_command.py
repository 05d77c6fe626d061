"""The attnstash.plan command (python -m attnstash.planner) and function on config files: the
table printed for each example config of examples/configs (the same table the function returns),
the backend the rules choose where there is no GPU, and bad command lines, arguments, configs and
models refused clearly."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import attnstash
from attnstash.planner import StashPlan, plan
from attnstash.planner.__main__ import main
from attnstash.planner.sources import read_config
from plan_cases import HF4, config_of, no_cuda
from tiny_models import VOCAB, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "examples", "configs")


# ---- the command and the example configs ----------------------------------------------------

EXAMPLES = {  # bf16, batch 4, seq 4096, cuDNN: output + LSE [B, H, S, 1] fp32 + two 8-byte philox scalars
    "Qwen3-30B-A3B.json": (48, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Llama-3.1-8B.json": (32, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Mistral-7B-v0.3.json": (32, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Qwen2.5-7B.json": (28, 4 * 28 * 4096 * 128 * 2 + 4 * 28 * 4096 * 4 + 16),
}
# A diffusers transformer: Wan2.1-T2V-14B at 81 frames of 480x832 (latent 21 x 60 x 104, patch 1x2x2:
# 32,760 tokens) and 512 text tokens, bf16, cuDNN: each block keeps its self- and its cross-attention.
WAN = "Wan2.1-T2V-14B-transformer.json"
WAN_ARGS = ("--batch", "1", "--latent-frames", "21", "--latent-height", "60", "--latent-width", "104",
            "--text-len", "512")
WAN_BLOCKS, WAN_PER_BLOCK = 40, 2 * (40 * 32760 * 128 * 2 + 40 * 32760 * 4 + 16)


def run_main(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_example_configs_are_shipped():
    assert sorted(os.listdir(CONFIGS)) == sorted([*EXAMPLES, WAN])


def test_the_command_plans_the_diffusers_example_config(capsys):
    pytest.importorskip("diffusers", reason="the diffusers tests run where diffusers is installed (the main venv)")
    out = run_main(capsys, os.path.join(CONFIGS, WAN), *WAN_ARGS, "--dtype", "bf16", "--backend", "cudnn",
                   "--max-bytes", "8GiB")
    assert "[1, 40, 32760, 128]  [1, 40, 512, 128]" in out  # the cross-attention reads the text
    assert f"{WAN_PER_BLOCK:,}" in out and WAN_PER_BLOCK == 681_408_032
    assert f"all {WAN_BLOCKS} attention layers stashed: {WAN_BLOCKS * WAN_PER_BLOCK:,} bytes" in out
    assert f"the last {8 * 2**30 // WAN_PER_BLOCK} of {WAN_BLOCKS} attention layers fit" in out


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_command_prints_each_example_configs_table(name, capsys):
    layers, per_layer = EXAMPLES[name]
    out = run_main(capsys, os.path.join(CONFIGS, name), "--batch", "4", "--seq", "4096", "--dtype", "bf16",
                   "--backend", "cudnn", "--max-bytes", "8GiB")
    assert f"{per_layer:,}" in out and "cudnn_attention" in out
    assert f"all {layers} attention layers stashed: {layers * per_layer:,} bytes" in out
    fit = min(layers, 8 * 2**30 // per_layer)
    assert f"the last {fit} of {layers} attention layers fit" in out


def test_the_function_returns_the_table_the_command_prints(capsys):
    path = os.path.join(CONFIGS, "Llama-3.1-8B.json")
    out = run_main(capsys, path, "--batch", "2", "--seq", "256", "--max-bytes", "100MB", "--padded", "--sm", "80")
    p = plan(path, batch_size=2, seq_len=256, device="cuda", max_bytes="100MB", padded=True, cuda_capability=(8, 0))
    assert out == str(p) + "\n"
    assert p.dtype == torch.bfloat16  # the config's torch_dtype
    assert p.max_bytes == 10**8 and p.layers_that_fit == p.layers_within(10**8)
    assert [layer.index for layer in p.layers] == list(range(32)) and p.layers_found == 32


@no_cuda
def test_qwen3_30b_a3b_plans_cudnn_on_hopper_as_the_seed_measured(capsys):
    """The seed measured 136,314,896 bytes per stashed layer and micro-batch at this shape on
    an H200 (cuDNN). Without a GPU the rules decide: torch >= 2.11 on sm90 tries cuDNN first."""
    path = os.path.join(CONFIGS, "Qwen3-30B-A3B.json")
    out = run_main(capsys, path, "--batch", "4", "--seq", "4096")
    assert "136,314,896" in out and "cudnn_attention" in out and "no CUDA device here" in out
    assert "the CUDA wheels of torch 2.11 to 2.15" in out or torch.backends.cudnn.version()
    assert "[4, 32, 4096, 128]" in out  # the query: 32 heads of 128
    if HF4:  # transformers 4.57 builds a 4-D mask in training (it checks for packed sequences) and repeats K/V
        assert "[4, 1, 4096, 4096] bool" in out and "[4, 32, 4096, 128]  [4, 32, 4096, 128]" in out
    else:  # transformers 5: no mask (is_causal), grouped K/V: 4 KV heads
        assert "causal" in out and "[4, 4, 4096, 128]" in out
    # On an A100 (sm80) cuDNN is not tried first: flash without a mask (its extras are a
    # 2-element uint64 rng state and a uint64 scalar), memory-efficient with one. (Llama-3.1-8B:
    # the same query shape, quicker to build than 128 experts a layer.)
    out = run_main(capsys, os.path.join(CONFIGS, "Llama-3.1-8B.json"), "--batch", "4", "--seq", "4096", "--sm", "80")
    if HF4:
        assert "efficient_attention" in out and "136,314,896" in out
    else:
        assert "flash_attention" in out and f"{136_314_880 + 24:,}" in out


def test_the_cpu_plan_has_no_extras(capsys):
    out = run_main(capsys, os.path.join(CONFIGS, "Qwen3-30B-A3B.json"), "--batch", "4", "--seq", "4096",
                   "--device", "cpu")
    assert "136,314,880" in out and "flash_attention" in out and "torch on cpu" in out


def test_python_dash_m_runs_the_command():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "attnstash.planner", os.path.join(CONFIGS, "Llama-3.1-8B.json"),
                           "--batch", "1", "--seq", "128", "--backend", "cudnn"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LlamaAttention" in done.stdout and f"{1 * 32 * 128 * 128 * 2 + 1 * 32 * 128 * 4 + 16:,}" in done.stdout


def test_attnstash_plan_is_callable_as_a_function():
    assert isinstance(attnstash.plan(config_of("llama"), batch_size=1, seq_len=8, dtype="fp32", device="cpu"), StashPlan)


# ---- bad input --------------------------------------------------------------------------------

def command_error(capsys, *argv):
    """The one line a bad command line prints (exit status 2), with no traceback."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_command_lines_say_what_is_wrong(tmp_path, capsys):
    good = os.path.join(CONFIGS, "Llama-3.1-8B.json")
    assert "no such config file" in command_error(capsys, str(tmp_path / "missing.json"), "--batch", "1", "--seq", "8")
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    assert "is not valid JSON" in command_error(capsys, str(broken), "--batch", "1", "--seq", "8")
    typeless = tmp_path / "typeless.json"
    typeless.write_text(json.dumps({"hidden_size": 64}))
    assert 'has no "model_type"' in command_error(capsys, str(typeless), "--batch", "1", "--seq", "8")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model"}))
    assert "no-such-model" in command_error(capsys, str(unknown), "--batch", "1", "--seq", "8")
    with open(good) as f:
        values = json.load(f)
    for field, bad, words in (("hidden_size", "abc", '"hidden_size" must be a number (like 4096), got \'abc\''),
                              ("num_attention_heads", -3, '"num_attention_heads" must be positive (like 32), got -3'),
                              ("intermediate_size", [1], '"intermediate_size" must be a number')):
        config = tmp_path / f"bad-{field}.json"
        config.write_text(json.dumps({**values, field: bad}))
        err = command_error(capsys, str(config), "--batch", "1", "--seq", "8")
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert "dtype must be one of" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--dtype", "int8")
    assert "cannot read '8 gigs' as a byte count" in command_error(capsys, good, "--batch", "1", "--seq", "8",
                                                                   "--max-bytes", "8 gigs")
    assert "batch_size must be a positive int, got 0" in command_error(capsys, good, "--batch", "0", "--seq", "8")
    assert "invalid int value" in command_error(capsys, good, "--batch", "four", "--seq", "8")
    assert "backend must be" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--backend", "fastest")
    assert "--sm (cuda_capability) must be a compute capability" in command_error(capsys, good, "--batch", "1", "--seq", "8",
                                                                "--sm", "hopper")
    assert "device" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--device", "tpu")
    assert "required" in command_error(capsys, good, "--seq", "8")


def test_bad_arguments_to_the_function_say_what_is_wrong():
    cfg = config_of("llama")
    for bad, message in [(dict(batch_size=True), "got the bool"), (dict(seq_len=0), "seq_len must be a positive int"),
                         (dict(seq_len=2.5), "seq_len must be a positive int"), (dict(dtype="int8"), "dtype"),
                         (dict(max_bytes=-1), "byte count"), (dict(backend="fast"), "backend must be")]:
        args = {**dict(source=cfg, batch_size=1, seq_len=8, device="cpu"), **bad}
        with pytest.raises(ValueError, match=message):
            plan(**args)
    with pytest.raises(ValueError, match="expected a model, a transformers config"):
        plan(42, batch_size=1, seq_len=8)


def test_a_model_the_installer_refuses_is_refused_with_its_reasons():
    eager = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        plan(eager, batch_size=1, seq_len=8)
    # No attention at all: transformers refuses SDPA for it, or the installer finds no attention layers.
    mamba = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                                     use_cache=False)
    with pytest.raises(ValueError, match='cannot build mamba with attn_implementation="sdpa"|no attention layers'):
        plan(mamba, batch_size=1, seq_len=8, device="cpu")


def test_a_config_is_read_from_a_file_a_folder_or_a_dict_alike(tmp_path):
    values = json.load(open(os.path.join(CONFIGS, "Qwen2.5-7B.json")))
    (tmp_path / "config.json").write_text(json.dumps(values))
    plans = [plan(source, batch_size=1, seq_len=64, device="cpu", dtype="fp32")
             for source in (str(tmp_path / "config.json"), tmp_path, values)]
    assert read_config(tmp_path)[0] == values
    assert all(p.per_layer_bytes == plans[0].per_layer_bytes and len(p.layers) == 28 for p in plans)
