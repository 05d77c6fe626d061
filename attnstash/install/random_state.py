"""The random numbers of a stashed layer's forward: its recompute must draw the ones its first
forward drew before each attention call, or the kept output is not the attention of the
recompute's query, key and value."""
import functools

import torch

from .. import ops
from ..errors import CheckpointingError


class Rng:
    """The check that a recompute draws the random numbers its first forward drew before each
    attention call (dropout before the projections, LoRA dropout): else its query, key and value
    differ from the ones the kept output belongs to. Where the checkpoint is known to restore
    the random state for its recompute (preserve_rng_state=True, torch's default), nothing is
    checked. Where it is known not to (preserve_rng_state=False), a first forward that calls
    attention after a draw (the state differs from the forward's start) is refused at once.
    Where it cannot be seen, such a first forward notes the state the call was made in, and its
    recompute must make that call in the same state: exactly the condition for having drawn the
    same numbers. The noted state goes with the call's record (ops.note_rng), and the layer
    remembers that it noted one (LayerStash.rng_noted): only its recompute reads them back."""
    __slots__ = ("start", "refuse")

    def __init__(self, start, refuse=False):
        self.start, self.refuse = start, refuse

    @classmethod
    def first(cls, device, preserves):
        return cls(_rng_state(device), refuse=preserves is False)

    @classmethod
    def recompute(cls):
        """A recompute's check, for a layer whose first forwards noted a state (LayerStash.rng_noted:
        core.open_frame asks only then)."""
        return cls(None)

    def before_call(self, frame, slot, device):
        """A first forward's: the state to note for this call (None: nothing drawn since its
        start). A recompute's: checks the state against the one noted."""
        if frame.first:
            now = _rng_state(device)
            if torch.equal(now, self.start):
                return None
            if not self.refuse:
                return now
        else:
            want = ops.noted_rng(frame.anchor, slot)
            if want is None or torch.equal(_rng_state(device), want):
                return None
        raise CheckpointingError(
            f"attnstash: {frame.stash.name} draws random numbers before its attention (dropout, LoRA dropout, "
            "...) and its checkpoint does not restore the random state for the recompute "
            "(preserve_rng_state=False): the recompute's query, key and value would differ from the first forward's, "
            "and the kept output would not match them. Checkpoint with preserve_rng_state=True (the default), "
            "or do not stash this layer.")

    @staticmethod
    def note(stash, record, state):
        stash.rng_noted = True
        ops.note_rng(record, state)


def _rng_state(device):
    if device.type == "cpu":
        return torch.get_rng_state()
    return getattr(torch, device.type).get_rng_state(device)


def preserves_rng(checkpoint_function):
    """Whether a checkpoint function is seen to restore the random state for its recompute:
    torch.utils.checkpoint.checkpoint, or a functools.partial of it (how transformers and
    diffusers make theirs), with preserve_rng_state left True. False where it is seen not to;
    None where it cannot be seen."""
    fn, keywords = checkpoint_function, {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    if not keywords.get("preserve_rng_state", True):
        return False
    return True if fn is torch.utils.checkpoint.checkpoint else None


