"""The supported-model sweep's command line (the sweep itself: the package sweep/ beside this).

    python tests/python/sweep_models.py [--archs bert,llama,...] [--out out/sweep] [--jobs N]

Every model type of the installed transformers, built tiny with SDPA under one head, trained
with and without the stash; writes sweep.json and sweep.md under --out. Exits 1 if a row
FAILED.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
