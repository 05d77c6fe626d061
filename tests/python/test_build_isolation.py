"""pip's default build (in an isolated build environment, without the user's torch) stops at once,
before CMake runs, with one message that names --no-build-isolation and says why; setup.py's check
passes in a Python that can build attnstash, and tells a Python without torch to install one."""
import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from attnstash import _library

ROOT = Path(__file__).resolve().parents[2]
PIP_ENV = "/tmp/pip-build-env-ab3_x9yz"  # the folder pip makes (tempfile.mkdtemp(prefix="pip-build-env-"))


def load_setup():
    """setup.py as a module: not run as __main__, it defines build_check() and runs nothing."""
    spec = importlib.util.spec_from_file_location("attnstash_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repack(name, folder):
    """A wheel of the installed distribution `name`, made from its installed files (no download)."""
    dist = metadata.distribution(name)
    info = f"{dist.metadata['Name']}-{dist.version}.dist-info"
    tag = next(line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines()
               if line.startswith("Tag:"))
    wheel = folder / f"{dist.metadata['Name']}-{dist.version}-{tag}.whl"
    skip = {f"{info}/{leftover}" for leftover in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as whl:
        for file in dist.files:
            if file.parts[0] == ".." or "__pycache__" in file.parts or str(file) in skip:
                continue  # scripts (pip writes them again), bytecode, what pip added when it installed
            data = Path(dist.locate_file(file)).read_bytes()
            whl.writestr(str(file), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{file},sha256={digest},{len(data)}")
        whl.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return wheel


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory):
    """setuptools and wheel, what pip installs into its isolated build environment (pyproject.toml's
    build-system requires), as wheels made from this venv's own: the build needs no network."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    for name in ("setuptools", "wheel"):
        repack(name, folder)
    return folder


def source_copy(dest):
    """The checkout's files as they are now (edits not committed yet included), without what git
    ignores (builds, venvs)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout (git ls-files) to copy the source tree")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_pip_default_isolated_build_stops_at_once_naming_the_flag_and_why(tmp_path, wheelhouse):
    src = source_copy(tmp_path / "src")
    out = tmp_path / "wheels"
    out.mkdir()
    # pip's own defaults only: no config file or PIP_* setting of this machine (indexes, constraints).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--find-links",
                          str(wheelhouse), "-w", str(out), str(src)],
                         capture_output=True, text=True, env=env, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    # It stopped in pip's first call into setup.py, with the one message, and without a traceback.
    assert "Getting requirements to build wheel did not run successfully" in output, output
    assert output.count("attnstash: pip is building attnstash in an isolated build environment") == 1, output
    assert "pip-build-env-" in output and "Traceback" not in output, output
    assert "pip install --no-build-isolation ." in output and "pip install --no-build-isolation git+https://" in output
    assert "compiled against the torch already installed in the Python that will run" in output
    assert "an isolated build would compile them against another torch" in output
    # It saw the torch of the Python it runs in, hidden from the isolated build environment.
    assert f"{sys.executable} has torch {metadata.version('torch')}" in output, output
    if sys.platform == "linux":  # the command that ran, read from /proc, with the flag
        assert f"pip wheel --no-build-isolation --no-deps --no-index --find-links {wheelhouse}" in output, output
        assert f"-w {out} {src}" in output, output
    # CMake never ran, and nothing was built.
    assert "cmake" not in output.lower() and "-- The C compiler" not in output, output
    assert list(out.iterdir()) == []
    assert not (src / "build").exists() and not list(src.glob("*.egg-info"))
    assert not list((src / "attnstash").glob("_C*"))


def test_the_check_passes_in_the_python_attnstash_is_built_in():
    assert load_setup().build_check() == ("ok", "")


def test_the_check_reads_the_supported_range_from_the_one_place_it_is_declared():
    (lo, hi) = _library.SUPPORTED_TORCH
    assert load_setup().supported_torch() == (f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}",
                                              f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}")


def fake_check(setup, path=(), pythonpath="", prefix="/usr", has_torch=True, target="2.13.0", ran=None):
    return setup.build_check(path=list(path), environ={"PYTHONPATH": pythonpath}, prefix=prefix,
                             has_torch=has_torch, installed_torch=lambda environ: target, command=lambda: ran)


@pytest.mark.parametrize("has_torch", [False, True])
def test_pips_build_environment_is_refused_whether_or_not_it_has_a_torch(has_torch):
    setup = load_setup()
    for where in ({"path": [f"{PIP_ENV}/site", f"{PIP_ENV}/overlay/lib/python3.11/site-packages"]},
                  {"pythonpath": f"{PIP_ENV}/site"}):
        (problem, message) = fake_check(setup, has_torch=has_torch, **where)
        assert problem == "isolated"
        assert message.startswith("attnstash: pip is building attnstash in an isolated build environment")
        assert PIP_ENV in message and "pip install --no-build-isolation ." in message
        assert "-e ." in message and "git+https://" in message and "Why: " in message
        assert f"{sys.executable} has torch 2.13.0: these commands build against it" in message
        assert ("it has a torch of its own" in message) == has_torch


def test_the_refusal_names_the_command_that_ran_and_a_missing_torch_too():
    (problem, message) = fake_check(load_setup(), path=[f"{PIP_ENV}/site"], has_torch=False, target=None,
                                    ran="pip install --no-build-isolation git+https://example.org/a.git")
    assert problem == "isolated"
    assert "    pip install --no-build-isolation git+https://example.org/a.git    (the command that ran" in message
    (lo, hi) = _library.SUPPORTED_TORCH
    assert f"{sys.executable} has no torch either" in message
    assert f"pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'" in message


def test_other_frontends_build_environments_are_refused_when_they_have_no_torch():
    setup = load_setup()
    (problem, message) = fake_check(setup, prefix="/tmp/build-env-k2j4_a9q", has_torch=False)
    assert problem == "isolated" and message.startswith("attnstash: python -m build is building attnstash")
    assert "--no-isolation" in message and "has torch" not in message  # its Python is not the target's
    (problem, message) = fake_check(setup, prefix="/root/.cache/uv/builds-v0/.tmpAb12Cd", has_torch=False)
    assert problem == "isolated" and message.startswith("attnstash: uv is building attnstash")
    # With a torch, a venv of such a name builds: CMake checks that torch.
    assert fake_check(setup, prefix="/tmp/build-env-k2j4_a9q") == ("ok", "")


def test_a_python_without_torch_is_told_to_install_a_supported_one():
    setup = load_setup()
    (problem, message) = fake_check(setup, path=["/usr/lib/python3/dist-packages"], has_torch=False)
    (lo, hi) = _library.SUPPORTED_TORCH
    assert problem == "no torch"
    assert message.startswith(f"attnstash: torch is not installed in {sys.executable}")
    assert f"torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}" in message and "pip install --no-build-isolation ." in message
    # Look-alike folders are not pip's build environment.
    assert fake_check(setup, path=["/home/u/pip-build-env-notes", "/srv/build-env-py311"]) == ("ok", "")


def test_cmakes_torch_check_points_to_the_rule_in_setup_py():
    text = (ROOT / "CMakeLists.txt").read_text()
    message = text[text.index("if(NOT _torch_rc EQUAL 0)"):text.index("endif()", text.index("if(NOT _torch_rc"))]
    assert "setup.py" in message and "pip install --no-build-isolation ." in message
    assert "attnstash/_library.py SUPPORTED_TORCH" in message
