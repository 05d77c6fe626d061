"""The stash in axolotl, from its YAML:

    plugins:
      - attnstash.integrations.axolotl.AttentionStashPlugin
    attnstash_layers: all        # or N: the last N attention layers
    attnstash_max_bytes: 8GiB    # optional: the budget

The plugin (axolotl's BasePlugin, whose get_input_args declares the two keys) adds
AttentionStashCallback to the trainer (add_callbacks_pre_trainer): the stash is installed at
train begin, after axolotl and the trainer enabled checkpointing (reentrant, axolotl's default,
or not) and after PEFT wrapping, and its figures reach the trainer's logs. axolotl's own
selective_checkpointing saving attention would hold each attention output a second time: with
both, the plugin refuses the config and says so.
"""
from typing import Optional, Union

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel

from attnstash.errors import ArgumentError


class AttentionStashArgs(BaseModel):
    """The plugin's YAML keys."""
    attnstash_layers: Optional[Union[int, str]] = "all"
    attnstash_max_bytes: Optional[Union[int, str]] = None


def _num_layers(value):
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ArgumentError(f"attnstash: attnstash_layers: {value!r} is not a number of layers: use \"all\" (every "
                        "attention layer) or a positive int (the last N attention layers).")


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


class AttentionStashPlugin(BasePlugin):
    """See the module's docstring."""

    def get_input_args(self):
        return "attnstash.integrations.axolotl.AttentionStashArgs"

    def register(self, cfg):
        from attnstash.budget import parse_bytes
        _num_layers(_get(cfg, "attnstash_layers", "all"))
        parse_bytes(_get(cfg, "attnstash_max_bytes"))
        selective = _get(cfg, "selective_checkpointing")
        if selective:
            save = _get(selective, "save", ["attention"]) if not isinstance(selective, bool) else ["attention"]
            if "attention" in (save or []):
                raise ArgumentError(
                    "attnstash: the config turns on both attnstash (plugins: attnstash...AttentionStashPlugin) and "
                    "axolotl's selective_checkpointing saving attention: both would hold each attention output for "
                    "the recompute, the second copy for nothing. Use one: remove selective_checkpointing (attnstash "
                    "also serves reentrant checkpointing), or the attnstash plugin.")

    def add_callbacks_pre_trainer(self, cfg, model):
        from attnstash.integrations.trainer import AttentionStashCallback
        return [AttentionStashCallback(_num_layers(_get(cfg, "attnstash_layers", "all")),
                                       max_bytes=_get(cfg, "attnstash_max_bytes"))]
