"""The supported-model sweep: every model type of the installed transformers, built tiny with
SDPA under one head, trained with and without the stash (python tests/python/sweep_models.py).

    configs.py  tiny configs          models.py  model types, heads, the tiny model
    inputs.py   inputs and losses     run.py     the checks of one type
    pool.py     a process per type
    report.py   outcomes, the table, sweep.json and sweep.md, the CLI
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a type that needs a download fails at once: skipped

from .models import build, model_types  # noqa: E402
from .report import category, markdown  # noqa: E402
from .pool import sweep  # noqa: E402
from .run import check_arch  # noqa: E402

__all__ = ["build", "category", "check_arch", "markdown", "model_types", "sweep"]
