"""Loads attnstash/_C, the compiled ops, and explains why when it cannot."""
import importlib
import importlib.machinery
import json
import re
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

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


def library_path(folder=None):
    """attnstash/_C's file for this Python in the package folder (default: the attnstash imported), or
    None if there is no build."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = (folder or _HERE) / f"_C{suffix}"
        if path.exists():
            return path
    return None


def _built_for(path):
    if path is None:
        return None
    found = _MARK.search(path.read_bytes())
    return found.group(1).decode() if found else "unknown"


def built_for():
    """The torch version attnstash/_C was built against (read from the file, without
    loading it), or None if there is no build."""
    return _built_for(library_path())


def _package_folder(dist):
    """The attnstash folder an installed distribution provides: from its file list (a regular install), or
    from direct_url.json (an editable install: the project folder it points to)."""
    try:
        for file in dist.files or ():
            if file.parts == ("attnstash", "__init__.py"):
                return Path(dist.locate_file(file)).resolve().parent
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except (OSError, ValueError, AttributeError):  # unreadable or odd metadata: no answer, not an error
        return None
    folder = Path(unquote(urlparse(url).path)) / "attnstash" if url.startswith("file://") else None
    return folder.resolve() if folder is not None and folder.is_dir() else None


def installed_elsewhere():
    """(folder, built for torch or None) of an installed attnstash other than the one imported, preferring
    one with a build; None if there is none. Python imports the source tree instead of the installed
    copy when started inside the checkout (the current directory leads sys.path)."""
    found = {}
    for dist in metadata.distributions(name="attnstash"):
        folder = _package_folder(dist)
        if folder is not None and folder != _HERE and folder not in found:
            found[folder] = _built_for(library_path(folder))
    return max(found.items(), key=lambda item: item[1] is not None, default=None)


def not_built_message():
    """Why attnstash/_C is missing here, and what to do, naming a working install elsewhere if one exists."""
    running = torch.__version__
    elsewhere = installed_elsewhere()
    if elsewhere is None or elsewhere[1] is None:
        return (f"attnstash: the compiled ops (attnstash/_C) are not built for this Python. Running torch {running}. "
                f"Build them against this torch with: {REBUILD}")
    what = "the source tree" if (_HERE.parent / "pyproject.toml").exists() else "the copy"
    return (f"attnstash: the compiled ops (attnstash/_C) are not built in the attnstash imported here: {what} at "
            f"{_HERE}, which has no build (it comes before site-packages on sys.path, as the current directory "
            f"does when Python starts inside the checkout). An installed attnstash is at {elsewhere[0]} (built for "
            f"torch {elsewhere[1]}; torch {running} is running): run from outside the checkout to use it, or build "
            f"in place with `make build` or `pip install --no-build-isolation -e .` in the checkout.")


def load():
    check_torch()
    built = built_for()
    running = torch.__version__
    if built is None:
        raise ImportError(not_built_message())
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
