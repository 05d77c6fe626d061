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


def test_every_kept_backend_is_one_row_naming_an_aten_op_of_this_torch():
    # attnstash/backends.py reads its table from the compiled one (torch_ops/backends/).
    from attnstash import backends
    rows = backends.KEPT_BACKENDS
    assert sorted((r.device, r.backend.name) for r in rows) == [
        ("cpu", "FLASH_ATTENTION"), ("cuda", "CUDNN_ATTENTION"), ("cuda", "EFFICIENT_ATTENTION"),
        ("cuda", "FLASH_ATTENTION")]
    for row in rows:
        assert row.forward_op is not None and row.forward_op.name() == f"aten::{row.forward_op_name}", row
        assert backends.kept_backend(row.device, int(row.backend)) is row


def test_the_cpu_backend_s_python_calls_are_the_kept_path_s_own():
    # KeptBackend.forward and .backward run the C++ backend's calls (attnstash::_backend_forward,
    # _backend_backward): bitwise the fused ops F.sdpa and its derivative call, a boolean mask
    # made additive as F.sdpa makes it.
    from attnstash import backends
    row = backends.kept_backend("cpu", torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    out, lse, extras = row.forward(q, k, v, mask, False, 0.5)
    assert extras == []
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.5))
    additive = torch.where(mask, 0.0, torch.tensor(float("-inf")))
    want_out, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                                    attn_mask=additive, scale=0.5)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    grad = torch.randn(2, 3, 5, 8, generator=g)
    got = row.backward(grad, q, k, v, mask, out, lse, extras, False, 0.5)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False,
                                                                               attn_mask=additive, scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["flash_attention (CPU)", "cudnn_attention", "flash_attention",
                                  "efficient_attention"])
def test_each_backend_s_shapes_trace_with_dynamic_shapes_without_specialising_them(name):
    # What the fake kernels run under torch.compile's dynamic shapes: each backend's forward and
    # backward on symbolic sizes (a mask where the backend takes one), with no guard that fixes one.
    from torch.fx.experimental.proxy_tensor import make_fx
    from attnstash import backends
    row = next(r for r in backends.KEPT_BACKENDS if r.name == name)
    dtype = torch.bfloat16 if row.device == "cuda" else torch.float32
    q = torch.empty(2, 4, 16, 64, dtype=dtype, device="meta")
    kv = torch.empty(2, 4, 24, 64, dtype=dtype, device="meta")
    mask = None if name == "flash_attention" else torch.empty(2, 1, 16, 24, dtype=torch.bool, device="meta")
    envs = []

    def both(q, k, v, mask):
        out, lse, extras = row.forward(q, k, v, mask, False, None)
        envs.append(torch._guards.detect_fake_mode(q).shape_env)
        return (out, lse, *row.backward(out, q, k, v, mask, out, lse, extras, False, None))

    traced = make_fx(both, tracing_mode="symbolic")(q, kv, kv, mask)
    out = [n for n in traced.graph.output_node().args[0]][0].meta["val"]
    assert out.dim() == 4 and all(isinstance(s, torch.SymInt) for s in out.shape[:3])
    # Only head_dim may be fixed (64, which no other size here is: a model's constant, which CUDA
    # flash's refusal reads); batch, heads and sequences stay symbolic.
    assert set(envs[0].replacements.values()) <= ({64} if name == "flash_attention" else set()), envs[0].replacements


def test_the_planner_s_statement_of_the_forwards_without_a_build_is_the_compiled_one():
    # attnstash/_unbuilt_backends.py (the planner without the compiled ops) against the C++
    # backends: the same rows, and on meta tensors the same shapes, dtypes and strides of every
    # output, and the same refusals.
    from attnstash import _unbuilt_backends, backends
    def key(row):
        return row.device, int(row.backend)
    built_rows = sorted(backends.KEPT_BACKENDS, key=key)
    unbuilt = sorted((backends.KeptBackend(*row[:4], unbuilt_call=row[4]) for row in _unbuilt_backends.ROWS), key=key)
    assert [(r.device, r.backend, r.name, r.forward_op_name) for r in unbuilt] == \
        [(r.device, r.backend, r.name, r.forward_op_name) for r in built_rows]

    def meta(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    def layout(outputs):
        out, lse, extras = outputs
        return [(tuple(t.shape), t.stride(), t.dtype) for t in (out, lse, *extras)]

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for mask in (None, meta(2, 1, 13, 29, dtype=torch.bool), meta(1, 4, 13, 29, dtype=dtype),
                     meta(13, 29, dtype=torch.float32)):
            for head_dim, is_causal, scale in ((64, False, None), (60, True, 0.25), (128, False, 1.0)):
                q, kv = meta(2, 4, 13, head_dim, dtype=dtype), meta(2, 4, 29, head_dim, dtype=dtype)
                for built, plain in zip(built_rows, unbuilt):
                    case = (built.name, dtype, None if mask is None else (mask.shape, mask.dtype), head_dim)
                    assert built.refuses(q, kv, kv, mask, is_causal, scale) == \
                        plain.refuses(q, kv, kv, mask, is_causal, scale), case
                    if built.refuses(q, kv, kv, mask, is_causal, scale) is None and \
                            not (built.name == "flash_attention" and mask is not None):  # (CUDA flash takes no mask)
                        assert layout(built.forward(q, kv, kv, mask, is_causal, scale)) == \
                            layout(plain.forward(q, kv, kv, mask, is_causal, scale)), case


def test_a_backend_s_own_refusal_is_read_from_its_forward():
    # KeptBackend.refuses runs the C++ forward on meta tensors: CUDA flash refuses a head_dim that
    # F.sdpa pads around it (torch_ops/backends/cuda_flash.cpp); the others take it.
    from attnstash import backends
    q = torch.empty(1, 2, 8, 60, dtype=torch.bfloat16)
    for row in backends.KEPT_BACKENDS:
        refused = row.refuses(q, q, q)
        if row.device == "cuda" and row.backend == torch.nn.attention.SDPBackend.FLASH_ATTENTION:
            assert refused.startswith("flash attention with head_dim 60 (not a multiple of 8) is not kept"), refused
        else:
            assert refused is None, (row, refused)


