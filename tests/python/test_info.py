"""python -m attnstash.info, and the error of a missing build, when a source tree without a build
shadows a working installed attnstash (Python started inside the checkout imports the checkout)."""
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import attnstash
from attnstash import _library

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(attnstash.__file__).resolve().parent


def info(cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    run = subprocess.run([sys.executable, "-m", "attnstash.info"], capture_output=True, text=True, cwd=cwd, env=env)
    assert "Traceback" not in run.stderr, run.stderr
    facts = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in run.stdout.splitlines())
    return run, facts


@pytest.fixture
def installed_and_checkout(tmp_path):
    """A site folder with attnstash installed as pip would (the package with its build, and a .dist-info
    whose RECORD lists the files), and a checkout whose attnstash/ has no build."""
    if _library.library_path() is None:
        pytest.skip("needs attnstash/_C built (make build)")
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "attnstash", ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = site / f"attnstash-{attnstash.__version__}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: attnstash\nVersion: {attnstash.__version__}\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    files = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    (dist_info / "RECORD").write_text("".join(f"{name},,\n" for name in files + [f"{dist_info.name}/RECORD"]))
    assert any(re.fullmatch(r"attnstash/_C\..*\.so", name) for name in files)
    checkout = tmp_path / "checkout"
    shutil.copytree(PACKAGE, checkout / "attnstash", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    return site.resolve(), checkout.resolve()


def test_info_inside_a_checkout_without_a_build_names_the_installed_copy(installed_and_checkout):
    (site, checkout) = installed_and_checkout
    # Inside the checkout: the current directory comes first on sys.path, before the installed copy.
    (run, facts) = info(cwd=checkout, pythonpath=[site])
    assert run.returncode == 1, run.stdout + run.stderr
    assert facts["attnstash imported from"] == str(checkout / "attnstash")
    assert facts["attnstash library"] == "not built"
    assert facts["attnstash installed at"] == f"{site / 'attnstash'} (built for torch {torch.__version__})"
    ops = facts["ops registered"]
    assert ops.startswith("none: attnstash: the compiled ops (attnstash/_C) are not built in the attnstash imported "
                          f"here: the source tree at {checkout / 'attnstash'}, which has no build"), ops
    assert f"An installed attnstash is at {site / 'attnstash'} (built for torch {torch.__version__}" in ops
    assert "run from outside the checkout" in ops
    assert "`make build` or `pip install --no-build-isolation -e .`" in ops
    # info says it once, in its table (no import warning besides); `import attnstash` warns the same, and so
    # does the ImportError of a name that needs the ops.
    assert "An installed attnstash is at" not in run.stderr, run.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    warned = subprocess.run([sys.executable, "-c", "import attnstash"], capture_output=True, text=True, cwd=checkout,
                            env=env).stderr
    assert f"An installed attnstash is at {site / 'attnstash'}" in warned, warned
    code = ("import warnings; warnings.simplefilter('ignore'); import attnstash\n"
            "try:\n    attnstash.stash_stats\nexcept ImportError as e:\n    print(e)\n")
    error = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout, env=env).stdout
    assert "not built in the attnstash imported here" in error and f"is at {site / 'attnstash'}" in error, error


def test_info_outside_the_checkout_uses_the_installed_copy(installed_and_checkout, tmp_path):
    (site, _) = installed_and_checkout
    (run, facts) = info(cwd=tmp_path, pythonpath=[site])
    assert run.returncode == 0, run.stdout + run.stderr
    assert facts["attnstash imported from"] == str(site / "attnstash")
    assert facts["attnstash library"] == str(_library.library_path(site / "attnstash"))
    assert facts["attnstash built for torch"] == torch.__version__
    assert "attnstash::sdpa_fwd_keep" in facts["ops registered"]


def test_info_of_the_environment_prints_its_library(tmp_path):
    # The attnstash this venv has (make build: an editable install of the checkout), from elsewhere.
    (run, facts) = info(cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert facts["attnstash imported from"] == str(PACKAGE)
    assert facts["attnstash library"] == str(_library.library_path())
    assert "attnstash installed at" not in facts  # the one installed is the one imported


def test_an_editable_install_is_found_through_direct_url_json(tmp_path):
    project = tmp_path / "project"
    (project / "attnstash").mkdir(parents=True)
    dist_info = tmp_path / "site" / "attnstash-0.2.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnstash\nVersion: 0.2.0\n")
    (dist_info / "RECORD").write_text(f"__editable__.attnstash-0.2.0.pth,,\n{dist_info.name}/RECORD,,\n")
    (dist_info / "direct_url.json").write_text(json.dumps({"url": project.resolve().as_uri(),
                                                           "dir_info": {"editable": True}}))
    assert _library._package_folder(metadata.PathDistribution(dist_info)) == (project / "attnstash").resolve()
    (dist_info / "direct_url.json").write_text("not json")
    assert _library._package_folder(metadata.PathDistribution(dist_info)) is None


def test_the_missing_build_error_names_a_working_install_elsewhere(monkeypatch):
    monkeypatch.setattr(_library, "built_for", lambda: None)
    monkeypatch.setattr(_library, "installed_elsewhere", lambda: (Path("/opt/site/attnstash"), "2.13.0"))
    with pytest.raises(ImportError) as e:
        _library.load()
    assert "not built in the attnstash imported here" in str(e.value)
    assert "An installed attnstash is at /opt/site/attnstash (built for torch 2.13.0" in str(e.value)
    # An installed copy without a build of its own is no way out: the plain message.
    monkeypatch.setattr(_library, "installed_elsewhere", lambda: (Path("/opt/site/attnstash"), None))
    with pytest.raises(ImportError) as e:
        _library.load()
    assert "not built for this Python" in str(e.value) and "/opt/site" not in str(e.value)
