"""attnstash: keep attention outputs for reentrant activation-checkpoint recomputes.

Importing it loads the compiled ops torch.ops.attnstash.sdpa_fwd_keep and sdpa_replay.
"""
import sys

from . import _library

try:
    _C = _library.load()
except ImportError:
    # `python -m attnstash.info` must still run (and report why) when the ops cannot load.
    if sys.orig_argv[-2:] != ["-m", "attnstash.info"]:
        raise
    _C = None

__version__ = "0.1.0"

if _C is not None:
    from .huggingface import install_attention_stash, layer_stash_stats, uninstall_attention_stash  # noqa: E402
    from .ops import clear_stash, sdpa_fwd_keep, sdpa_replay, stash_stats  # noqa: E402

__all__ = ["sdpa_fwd_keep", "sdpa_replay", "stash_stats", "clear_stash", "install_attention_stash",
           "uninstall_attention_stash", "layer_stash_stats"]
