"""What the planner returns: per call, per layer, and for the model."""
import dataclasses
from typing import Dict, Optional, Tuple

import torch
from torch.nn.attention import SDPBackend

from ..budget import parse_bytes
from ..errors import ArgumentError


def budget_bytes(value):
    """A budget in bytes, as attnstash.parse_bytes reads it (None is not one)."""
    count = parse_bytes(value)
    if count is None:
        raise ArgumentError("attnstash.plan: a budget must be a byte count, got None.")
    return count


def held_bytes(sizes, offload=False):
    """The bytes one micro-batch holds on the device for records of these sizes: all of them, or
    with offload the two largest (the record in use and the one fetched for the next recompute;
    the rest wait in host memory)."""
    return sum(sorted(sizes)[-2:]) if offload else sum(sizes)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One F.scaled_dot_product_attention call of one micro-batch, and what the stash keeps for it.

    module: the class name of the innermost module that calls attention (else the layer's).
    query, key, value: shapes, [batch, heads, seq, head_dim], as F.sdpa receives them.
    mask: (shape, dtype name) of the attention mask F.sdpa receives, or None (is_causal).
    is_causal, enable_gqa, dropout_p: as passed to F.sdpa.
    backend: the SDPBackend F.sdpa would run (SDPBackend.ERROR: none can).
    why: how the backend was decided (asked torch, or the rules and what they found).
    output_bytes, logsumexp_bytes, extra_bytes: what the stash keeps, by part (0 if refused).
    refused: None, or why the stash would refuse this call (training would raise).
    """
    module: str
    query: Tuple[int, ...]
    key: Tuple[int, ...]
    value: Tuple[int, ...]
    mask: Optional[Tuple[Tuple[int, ...], str]]
    is_causal: bool
    enable_gqa: bool
    dropout_p: float
    backend: SDPBackend
    why: str
    output_bytes: int
    logsumexp_bytes: int
    extra_bytes: int
    refused: Optional[str]

    @property
    def bytes(self) -> int:
        return self.output_bytes + self.logsumexp_bytes + self.extra_bytes


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One attention layer (one the installer would stash).

    index: its index among the layers found (as install_attention_stash returns it).
    layer: the layer's class name.
    calls: its attention calls, in call order.
    bytes: what one micro-batch keeps for it (the sum over its calls), or None if refused.
    refused: None, or why the stash would refuse this layer.
    """
    index: int
    layer: str
    calls: Tuple[CallPlan, ...]
    refused: Optional[str]

    @property
    def bytes(self) -> Optional[int]:
        return None if self.refused else sum(c.bytes for c in self.calls)


@dataclasses.dataclass(frozen=True)
class StashPlan:
    """What the stash keeps for one micro-batch of this shape. str() prints the table that
    `python -m attnstash.planner` prints.

    model: the model's class (and model_type).  layers_found: how many layers the installer
        considers (find_layers), attention or not.
    inputs: the micro-batch, in words ("input_ids [4, 4096], unpadded", or the example inputs).
    dtype: the dtype attention runs in (None: as the example inputs give it).
    device: "cpu" or "cuda" (the device type planned for).
    decided_by: how the backends were decided: "torch on <device>", the rules of
        attnstash/planner/cuda_rules.py (no CUDA device here), or "backend=<name>".
    layers: one LayerPlan per attention layer, in order.
    max_bytes: the budget asked about, or None.
    offload: planned with records moved to host memory after the first forward and fetched back
        one layer ahead of the recompute (device_bytes, host_bytes; the budget counts the device's).
    """
    model: str
    layers_found: int
    inputs: str
    dtype: Optional[torch.dtype]
    device: str
    decided_by: str
    layers: Tuple[LayerPlan, ...]
    max_bytes: Optional[int] = None
    offload: bool = False

    @property
    def per_layer_bytes(self) -> Dict[int, Optional[int]]:
        """{layer index: bytes one micro-batch keeps (None: refused)}, as
        attnstash.layer_stash_stats(model) reports them after that micro-batch's forward."""
        return {layer.index: layer.bytes for layer in self.layers}

    @property
    def total_bytes(self) -> int:
        """The bytes one micro-batch keeps with every attention layer stashed (refused layers
        count 0)."""
        return sum(layer.bytes or 0 for layer in self.layers)

    @property
    def device_bytes(self) -> Optional[int]:
        """With offload, the bytes one micro-batch holds on the device with every attention layer
        stashed: the two largest layers' records (None without offload)."""
        sizes = [layer.bytes for layer in self.layers if layer.bytes is not None]
        return held_bytes(sizes, True) if self.offload else None

    def held_on_device(self, sizes) -> int:
        """What records of these sizes hold on the device for one micro-batch, by this plan
        (held_bytes)."""
        return held_bytes(sizes, self.offload)

    @property
    def host_bytes(self) -> Optional[int]:
        """With offload, the bytes one micro-batch holds in host memory with every attention layer
        stashed: all their records, total_bytes (None without offload)."""
        return self.total_bytes if self.offload else None

    @property
    def layers_that_fit(self) -> Optional[int]:
        """How many attention layers, counted from the last, the budget holds (None without a
        budget): install_attention_stash(model, num_layers=this, max_bytes=max_bytes)."""
        return None if self.max_bytes is None else self.layers_within(self.max_bytes)

    def layers_within(self, max_bytes) -> int:
        """The largest n whose last n attention layers keep at most `max_bytes` (an int or a
        string such as "8GiB", as attnstash.parse_bytes reads it) for one micro-batch, on the
        device with offload (held_bytes); a refused layer ends the count. (The last layers because
        the budget gives them the room: csrc/stash_registry.h, Budget.)"""
        budget = budget_bytes(max_bytes)
        kept = []
        for layer in reversed(self.layers):
            if layer.bytes is None or held_bytes(kept + [layer.bytes], self.offload) > budget:
                break
            kept.append(layer.bytes)
        return len(kept)

    def __str__(self):
        from .table import table
        return table(self)
