"""attnstash: keep attention outputs for activation-checkpoint recomputes.

Under activation checkpointing (reentrant or not) every checkpointed layer runs its attention
forward twice: in the forward, and again in the recompute before its backward. attnstash
keeps the first forward's attention output and log-sum-exp, and the recompute reuses them;
the backward is the call PyTorch's own derivative makes, so loss and gradients equal the
normal recompute's.

    torch.ops.attnstash.sdpa_fwd_keep / sdpa_replay    the ops (attnstash.ops documents them)
    attnstash.install_attention_stash(model, ...)      the installer, for any model
    attnstash.AttentionStashCallback(...)              the same, for transformers.Trainer / TRL
    attnstash.plan(config_or_model, ...)               what the stash would keep, per layer
    attnstash.stash_stats(), stash_clear(), stash_set_max_bytes(...)   the stash itself
    attnstash.StashError and its kinds                 what it raises (attnstash.errors)
    attnstash.StashWarning                             what it says of a run that goes on

`import attnstash` registers the ops (it loads attnstash/_C); when they cannot load it warns
with the reason and the command that fixes it (not under `python -m attnstash.info` or
`attnstash.planner`, which need no ops), and every name that needs them raises that
ImportError. `python -m attnstash.info` prints the versions and the build in either case.
"""
import importlib
import sys
import warnings

from ._version import __version__
from .errors import (ArgumentError, CheckpointingError, InstallError, KeepError, PlanError, ReplayError,
                     StashError, StashWarning, UnsupportedVersionError)

def _own_command():
    """Whether this process is `python -m attnstash.info` or `python -m attnstash.planner`,
    which need no compiled ops and say what they find themselves (info prints this very reason)."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b in ("attnstash.info", "attnstash.planner") for a, b in zip(argv, argv[1:]))


try:
    from . import ops as _ops  # registers torch.ops.attnstash.* and their fake kernels
    _load_error = None
except ImportError as e:
    _ops, _load_error = None, e
    if not _own_command():
        warnings.warn(str(e), stacklevel=2)

# name -> the module that defines it; each is imported on first use.
_EXPORTS = {
    "sdpa_fwd_keep": "ops", "sdpa_replay": "ops", "stash_stats": "ops", "stash_stats_meanings": "ops",
    "stash_clear": "ops", "stash_reset_peak": "ops",
    "parse_bytes": "budget", "stash_set_max_bytes": "budget", "stash_max_bytes": "budget",
    "install_attention_stash": "install", "uninstall_attention_stash": "install",
    "layer_stash_stats": "install", "attention_layers": "install",
    "AttentionStashCallback": "integrations.trainer", "plan": "planner",
}
_WITHOUT_OPS = {"parse_bytes", "plan"}  # usable when the ops cannot load

__all__ = sorted(_EXPORTS) + ["__version__", "StashError", "ArgumentError", "InstallError", "UnsupportedVersionError",
                              "CheckpointingError", "KeepError", "ReplayError", "PlanError", "StashWarning"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'attnstash' has no attribute {name!r}")
    if _load_error is not None and name not in _WITHOUT_OPS:
        raise ImportError(str(_load_error)) from _load_error
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
