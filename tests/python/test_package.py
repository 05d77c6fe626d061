"""The package loads its compiled ops (lazily: at the first use of an op's name) and
reports its build."""
import subprocess
import sys

import torch

import attnstash
from attnstash import _library


def test_importing_attnstash_loads_nothing_compiled_until_an_op_is_used():
    code = ("import sys, attnstash, torch; "
            "assert 'attnstash._C' not in sys.modules and 'attnstash.ops' not in sys.modules; "
            "attnstash.stash_stats(); assert 'attnstash._C' in sys.modules; "
            "print(attnstash.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert out.stdout.strip() == pyproject["project"]["version"]  # the version is written once


def test_using_an_op_registers_both_ops():
    attnstash.sdpa_fwd_keep  # the first use loads them
    assert hasattr(torch.ops.attnstash, "sdpa_fwd_keep")
    assert hasattr(torch.ops.attnstash, "sdpa_replay")
    names = {str(n) for n in torch._C._dispatch_get_all_op_names() if str(n).startswith("attnstash::")}
    assert {"attnstash::sdpa_fwd_keep", "attnstash::sdpa_replay"} <= names


def test_library_was_built_for_the_running_torch():
    assert _library.built_for() == torch.__version__
    assert attnstash._C.torch_version == torch.__version__


def test_info_prints_versions_and_ops():
    out = subprocess.run([sys.executable, "-m", "attnstash.info"], capture_output=True, text=True, check=True).stdout
    assert "torch  " in out and torch.__version__ in out
    assert "attnstash::sdpa_fwd_keep" in out and "attnstash::sdpa_replay" in out
    assert "transformers" in out


def test_import_error_names_both_torches_and_the_rebuild_command(monkeypatch):
    monkeypatch.setattr(_library, "built_for", lambda: "0.0.0-other")
    try:
        _library.load()
    except ImportError as e:
        msg = str(e)
    else:
        raise AssertionError("load() accepted a library built for another torch")
    assert "0.0.0-other" in msg and torch.__version__ in msg and "pip install --no-build-isolation" in msg


def test_import_error_when_the_library_is_missing(monkeypatch):
    monkeypatch.setattr(_library, "built_for", lambda: None)
    try:
        _library.load()
    except ImportError as e:
        assert "not built" in str(e) and torch.__version__ in str(e)
    else:
        raise AssertionError("load() did not fail without a build")
