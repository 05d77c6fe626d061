"""The SDPA backends attnstash keeps, as Python sees them: one row each, keyed by torch's
own torch.nn.attention.SDPBackend. Each backend is one file in torch_ops/backends/, the one
statement of its forward and backward calls; this table is read from the compiled one
(torch.ops.attnstash.stash_kept_backends), and its forward and backward are those files'
calls, made through attnstash::_backend_forward and _backend_backward: on fake tensors for
the fake kernels that let torch.compile trace the ops, on meta tensors for the planner's kept
bytes and the refusals of a backend's own. Where the compiled ops cannot load, the planner
plans from attnstash/_unbuilt_backends.py's statement of the forwards (tests/python/
test_package.py checks it against these). Adding a backend: torch_ops/backends/README.md.
"""
import dataclasses
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend

from . import _library, _unbuilt_backends

_aten = torch.ops.aten
_ops = torch.ops.attnstash


@dataclasses.dataclass(frozen=True)
class KeptBackend:
    """One kept backend: its device type ("cpu", "cuda"), SDPBackend, PyTorch's name for it,
    and the aten op its forward calls (forward_op: what selective activation checkpointing
    saves; None where this torch has no such op)."""
    device: str
    backend: SDPBackend
    name: str
    forward_op_name: str
    unbuilt_call: Optional[Callable] = None  # without the compiled ops: its call (_unbuilt_backends.py)

    @property
    def forward_op(self):
        op = getattr(_aten, self.forward_op_name, None)
        return None if op is None else op.default

    def forward(self, query, key, value, attn_mask=None, is_causal=False, scale=None):
        """(output, logsumexp, extras) of the C++ backend's forward for these tensors (the
        caller's mask: a boolean one is made additive as F.sdpa makes it); `extras` are the
        further outputs its backward takes, in its order."""
        if self.unbuilt_call is not None:
            return _unbuilt_backends.forward(self.unbuilt_call, query, key, value, attn_mask, is_causal, scale)
        return _ops._backend_forward(query, key, value, attn_mask, is_causal, scale, self.device, int(self.backend))

    def backward(self, grad, query, key, value, attn_mask, output, logsumexp, extras, is_causal=False, scale=None):
        """(grad_query, grad_key, grad_value) of the C++ backend's backward, for their shapes."""
        return _ops._backend_backward(grad, query, key, value, attn_mask, output, logsumexp, list(extras), is_causal,
                                      scale, self.device, int(self.backend))

    def refuses(self, query, key, value, attn_mask=None, is_causal=False, scale=None) -> Optional[str]:
        """None, or why the C++ backend refuses such inputs (where F.sdpa pads or slices around
        the fused op, which the kept path cannot replay): its forward run on meta tensors, the
        first clause of its message (the planner gives its own advice)."""
        try:
            self.forward(*(_meta(t) for t in (query, key, value, attn_mask)), is_causal, scale)
        except RuntimeError as e:
            if not str(e).startswith("attnstash"):
                raise
            return str(e).removeprefix("attnstash: ").split(": ")[0]
        return None


def _rows():
    try:
        _library.load()  # the compiled table (attnstash/_C)
    except ImportError:  # no build, or a build for another torch: the planner plans without it
        return tuple(KeptBackend(*row[:4], unbuilt_call=row[4]) for row in _unbuilt_backends.ROWS)
    return tuple(KeptBackend(d, SDPBackend(int(b)), name, op)
                 for d, b, name, op in (row.split(":") for row in _ops.stash_kept_backends()))


KEPT_BACKENDS = _rows()


def _meta(t):
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def kept_backend(device, backend) -> Optional[KeptBackend]:
    """The row for this device type ("cpu", "cuda") and SDPBackend (or its int), or None."""
    for row in KEPT_BACKENDS:
        if row.device == torch.device(device).type and row.backend == SDPBackend(int(backend)):
            return row
    return None


def chosen_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False) -> SDPBackend:
    """The backend F.sdpa would run for this call (honouring sdpa_kernel(...) contexts)."""
    return SDPBackend(int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)))


def kept_bytes(row, query, key, value, attn_mask=None, is_causal=False, scale=None):
    """(output, logsumexp, extras) bytes the stash keeps for one call of this row's forward with
    tensors shaped like these (meta tensors will do: nothing is computed, and the device does not
    matter), counted as torch_ops/records.cpp counts them (numel * itemsize)."""
    out, lse, extras = row.forward(*(_meta(t) for t in (query, key, value, attn_mask)), is_causal, scale)

    def size(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    return size(out), size(lse), sum(size(t) for t in extras)


def kept_bytes_of_call(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """The bytes the stash keeps for one call on these tensors' device, for the backend F.sdpa
    would run there (the sum of kept_bytes), or None for a backend attnstash does not keep."""
    row = kept_backend(query.device, chosen_backend(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa))
    return None if row is None else sum(kept_bytes(row, query, key, value, attn_mask, is_causal, scale))
