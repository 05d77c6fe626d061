"""Loads attnstash/_C, the compiled ops, and explains why when it cannot."""
import importlib
import importlib.machinery
import re
from pathlib import Path

import torch

REBUILD = "pip install --no-build-isolation -e .   (or `make build`, from the attnstash checkout)"
_HERE = Path(__file__).resolve().parent
_MARK = re.compile(rb"attnstash-built-for-torch:([^;\x00]+);")

# The torch releases attnstash supports, oldest and newest (major, minor): the private ATen
# ops it calls, and what F.sdpa does before them, were read for each release in this range
# (where they differ: torch_ops/backends/), and
# tests/torch_matrix.sh builds and runs the CPU suite on each (README.md, Build, lists the
# results, and any release it has not run on yet). Older releases are not declared because
# they were not verified. CMakeLists.txt reads this line too and refuses any other torch.
SUPPORTED_TORCH = ((2, 11), (2, 15))


def torch_release(version=None):
    """(major, minor) of a torch version string ("2.13.0+cpu", "2.16.0.dev20260101"), by
    default the running torch's."""
    found = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_torch(version=None):
    """Raises ImportError unless this torch (default: the running one) is in SUPPORTED_TORCH."""
    version = version or torch.__version__
    release = torch_release(version)
    (lo, hi) = SUPPORTED_TORCH
    if release is None or not lo <= release <= hi:
        raise ImportError(
            f"attnstash: torch {version} is not supported: attnstash supports torch {lo[0]}.{lo[1]} to "
            f"{hi[0]}.{hi[1]} (its ops call private ATen functions whose signatures, and what "
            f"F.scaled_dot_product_attention does before them, change between torch releases; each release in "
            f"that range was checked). Install a supported torch, e.g. pip install 'torch>={lo[0]}.{lo[1]},"
            f"<{hi[0]}.{hi[1] + 1}', and rebuild with: {REBUILD}")


def library_path():
    """attnstash/_C's file for this Python, or None if there is no build."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"_C{suffix}"
        if path.exists():
            return path
    return None


def built_for():
    """The torch version attnstash/_C was built against (read from the file, without
    loading it), or None if there is no build."""
    path = library_path()
    if path is None:
        return None
    found = _MARK.search(path.read_bytes())
    return found.group(1).decode() if found else "unknown"


def load():
    check_torch()
    built = built_for()
    running = torch.__version__
    if built is None:
        raise ImportError(
            f"attnstash: the compiled ops (attnstash/_C) are not built for this Python. Running torch {running}. "
            f"Build them against this torch with: {REBUILD}")
    if built != running:
        raise ImportError(
            f"attnstash: attnstash/_C was built for torch {built}, but torch {running} is running; "
            f"the ops must be compiled against the torch that loads them. Rebuild with: {REBUILD}")
    try:
        return importlib.import_module("attnstash._C")
    except ImportError as e:
        raise ImportError(
            f"attnstash: attnstash/_C (built for torch {built}) failed to load under torch {running}: {e}. "
            f"Rebuild with: {REBUILD}") from e
