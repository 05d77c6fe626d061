"""The errors attnstash raises, by kind, so that users and tests can catch a kind.

Every one is a StashError (a RuntimeError); the installer's refusals and values attnstash
cannot read are also ValueErrors, and a version outside the supported range is also an
ImportError. The messages say what
was expected, what was found and what to do; README.md, "Fails instead of falling back",
lists the refusals of each kind. The compiled ops (torch.ops.attnstash.*) refuse through the
dispatcher, as a RuntimeError with the message; the installer raises those as KeepError or
ReplayError.
"""


class StashError(RuntimeError):
    """Any error of attnstash's."""


class StashWarning(UserWarning):
    """What attnstash says of a run that goes on, but not as the user set it up: torch.compile
    could not trace the checkpoint of a stashed layer, which runs eagerly (install/compiled.py)."""


class InstallError(StashError, ValueError):
    """install_attention_stash cannot serve this model, these layers or these arguments
    (nothing was installed), or uninstall_attention_stash cannot uninstall now (nothing was
    uninstalled)."""


class ArgumentError(StashError, ValueError):
    """A value attnstash cannot read: a byte count, a number of layers, a planner option."""


class PlanError(StashError):
    """attnstash.plan cannot run the model's shape-only forward (it computes something from
    values the planner does not have)."""


class UnsupportedVersionError(StashError, ImportError):
    """A torch, transformers or diffusers outside the range attnstash was checked on, or one
    that lacks what attnstash reaches."""


class CheckpointingError(StashError):
    """A stashed layer trains in a way the stash cannot replay: outside activation
    checkpointing, a reentrant checkpoint under saved-tensor hooks (offloading), random numbers
    the recompute does not reproduce, a recompute that calls attention more often than its
    first forward, a training forward that calls no attention, a layer input that nothing ties
    to its reentrant recompute (made inside the checkpoint, or needing no grad)."""


class KeepError(StashError):
    """An attention call the stash should keep but cannot: attention dropout, a mask that
    requires grad, a backend it cannot keep, inputs F.scaled_dot_product_attention refuses,
    nested tensors, two different forwards on one input."""


class ReplayError(StashError):
    """A recompute that cannot take its kept output: nothing kept for it (the stash was
    cleared, a backward through a forward whose graph an earlier backward freed, a first
    forward that ran before the install), or a call that differs from its first forward's."""
