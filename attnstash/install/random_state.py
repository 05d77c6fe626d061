"""The random numbers of a stashed layer's forward: its recompute must draw the ones its first
forward drew before each attention call, or the kept output is not the attention of the
recompute's query, key and value. The installer chooses each frame's check here; the native
frame makes it before each call (torch_ops/frames.cpp, check_random), the noted state going
with the call's record."""
import functools

import torch

from .. import ops
from ..errors import CheckpointingError


def first_check(preserves):
    """The check a first forward's frame makes (ops.RandomCheck), by whether its checkpoint is
    seen to restore the random state for the recompute (preserves_rng): where it is known to,
    nothing is checked; where it is known not to, a call made after a draw (the state differs
    from the forward's start: dropout before the projections, LoRA dropout) is refused at once;
    where it cannot be seen, such a call notes the state it was made in on its record, and the
    recompute must make that call in the same state: exactly the condition for having drawn the
    same numbers."""
    if preserves is True:
        return ops.RandomCheck.none
    return ops.RandomCheck.refuse if preserves is False else ops.RandomCheck.note


# The check a recompute's frame makes: each call whose record noted a state must be made in that
# state. Only for a layer whose first forwards noted one: its LayerStash.recompute_random is none
# until then, NOTED after (core.run_frame sets it as its native frame says it noted one).
NOTED = ops.RandomCheck.check


def refusal(name):
    """The error for a call whose random state the frame refused (ops.Failure.random_state)."""
    return CheckpointingError(
        f"attnstash: {name} draws random numbers before its attention (dropout, LoRA dropout, "
        "...) and its checkpoint does not restore the random state for the recompute "
        "(preserve_rng_state=False): the recompute's query, key and value would differ from the first forward's, "
        "and the kept output would not match them. Checkpoint with preserve_rng_state=True (the default), "
        "or do not stash this layer.")


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


