"""python -m attnstash.planner prints its table alone: no other library's warnings or log lines
(transformers' and diffusers' included) reach stderr while it builds and runs a model from a
config; and attnstash.plan leaves the caller's warnings filters, transformers' verbosity and
progress bars, and logging as they were, while what the caller's own model says still reaches it."""
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers

import attnstash
import tiny_torch_models as plain
from tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "examples", "configs")
HEADER = "attnstash plan: "


def has_columns(out):
    return any(line.split()[:3] == ["layers", "attention", "query"] for line in out.splitlines())


def command(*argv):
    """The command in a fresh interpreter, as a user runs it: PYTHONWARNINGS unset and
    transformers' verbosity at its default."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "CI")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "attnstash.planner", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_the_command_prints_the_table_alone_for_a_transformers_config():
    # The config says "torch_dtype" (as configs saved before transformers 4.56 do), which
    # transformers 5 warns about: the planner passes it as `dtype` where that is the name.
    done = command(os.path.join(CONFIGS, "Qwen3-30B-A3B.json"), "--batch", "1", "--seq", "64")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(HEADER + "Qwen3MoeForCausalLM") and has_columns(done.stdout), done.stdout


def test_the_command_prints_the_table_alone_for_a_diffusers_config():
    pytest.importorskip("diffusers")
    done = command(os.path.join(CONFIGS, "Wan2.1-T2V-14B-transformer.json"), "--batch", "1", "--latent-frames", "3",
                   "--latent-height", "8", "--latent-width", "8", "--text-len", "16")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(HEADER + "WanTransformer3DModel") and has_columns(done.stdout), done.stdout


def settings():
    """What the caller may have set that the planner touches while it runs."""
    tlog = transformers.utils.logging
    return (list(warnings.filters), tlog.get_verbosity(), logging.getLogger("transformers").level,
            tlog.is_progress_bar_enabled(), logging.root.manager.disable,
            {n: vars(logging.Logger).get(n) for n in ("warning_once", "info_once")})


class Heard(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def heard():
    """What transformers' and diffusers' loggers say (whatever stream their own handlers write)."""
    handler = Heard()
    loggers = [logging.getLogger(name) for name in ("transformers", "diffusers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.fixture
def callers_settings():
    """The caller's own: an error filter for one warning, transformers at INFO (it says what it
    builds), progress bars off."""
    tlog = transformers.utils.logging
    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="a filter of the caller's")
        tlog.set_verbosity_info()
        tlog.disable_progress_bar()
        try:
            yield settings()
        finally:
            tlog.set_verbosity(verbosity)
            (tlog.enable_progress_bar if bars else tlog.disable_progress_bar)()


def test_plan_from_a_config_says_nothing_and_restores_the_callers_settings(callers_settings, heard):
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        p = attnstash.plan(os.path.join(CONFIGS, "Llama-3.1-8B.json"), batch_size=1, seq_len=32, device="cpu")
    assert p.total_bytes > 0 and not warned and not heard  # at INFO, transformers says what it builds
    assert settings() == callers_settings
    transformers.logging.get_logger("transformers.attnstash_test").info("the caller's own line")
    assert heard == ["transformers.attnstash_test: the caller's own line"]  # the caller's loggers still speak


def test_plan_from_a_diffusers_config_says_nothing_and_restores_the_callers_settings(callers_settings, heard):
    diffusers = pytest.importorskip("diffusers")
    verbosity, bars = diffusers.utils.logging.get_verbosity(), diffusers.utils.logging.is_progress_bar_enabled()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        p = attnstash.plan(os.path.join(CONFIGS, "Wan2.1-T2V-14B-transformer.json"), batch_size=1, latent_frames=3,
                           latent_height=8, latent_width=8, text_len=16, dtype="bf16", device="cpu")
    assert p.total_bytes > 0 and not warned and not heard, (warned, heard)
    assert settings() == callers_settings
    assert diffusers.utils.logging.get_verbosity() == verbosity
    assert diffusers.utils.logging.is_progress_bar_enabled() == bars


def test_the_command_called_in_process_restores_the_callers_settings(callers_settings, capsys):
    from attnstash.planner.__main__ import main
    assert main([os.path.join(CONFIGS, "Llama-3.1-8B.json"), "--batch", "1", "--seq", "32", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(HEADER)
    assert settings() == callers_settings


class WarningBlock(plain.Block):
    def forward(self, x, mask=None):
        warnings.warn("the caller's own model warns", UserWarning)
        return super().forward(x, mask)


def test_what_the_callers_own_model_says_still_reaches_the_caller():
    model = plain.gpt(layers=2, block_class=WarningBlock, checkpointing=None)
    with pytest.warns(UserWarning, match="the caller's own model warns"):
        p = attnstash.plan(model, plain.ids(), device="cpu", layers=WarningBlock)
    assert p.total_bytes > 0 and isinstance(model.blocks[0].qkv.weight, torch.nn.Parameter)


def test_a_configs_torch_dtype_is_passed_by_the_name_the_installed_transformers_takes():
    """The cause of transformers 5's "`torch_dtype` is deprecated!" is the planner's to avoid."""
    from attnstash.planner.sources import _current_names
    renamed = isinstance(getattr(transformers.PretrainedConfig, "torch_dtype", None), property)
    values = _current_names(transformers, {"model_type": "llama", "torch_dtype": "float32"})
    assert values == ({"model_type": "llama", "dtype": "float32"} if renamed else
                      {"model_type": "llama", "torch_dtype": "float32"})
    p = attnstash.plan({**tiny_config("llama").to_dict(), "torch_dtype": "float32"}, batch_size=1, seq_len=8,
                       device="cpu")
    assert p.dtype == torch.float32  # the config's dtype, read under either name


def test_a_once_only_message_silenced_inside_is_still_said_once_after(heard):
    from attnstash.planner.quiet import others_silenced
    logger = transformers.logging.get_logger("transformers.attnstash_once")
    with others_silenced():
        logger.warning_once("said once, after the planner")
        logger.warning("not said")
    assert heard == []
    logger.warning_once("said once, after the planner")
    logger.warning_once("said once, after the planner")
    assert heard == ["transformers.attnstash_once: said once, after the planner"]
