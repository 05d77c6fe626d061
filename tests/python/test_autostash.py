"""ATTNSTASH_LAYERS (attnstash/integrations/autostash.py): with it set, a new Python process
installs the stash on each model the moment its checkpointing is enabled (transformers,
diffusers, torch's apply_activation_checkpointing) and every Trainer reports its figures; unset,
nothing happens; a bad value ends the process at once saying what it accepts. Each case runs a
fresh interpreter (the start-up line is read by the interpreter), with and without the variable,
and compares the two runs bitwise."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PTH = Path(sysconfig.get_paths()["purelib"]) / "attnstash-autostash.pth"


def require_start_up_line():
    """A missing start-up line fails the test (never skips it): after `make build` it must be there."""
    if not PTH.exists():
        pytest.fail(f"{PTH.name} is missing from site-packages ({PTH.parent}): `make build` puts it there "
                    "(copied for an editable install; pip installs it with a regular one)", pytrace=False)


def run(code, **env):
    """Runs `code` in a new interpreter with the variables `env` (None: unset); (stdout's last
    line as JSON, stderr, return code)."""
    require_start_up_line()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTASH_")}
    environ.update({k: v for k, v in env.items() if v is not None})
    environ["PYTHONPATH"] = os.pathsep.join([str(HERE), environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=600)
    lines = done.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if done.returncode == 0 and lines else None), done.stderr, done.returncode


STEP = """
import json, sys, torch, attnstash
from tiny_models import batch, tiny_model
model = tiny_model("llama", layers=4)   # enables reentrant checkpointing
if "{mode}" == "non-reentrant":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
ids = batch()
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
s = attnstash.stash_stats()
print(json.dumps({{"loss": loss.item(), "grads": [p.grad.double().sum().item() for p in model.parameters()],
                  "stashed": sorted(attnstash.layer_stash_stats(model)), "keeps": s["keeps"],
                  "replays": s["replays"], "records": s["records"], "max_bytes": s["max_bytes"],
                  "torch_at_start": {torch_at_start}}}))
"""


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("layers,stashed", [("all", [0, 1, 2, 3]), ("2", [2, 3])])
def test_the_stash_is_installed_when_checkpointing_is_enabled(mode, layers, stashed):
    code = STEP.format(mode=mode, torch_at_start="torch_at_start")
    without, err, rc = run("import sys; torch_at_start = 'torch' in sys.modules\n" + code)
    assert rc == 0, err
    with_it, err, rc = run("import sys; torch_at_start = 'torch' in sys.modules\n" + code, ATTNSTASH_LAYERS=layers)
    assert rc == 0, err
    assert without["stashed"] == [] and without["keeps"] == 0
    assert with_it["stashed"] == stashed and with_it["keeps"] == with_it["replays"] == len(stashed)
    assert with_it["loss"] == without["loss"] and with_it["grads"] == without["grads"]  # bitwise (repr of doubles)
    assert with_it["records"] == 0 and with_it["max_bytes"] == -1
    assert not with_it["torch_at_start"]  # the start-up line imports no torch


@pytest.mark.parametrize("value,offload", [(None, "NoneType"), ("0", "NoneType"), ("1", "Own")])
def test_attnstash_offload_installs_the_own_offload(value, offload):
    code = ("import json\nfrom tiny_models import tiny_model\nfrom attnstash.install import core\n"
            "m = tiny_model('llama', layers=2)\nm.gradient_checkpointing_enable()\n"
            "print(json.dumps(sorted({type(core.stash_of(l).install.offload).__name__ for l in m.model.layers})))")
    out, err, rc = run(code, ATTNSTASH_LAYERS="all", ATTNSTASH_OFFLOAD=value)
    assert rc == 0, err
    assert out == [offload]


def test_the_budget_comes_from_attnstash_max_bytes():
    code = STEP.format(mode="reentrant", torch_at_start="False")
    with_it, err, rc = run(code, ATTNSTASH_LAYERS="all", ATTNSTASH_MAX_BYTES="1KiB")
    assert rc == 0, err
    assert with_it["max_bytes"] == 1024 and with_it["keeps"] == 0  # every keep declined: over the budget


@pytest.mark.parametrize("variable,value,words", [
    ("ATTNSTASH_LAYERS", "banana", 'ATTNSTASH_LAYERS=\'banana\' is not a number of layers: use "all"'),
    ("ATTNSTASH_LAYERS", "0", "a positive int (the last N attention layers)"),
    ("ATTNSTASH_MAX_BYTES", "lots", "ATTNSTASH_MAX_BYTES='lots': cannot read 'lots' as a byte count"),
    ("ATTNSTASH_OFFLOAD", "yes", "ATTNSTASH_OFFLOAD='yes': use 1 (move what the stash keeps to host memory"),
])
def test_a_bad_value_ends_the_process_at_once_with_what_it_accepts(variable, value, words):
    env = {"ATTNSTASH_LAYERS": "all", variable: value}
    _, err, rc = run("print('{}')", **env)
    assert rc == 2 and words in err and "Traceback" not in err, err


def test_a_number_larger_than_the_model_s_attention_layers_fails_as_the_install_does():
    _, err, rc = run("from tiny_models import tiny_model\ntiny_model('llama', layers=3)", ATTNSTASH_LAYERS="9")
    assert rc != 0 and "InstallError: attnstash (ATTNSTASH_LAYERS=9): num_layers must be between 1 and the 3 " \
                       "attention layers" in err, err


def test_unset_nothing_is_loaded():
    out, err, rc = run("import json, sys; import torch, transformers\n"
                       "print(json.dumps(sorted(m for m in sys.modules if 'attnstash' in m and 'editable' not in m)))")
    assert rc == 0 and out == [], (out, err)  # (an editable install's own finder aside)


def test_diffusers_and_apply_activation_checkpointing_get_the_stash_when_they_enable_it():
    code = """
