"""The installer: the attention stash on any model's checkpointed layers.

    layers = attnstash.install_attention_stash(model)        # every attention layer it finds
    ... train with activation checkpointing, reentrant or not ...
    attnstash.uninstall_attention_stash(model)

layers.py says which layers a model has, asking one adapter per kind of model:
transformers_adapter.py (Hugging Face transformers), diffusers_adapter.py (diffusers),
torch_adapter.py (torch's checkpoint_wrapper, and layers the user names), each reporting
found.py's Found. core.py holds the rules every stashed layer follows (its anchor, the phase of
each forward, its frame; torch_ops/frames.h how attention calls reach a frame), state.py what
they keep for the process and each thread, compiled.py a stashed layer under torch.compile,
random_state.py the random-number check, attaching.py what makes a layer stashed (and copies
of it), unread.py what runs checks of the diffusers reading; installer.py installs. Only
installer.py and the runtime modules need the compiled ops.
"""
import importlib

_EXPORTS = {"install_attention_stash": "installer", "uninstall_attention_stash": "installer",
            "layer_stash_stats": "installer", "find_layers": "layers", "attention_layers": "layers",
            "layer_count": "layers"}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'attnstash.install' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
