"""The start-up cost of ATTNSTASH_LAYERS's start-up line while the variable is unset:
`python -c "import torch, transformers"` with the line installed and without it (the .pth
file moved aside for those runs), interleaved, medians of --runs each.

    python tests/tools/startup_cost.py [--runs 20]
"""
import argparse
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PTH = Path(sysconfig.get_paths()["purelib"]) / "attnstash-autostash.pth"


def once():
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True,
                   env={"PATH": "/usr/bin:/bin"})
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    if not PTH.exists():
        raise SystemExit(f"{PTH} is not installed (make build, or pip install)")
    aside = PTH.with_name(PTH.name + ".aside")
    times = {"with": [], "without": []}
    once()  # warm the file cache
    try:
        for _ in range(runs):
            times["with"].append(once())
            PTH.rename(aside)
            try:
                times["without"].append(once())
            finally:
                aside.rename(PTH)
    finally:
        if aside.exists():
            aside.rename(PTH)
    w, wo = (statistics.median(times[k]) * 1000 for k in ("with", "without"))
    print(f"python -c 'import torch, transformers', ATTNSTASH_LAYERS unset, median of {runs} interleaved runs: "
          f"{w:.1f} ms with the start-up line, {wo:.1f} ms without it ({w - wo:+.1f} ms, {100 * (w - wo) / wo:+.2f}%)")


if __name__ == "__main__":
    main()