import json, torch, attnstash, tiny_diffusers, tiny_torch_models
model, inputs = tiny_diffusers.build("WanTransformer3DModel")
model.enable_gradient_checkpointing()
plain = tiny_torch_models.wrapped(tiny_torch_models.gpt())   # calls torch's apply_activation_checkpointing
tiny_diffusers.loss_and_grads(model, inputs)
tiny_torch_models.loss_and_grads(plain, tiny_torch_models.ids())
print(json.dumps([sorted(attnstash.layer_stash_stats(m)) for m in (model, plain)] + [attnstash.stash_stats()["keeps"]]))
"""
    out, err, rc = run(code, ATTNSTASH_LAYERS="all")
    assert rc == 0, err
    assert out == [[0, 1], [0, 1, 2], 4 + 3]


def test_every_trainer_reports_the_figures_and_a_summary_at_the_end(tmp_path):
    code = f"""
import json, torch, transformers
from tiny_models import VOCAB, tiny_model
model = tiny_model("llama")
data = [{{"input_ids": torch.randint(0, VOCAB, (16,)), "labels": torch.randint(0, VOCAB, (16,))}} for _ in range(4)]
args = transformers.TrainingArguments(output_dir={str(tmp_path)!r}, max_steps=2, per_device_train_batch_size=2,
                                      logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                                      gradient_checkpointing=True,
                                      gradient_checkpointing_kwargs={{"use_reentrant": True}})
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print(json.dumps([h for h in trainer.state.log_history if "loss" in h]))
"""
    logs, err, rc = run(code, ATTNSTASH_LAYERS="all")
    assert rc == 0, err
    assert len(logs) == 2 and all(log["attnstash/keeps"] == log["attnstash/replays"] == 3 for log in logs)
    assert "attnstash: 3 layers stashed; 6 keeps, 6 replays, 0 declined; peak " in err, err


def test_a_model_with_attention_dropout_fails_when_checkpointing_is_enabled_naming_the_field():
    _, err, rc = run("from tiny_models import tiny_model\ntiny_model('qwen2', attention_dropout=0.1)",
                     ATTNSTASH_LAYERS="all")
    assert rc != 0 and "InstallError: attnstash (ATTNSTASH_LAYERS=all): layer 0 (model.layers.0, Qwen2DecoderLayer)" \
                       in err and "has attention_dropout=0.1" in err and \
           "Qwen2ForCausalLM.from_pretrained(..., attention_dropout=0.0)" in err, err


def test_a_trainer_without_checkpointing_says_checkpointing_was_never_turned_on(tmp_path):
    code = f"""
import json, torch, transformers
from tiny_models import VOCAB, tiny_config
model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
data = [{{"input_ids": torch.randint(0, VOCAB, (16,)), "labels": torch.randint(0, VOCAB, (16,))}} for _ in range(4)]
args = transformers.TrainingArguments(output_dir={str(tmp_path)!r}, max_steps=2, per_device_train_batch_size=2,
                                      logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                                      gradient_checkpointing=False)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print(json.dumps([h["attnstash/keeps"] for h in trainer.state.log_history if "loss" in h]))
"""
    keeps, err, rc = run(code, ATTNSTASH_LAYERS="all")
    assert rc == 0, err
    assert keeps == [0, 0]
    from tiny_models import checkpointing_field
    field = checkpointing_field()
    said = ("ATTNSTASH_LAYERS=all, but checkpointing was never turned on for any model in this process, so nothing "
            "was stashed: the trainer trains LlamaForCausalLM without activation checkpointing "
            f"(TrainingArguments.{field}=False)")
    assert err.count(said) == 2, err  # the warning at train begin, and the summary at train end
    assert "attnstash: 0 layers stashed; 0 keeps, 0 replays, 0 declined; peak 0 bytes held; " + said in err, err
    assert "AttentionStashCallback" not in err, err  # a callback the user never created is not blamed
