"""A thin shim: CMake (CMakeLists.txt) knows the sources and builds attnstash/_C; the
package's metadata is pyproject.toml's.

    pip install --no-build-isolation .        # or -e . ; or git+https://... instead of .

Build against the torch already installed, never in an isolated build environment:
build_check() below states the rule and stops such a build at once, before CMake runs.
Environment: ATTNSTASH_BUILD_DIR (default build/cmake), ATTNSTASH_BUILD_TESTS=1 to build the
GoogleTest suites too, CMAKE_BUILD_PARALLEL_LEVEL.
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent

# The rule, stated here once (CMakeLists.txt's torch check points to it).
WHY = ("Why: attnstash's ops are compiled against the torch already installed in the Python that will run\n"
       "them, and load only under that torch; an isolated build would compile them against another torch,\n"
       "or none.")
FIX = ("    pip install --no-build-isolation .                  (from a clone; -e . for an editable install)\n"
       "    pip install --no-build-isolation git+https://...    (or the path or URL you gave pip)")
SETUPTOOLS = "(Without isolation pip uses that Python's own setuptools: pip install setuptools if it lacks one.)"
# The folders that isolating build frontends make (a random suffix each).
ISOLATED = (("pip", r"pip-build-env-\w{8}"), ("python -m build", r"build-env-\w{8}"), ("uv", r"builds-v\d+"))


def supported_torch():
    """'2.11 to 2.15' and the pip requirement, from attnstash/_library.py's SUPPORTED_TORCH (the one
    place it is declared; importing that module would need torch)."""
    line = re.search(r"^SUPPORTED_TORCH = (.*)$", (ROOT / "attnstash" / "_library.py").read_text(), re.M)
    lo_major, lo_minor, hi_major, hi_minor = map(int, re.findall(r"\d+", line.group(1)))
    return (f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}",
            f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}")


def isolation_sign(path, environ, prefix):
    """(frontend, folder) where an isolated build environment shows, else None: pip's pip-build-env-*
    (on sys.path, through the PYTHONPATH pip sets), python -m build's build-env-* venv, uv's builds-v*/."""
    for entry in [prefix, *path, *environ.get("PYTHONPATH", "").split(os.pathsep)]:
        for frontend, pattern in ISOLATED:
            if entry and any(re.fullmatch(pattern, part) for part in Path(entry).parts):
                return frontend, entry
    return None


def target_torch(environ):
    """The torch version installed in this interpreter outside pip's build environment, or None: pip runs
    the build with the Python it installs into, and hides that Python's site-packages."""
    env = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    code = "from importlib import metadata; print(metadata.version('torch'))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.abspath(os.sep),
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def pip_command():
    """The pip command running this build (its process's command line, on Linux) with
    --no-build-isolation added, or None."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        return None
    verbs = [i for i, arg in enumerate(args) if arg in ("install", "wheel")]
    if not verbs or not any(Path(arg).name.startswith("pip") for arg in args[:verbs[0]]):
        return None
    rest = [re.sub(r"://[^/@\s]+@", "://", arg) for arg in args[verbs[0] + 1:]]  # no credentials of a URL
    return shlex.join(["pip", args[verbs[0]], "--no-build-isolation", *rest])


def build_check(path=None, environ=None, prefix=None, has_torch=None, installed_torch=target_torch,
                command=pip_command):
    """("ok", "") where this Python can build attnstash; else ("isolated", message) in pip's isolated
    build environment (whether or not it has a torch of its own) or in another frontend's that has no
    torch, or ("no torch", message)."""
    path = sys.path if path is None else path
    environ = os.environ if environ is None else environ
    has_torch = importlib.util.find_spec("torch") is not None if has_torch is None else has_torch
    (supported, requirement) = supported_torch()
    found = isolation_sign(path, environ, sys.prefix if prefix is None else prefix)
    if found and (found[0] == "pip" or not has_torch):
        (frontend, folder) = found
        lines = [f"attnstash: {frontend} is building attnstash in an isolated build environment\n({folder}), "
                 "which does not have the torch you installed" + (" (it has a torch of its own)" if has_torch else "")
                 + ".\nBuild attnstash in your own environment instead, with --no-build-isolation:"]
        ran = command() if frontend == "pip" else None
        if ran:
            lines.append(f"    {ran}    (the command that ran, with the flag)")
        lines += [FIX, WHY]
        if frontend == "pip":
            target = installed_torch(environ)
            lines.append(f"{sys.executable} has torch {target}: these commands build against it." if target
                         else f"{sys.executable} has no torch either: install a supported one first (torch "
                         f"{supported}): pip install '{requirement}'")
        else:
            lines.append("(python -m build: add --no-isolation instead; uv: --no-build-isolation too.)")
        return "isolated", "\n".join(lines + [SETUPTOOLS])
    if not has_torch:
        return "no torch", (
            f"attnstash: torch is not installed in {sys.executable}.\nInstall a supported torch there first "
            f"(torch {supported}): pip install '{requirement}'\nthen build attnstash in that Python:\n"
            f"{FIX}\n{WHY}\n{SETUPTOOLS}")
    return "ok", ""


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("ATTNSTASH_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        tests = "ON" if os.environ.get("ATTNSTASH_BUILD_TESTS") == "1" else "OFF"
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DATTNSTASH_OUTPUT_DIR={out_dir}",
            f"-DATTNSTASH_BUILD_TESTS={tests}",
            "-DCMAKE_BUILD_TYPE=Release",
        ])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])


# ATTNSTASH_LAYERS's start-up line (attnstash/integrations/autostash.py) goes to the top of
# site-packages, where the interpreter reads .pth files; for an editable install `make build`
# puts it there.
PTH = "attnstash-autostash.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(ROOT / "attnstash" / "integrations" / PTH), os.path.join(self.build_lib, PTH))


# pip (setuptools.build_meta) and `python setup.py` run this file as __main__; the tests import it.
if __name__ == "__main__":
    (problem, message) = build_check()
    if problem != "ok":
        raise SystemExit(message)  # the message alone: no traceback, nothing built
    setup(ext_modules=[CMakeExtension("attnstash._C")], cmdclass={"build_ext": CMakeBuild, "build_py": BuildWithPth})
