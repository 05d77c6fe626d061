"""attnstash.plan for every model the installer serves: a plain-PyTorch model and diffusers
models from the model and example inputs, diffusers transformers from their config and the
latent's size; each prediction equals what the stash then holds per layer. And the planner
runs from a config without the compiled ops."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnstash
import tiny_torch_models as plain

diffusers = pytest.importorskip("diffusers")
import tiny_diffusers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def held_after_a_forward(model, *args, layers=None, **kwargs):
    """{layer index: bytes} the stash holds after one training forward (then released)."""
    attnstash.install_attention_stash(model, layers=layers)
    try:
        torch.manual_seed(7)
        out = model(*args, **kwargs)
        held = {i: h.bytes for i, h in attnstash.layer_stash_stats(model).items()}
        del out
        attnstash.stash_clear()
    finally:
        attnstash.uninstall_attention_stash(model)
    return held


@pytest.mark.parametrize("calls", [1, 2])
def test_a_plain_model_with_example_inputs(calls):
    model = plain.gpt(checkpointing="non-reentrant", calls=calls)
    tokens = plain.ids()
    p = attnstash.plan(model, tokens, device="cpu", layers=plain.Block)
    assert p.inputs == "int64[2, 12]" and p.dtype is None and len(p.layers) == 3
    assert all(len(layer.calls) == calls for layer in p.layers)
    assert p.per_layer_bytes == held_after_a_forward(model, tokens, layers=plain.Block)
    assert not any(p.device.type == "meta" for p in model.parameters())  # the model itself is untouched


DIFFUSERS_FROM_CONFIG = {  # class -> the planner's latent size and text length, from the tiny case's inputs
    "FluxTransformer2DModel": lambda i: dict(latent_height=8, latent_width=8, text_len=i["encoder_hidden_states"].shape[1]),
    "QwenImageTransformer2DModel": lambda i: dict(latent_height=8, latent_width=8,
                                                  text_len=i["encoder_hidden_states"].shape[1]),
    "SD3Transformer2DModel": lambda i: dict(latent_height=i["hidden_states"].shape[2],
                                            latent_width=i["hidden_states"].shape[3],
                                            text_len=i["encoder_hidden_states"].shape[1]),
    "WanTransformer3DModel": lambda i: dict(latent_frames=i["hidden_states"].shape[2],
                                            latent_height=i["hidden_states"].shape[3],
                                            latent_width=i["hidden_states"].shape[4],
                                            text_len=i["encoder_hidden_states"].shape[1]),
    "HunyuanVideoTransformer3DModel": lambda i: dict(latent_frames=i["hidden_states"].shape[2],
                                                     latent_height=i["hidden_states"].shape[3],
                                                     latent_width=i["hidden_states"].shape[4],
                                                     text_len=i["encoder_hidden_states"].shape[1]),
    "LTXVideoTransformer3DModel": lambda i: dict(latent_frames=i["num_frames"], latent_height=i["height"],
                                                 latent_width=i["width"], text_len=i["encoder_hidden_states"].shape[1]),
    "CogVideoXTransformer3DModel": lambda i: dict(latent_frames=i["hidden_states"].shape[1],
                                                  latent_height=i["hidden_states"].shape[3],
                                                  latent_width=i["hidden_states"].shape[4],
                                                  text_len=i["encoder_hidden_states"].shape[1]),
}


@pytest.mark.parametrize("name", sorted(DIFFUSERS_FROM_CONFIG) + ["UNet2DConditionModel", "LTX2VideoTransformer3DModel"])
def test_a_diffusers_model_with_example_inputs_and_from_its_config(name):
    model, inputs = tiny_diffusers.build(name)
    model.enable_gradient_checkpointing()
    p = attnstash.plan(model, example_kwargs=inputs, device="cpu")
    held = held_after_a_forward(model, **inputs)
    assert p.per_layer_bytes == held and all(held.values())
    if name in DIFFUSERS_FROM_CONFIG:
        config = {**dict(model.config), "_class_name": name}
        from_config = attnstash.plan(config, batch_size=inputs["encoder_hidden_states"].shape[0], dtype="fp32",
                                     device="cpu", **DIFFUSERS_FROM_CONFIG[name](inputs))
        assert from_config.per_layer_bytes == held, str(from_config)


def test_a_diffusers_config_without_the_latent_size_says_what_it_needs():
    model, _ = tiny_diffusers.build("WanTransformer3DModel")
    config = {**dict(model.config), "_class_name": "WanTransformer3DModel"}
    with pytest.raises(ValueError, match="needs the latent's size .*latent_frames, latent_height, text_len"):
        attnstash.plan(config, batch_size=1, latent_width=8)
    with pytest.raises(ValueError, match="pass the model and example inputs"):
        attnstash.plan({**config, "_class_name": "MochiTransformer3DModel"}, batch_size=1)


def test_the_planner_runs_from_a_config_without_the_compiled_ops(tmp_path):
    shutil.copytree(ROOT / "attnstash", tmp_path / "attnstash", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "attnstash.planner",
                           str(ROOT / "examples/configs/Llama-3.1-8B.json"), "--batch", "1", "--seq", "128"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LlamaAttention" in done.stdout and "total, all 32 attention layers stashed" in done.stdout
    assert done.stderr == ""  # the planner needs no ops: no warning that they cannot load
