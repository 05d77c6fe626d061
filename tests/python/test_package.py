"""The package registers its compiled ops when imported, explains a missing or mismatched
build, and reports its build."""
import os
import re
import subprocess
import sys

import pytest
import torch

import attnstash
from attnstash import _library


def test_importing_attnstash_registers_its_ops_and_their_fake_kernels():
    # As torchvision's: a model (or an exported or compiled graph) that calls
    # torch.ops.attnstash.* needs only `import attnstash`.
    code = ("import attnstash, torch\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "q = torch.randn(1, 2, 8, 4)\n"
            "out = torch.ops.attnstash.sdpa_fwd_keep(q, q, q, q, 0)\n"
            "assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))\n"
            "with FakeTensorMode() as mode:\n"
            "    fake = mode.from_tensor(q)\n"
            "    assert torch.ops.attnstash.sdpa_fwd_keep(fake, fake, fake, fake, 0).shape == (1, 2, 8, 4)\n"
            "print(attnstash.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert out.stdout.strip() == pyproject["project"]["version"]  # the version is written once


def test_without_a_build_import_warns_info_works_and_the_ops_explain(tmp_path):
    # The Python package alone (no attnstash/_C): what a broken or missing build looks like.
    import shutil
    from pathlib import Path
    shutil.copytree(Path(attnstash.__file__).parent, tmp_path / "attnstash",
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import attnstash\n"
            "assert any('not built' in str(w.message) for w in seen), [str(w.message) for w in seen]\n"
            "assert attnstash.parse_bytes('1KiB') == 1024\n"
            "try:\n"
            "    attnstash.stash_stats\n"
            "except ImportError as e:\n"
            "    assert 'not built' in str(e) and 'pip install --no-build-isolation' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('the ops loaded without a build')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    info = subprocess.run([sys.executable, "-m", "attnstash.info"], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert info.returncode == 1 and "Traceback" not in info.stderr, info.stderr
    assert "ops registered" in info.stdout and "none: attnstash: the compiled ops" in info.stdout
    assert torch.__version__ in info.stdout


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
    from importlib import metadata
    from attnstash.install import transformers_adapter
    (lo, hi) = transformers_adapter.SUPPORTED
    facts = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert facts["transformers"] == metadata.version("transformers")
    assert facts["transformers supported"] == f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    assert facts["diffusers"] == metadata.version("diffusers")


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


def test_a_torch_outside_the_supported_range_is_refused_with_what_to_install():
    (lo, hi) = _library.SUPPORTED_TORCH
    assert _library.torch_release("2.13.0+cpu") == (2, 13) and _library.torch_release("2.16.0.dev20260101") == (2, 16)
    _library.check_torch()  # the running torch is one of them
    for inside in (f"{lo[0]}.{lo[1]}.0", f"{hi[0]}.{hi[1]}.9+cu130"):
        _library.check_torch(inside)
    for outside in (f"{lo[0]}.{lo[1] - 1}.1", f"{hi[0]}.{hi[1] + 1}.0", "nightly"):
        with pytest.raises(ImportError) as e:
            _library.check_torch(outside)
        message = str(e.value)
        assert f"torch {outside} is not supported" in message
        assert f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}" in message and "pip install" in message


def requirements_of_the_installed_package():
    """The installed attnstash's Requires-Dist entries (what pip reads), each as (name, {specifier},
    marker): ("torch", {">=2.11", "<2.16"}, "")."""
    from importlib import metadata
    found = set()
    for entry in metadata.requires("attnstash") or []:
        spec, _, marker = entry.partition(";")
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", spec).group(1)
        specifiers = frozenset(s.strip() for s in spec.strip()[len(name):].strip(" ()").split(",") if s.strip())
        found.add((name.lower(), specifiers, marker.strip().replace("'", '"')))
    return found


def test_the_installed_package_requires_the_torch_range_it_loads_under():
    (lo, hi) = _library.SUPPORTED_TORCH
    assert ("torch", frozenset({f">={lo[0]}.{lo[1]}", f"<{hi[0]}.{hi[1] + 1}"}), "") in \
        requirements_of_the_installed_package()


def test_the_installed_package_s_transformers_extra_is_the_installer_s_range():
    # pip install 'attnstash[transformers]' installs a release the installer accepts.
    from attnstash.install import transformers_adapter
    (lo, hi) = transformers_adapter.SUPPORTED
    assert ("transformers", frozenset({f">={lo[0]}.{lo[1]}", f"<{hi[0]}.{hi[1] + 1}"}), 'extra == "transformers"') in \
        requirements_of_the_installed_package()


FAKE_TORCH = {  # what CMakeLists.txt asks of torch, from a stand-in that reports `version`
    "torch/__init__.py": "__version__ = {version!r}\n\n\nclass _C:\n    _GLIBCXX_USE_CXX11_ABI = 1\n",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": ("def include_paths():\n    return ['/nonexistent/include']\n\n\n"
                                     "def library_paths():\n    return ['/nonexistent/lib']\n"),
}


