"""python -m attnstash.info: the versions and build facts to put in a bug report."""
import platform
import sys
from importlib import metadata
from pathlib import Path


def collect() -> dict:
    import torch

    facts = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda (torch built with)": torch.version.cuda or "none",
        "cuda available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none",
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    from . import _library
    from .install import transformers_adapter
    (lo, hi) = _library.SUPPORTED_TORCH
    facts["torch supported"] = f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    for name in ("transformers", "diffusers", "peft", "accelerate", "deepspeed", "trl"):
        try:
            facts[name] = metadata.version(name)  # (not imported: some are slow to import, or print)
        except metadata.PackageNotFoundError:
            facts[name] = "not installed"
        if name == "transformers":
            (lo, hi) = transformers_adapter.SUPPORTED
            facts["transformers supported"] = f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"
    import attnstash
    facts["attnstash"] = attnstash.__version__
    facts["attnstash imported from"] = str(Path(attnstash.__file__).resolve().parent)
    facts["attnstash library"] = str(_library.library_path() or "not built")
    facts["attnstash built for torch"] = _library.built_for() or "not built"
    # Another installed copy (the one imported may be a source tree that shadows it): where, and its build.
    elsewhere = _library.installed_elsewhere()
    if elsewhere is not None:
        (folder, built) = elsewhere
        facts["attnstash installed at"] = f"{folder} ({f'built for torch {built}' if built else 'not built'})"
    try:
        _library.load()
        facts["ops registered"] = ", ".join(sorted(
            str(name) for name in torch._C._dispatch_get_all_op_names() if name.startswith("attnstash::")))
    except ImportError as e:
        facts["ops registered"] = f"none: {e}"
    return facts


def main() -> int:
    facts = collect()
    width = max(map(len, facts))
    for name, value in facts.items():
        print(f"{name:<{width}}  {value}")
    return 1 if str(facts["ops registered"]).startswith("none") else 0


if __name__ == "__main__":
    sys.exit(main())
