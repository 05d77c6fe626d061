"""attnstash's version, read from the one place it is written: pyproject.toml's [project]
table (through the installed package's metadata, or from the file in a source checkout)."""
from importlib import metadata
from pathlib import Path


def _read():
    try:
        return metadata.version("attnstash")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        import tomllib
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (ImportError, OSError, KeyError):
        return "unknown"


__version__ = _read()
