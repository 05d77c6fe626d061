"""Loads attnstash/_C, the compiled ops, and explains why when it cannot."""
import importlib
import importlib.machinery
import re
from pathlib import Path

import torch

REBUILD = "pip install --no-build-isolation -e .   (or `make build`, from the attnstash checkout)"
_HERE = Path(__file__).resolve().parent
_MARK = re.compile(rb"attnstash-built-for-torch:([^;\x00]+);")


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
