"""A thin shim: CMake (CMakeLists.txt) knows the sources and builds attnstash/_C; the
package's metadata is pyproject.toml's.

    pip install --no-build-isolation -e .     # or without -e

Build against the torch already installed (never in an isolated environment, which
would fetch another torch). Environment: ATTNSTASH_BUILD_DIR (default build/cmake),
ATTNSTASH_BUILD_TESTS=1 to build the GoogleTest suites too, CMAKE_BUILD_PARALLEL_LEVEL.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


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


setup(ext_modules=[CMakeExtension("attnstash._C")], cmdclass={"build_ext": CMakeBuild, "build_py": BuildWithPth})
