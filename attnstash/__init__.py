"""attnstash: keep attention outputs for activation-checkpoint recomputes.

Under activation checkpointing (reentrant or not) every checkpointed decoder layer runs
its attention forward twice: in the forward, and again in the recompute before its
backward. attnstash keeps the first forward's attention output and log-sum-exp, and the
recompute reuses them; the backward is the call PyTorch's own derivative makes, so loss
and gradients equal the normal recompute's.

    torch.ops.attnstash.sdpa_fwd_keep / sdpa_replay    the ops (attnstash.ops documents them)
    attnstash.install_attention_stash(model, ...)      the Hugging Face installer
    attnstash.AttentionStashCallback(...)              the same, for transformers.Trainer / TRL
    attnstash.plan(config, batch_size, seq_len)        what the stash would keep, per layer
    attnstash.stash_stats(), stash_clear(), stash_set_max_bytes(...)   the stash itself

`import attnstash` loads nothing compiled: the first use of any of these names loads the
ops (attnstash/_C), and explains a missing or mismatched build. `python -m attnstash.info`
prints the versions and the build, also when the ops cannot load.
"""
import importlib

from ._version import __version__

# name -> the module that defines it; each is imported on first use.
_EXPORTS = {
    "sdpa_fwd_keep": "ops", "sdpa_replay": "ops", "stash_stats": "ops", "stash_stats_meanings": "ops",
    "stash_clear": "ops", "stash_reset_peak": "ops", "stash_set_max_bytes": "ops", "stash_max_bytes": "ops",
    "parse_bytes": "ops",
    "install_attention_stash": "huggingface", "uninstall_attention_stash": "huggingface",
    "layer_stash_stats": "huggingface", "attention_layers": "huggingface",
    "AttentionStashCallback": "trainer", "plan": "plan",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name == "_C":
        from . import _library
        value = _library.load()
    else:
        raise AttributeError(f"module 'attnstash' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