def test_the_build_refuses_a_torch_outside_the_range_it_reads_from_library_py(tmp_path):
    # CMake's configure step on a copy of the build files, against a stand-in torch of each version:
    # it refuses one outside SUPPORTED_TORCH, and reads that range from attnstash/_library.py (a copy
    # whose range is narrowed refuses a release the real range accepts).
    import shutil
    from pathlib import Path
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH, but attnstash was built with it (make build)")
    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    shutil.copytree(root / "csrc", src / "csrc")
    shutil.copy2(root / "CMakeLists.txt", src / "CMakeLists.txt")
    library = (root / "attnstash" / "_library.py").read_text()
    (lo, hi) = _library.SUPPORTED_TORCH

    def configure(torch_version, supported=(lo, hi)):
        (text, lines) = re.subn(r"^SUPPORTED_TORCH = .*$", f"SUPPORTED_TORCH = {supported}", library, flags=re.M)
        assert lines == 1
        (src / "attnstash").mkdir(exist_ok=True)
        (src / "attnstash" / "_library.py").write_text(text)
        fake = tmp_path / f"torch-{torch_version}"
        for name, text in FAKE_TORCH.items():
            (fake / name).parent.mkdir(parents=True, exist_ok=True)
            (fake / name).write_text(text.format(version=torch_version))
        env = {**os.environ, "PYTHONPATH": str(fake)}
        done = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "build"),
                               f"-DPython_EXECUTABLE={sys.executable}", f"-DATTNSTASH_OUTPUT_DIR={tmp_path / 'out'}"],
                              capture_output=True, text=True, env=env, timeout=300)
        output = " ".join((done.stdout + done.stderr).split())  # (CMake wraps its messages' lines)
        assert f"torch {torch_version} from /nonexistent/lib" in output, output  # the stand-in was read
        refused = f"has torch {torch_version}, but attnstash supports torch " in output
        assert not refused or done.returncode != 0, output
        return refused, output

    for outside in (f"{hi[0]}.{hi[1] + 1}.0", f"{lo[0]}.{lo[1] - 1}.2+cu126"):
        (refused, output) = configure(outside)
        assert refused and f"supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} only" in output, output
        assert f"pip install 'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'" in output, output
    newest = f"{hi[0]}.{hi[1]}.0"
    (refused, output) = configure(newest)
    assert not refused, output  # (the configure goes on, and fails later on the stand-in's missing libraries)
    narrowed = (lo, (hi[0], hi[1] - 1))
    (refused, output) = configure(newest, supported=narrowed)
    assert refused and f"supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1} only" in output, output


def test_the_python_table_of_kept_backends_is_the_compiled_one():
    # attnstash/backends.py's KEPT_BACKENDS (the fake kernels, the planner) and the backends the
    # ops keep (torch_ops/backends/): one row each, the same rows.
    from attnstash import backends
    compiled = sorted(torch.ops.attnstash.stash_kept_backends())
    assert compiled == sorted(f"{row.device}:{int(row.backend)}:{row.name}" for row in backends.KEPT_BACKENDS)
    assert len(compiled) == len(set(compiled)) == 4
