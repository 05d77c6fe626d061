"""install_attention_stash and its undoing: the layers find_layers gives, stashed by core.py's
rules (see the package's docstring)."""
import gc

from .. import budget, ops
from ..errors import InstallError
from . import attaching, core, module_call, offload as offloading, state, transformers_adapter, unread
from .found import CHECKPOINT_FUNCTION
from .layers import find_layers, layer_count


def install_attention_stash(model, num_layers=None, *, layers=None, filter_fn=None, max_bytes=None,
                            offload=False):
    """Stash the attention of a model's last `num_layers` attention layers.

    Args:
        model: any torch.nn.Module trained with activation checkpointing, reentrant or not: a
            transformers model (attn_implementation="sdpa"; a PEFT wrapper of one will do), a
            diffusers model, a model whose layers torch's checkpoint_wrapper wraps, or any model
            with `layers=`.
        num_layers: how many attention layers to stash, counted from the last in the order of
            model.modules() (layers without attention, such as Mamba layers, are not counted);
            None: all. An int between 1 and the number of attention layers.
        layers: None to find the layers (README.md, "Turn it on"), or the checkpointed layers
            themselves: a module class (its instances) or an iterable of the model's modules.
        filter_fn: in place of layers=, a callable (module, fqn) -> bool: the modules of
            model.named_modules() it returns True for are the checkpointed layers (torchao's
            convention; fqn is the module's name in the model, "" for the model itself).
        max_bytes: a budget for as long as this install lasts (an int or a string such as
            "8GiB", attnstash.parse_bytes); its uninstall gives back the budget it replaced.
            None leaves the budget as it is. What a budget does: csrc/stash_registry.h, Budget.
        offload: True to move what the stash keeps to pinned host memory after each first
            forward and fetch it back ahead of its recompute (install/offload.py, Own): the
            device then holds about two layers' records. On a CPU it moves nothing. Without it,
            the user's offloading hooks around the checkpoints move them (offload.py, Hooks).

    Returns:
        The indices of the stashed layers among the layers found (find_layers).

    Raises:
        InstallError (a ValueError) for a model, layers or argument it cannot serve;
        UnsupportedVersionError for a transformers or diffusers outside the supported range. On
        any error nothing is installed.
    """
    if not isinstance(offload, bool):
        raise InstallError(f"attnstash: offload must be True or False, got {offload!r}.")
    count_wanted = layer_count(num_layers)
    limit = budget.parse_bytes(max_bytes)
    found = find_layers(model, layers, filter_fn)
    candidates = [(i, f) for i, f in enumerate(found) if f.stashable]
    if not candidates:
        raise InstallError(f"attnstash: none of the {len(found)} layers found in {type(model).__name__} is one to "
                           "stash: a checkpointed layer with a module whose class calls attention, as attnstash "
                           "reads the classes' code (install/found.py, calls_any). If a layer calls "
                           "F.scaled_dot_product_attention in a way that reading misses, name the layers with "
                           "layers= or filter_fn=.")
    count = len(candidates) if count_wanted is None else count_wanted
    if not 1 <= count <= len(candidates):
        raise InstallError(f"attnstash: num_layers must be between 1 and the {len(candidates)} attention layers of "
                           f"{type(model).__name__} (or None for all), got {num_layers}.")
    chosen = candidates[len(candidates) - count:]
    refusal = transformers_adapter.dropout_refusal(model, chosen)
    if refusal is not None:
        raise refusal
    for index, f in chosen:
        if core.stash_of(f.module) is not None:
            raise InstallError(f"attnstash: layer {index} ({f.name}) of {type(model).__name__} already has the "
                               "stash; call uninstall_attention_stash(model) before installing again.")
    with state.lock:
        done = []
        try:
            if any(f.reach is CHECKPOINT_FUNCTION for _, f in chosen):
                transformers_adapter.patch(core.stand_in)
            install = state.Install(offloading.Own() if offload else None)
            for index, f in chosen:
                attaching.attach(f.module, index,
                                 f"layer {index} ({f.name or 'the model'}, {type(f.module).__name__})", f.reach, install)
                done.append(f.module)
            if layers is None and filter_fn is None:  # found by reading: what runs checks it
                install.watches = unread.watch(model, found)
            if limit is not None:
                budget.push(install, limit)
                install.budget = True
            ops.stash_reset_peak()  # so that peak_bytes tells about the installed run
        except BaseException:
            for module in done:
                _detach(module)
            _unpatch_if_unused()
            raise
    return [index for index, _ in chosen]


def _detach(module):
    """Unstash one layer; where it was its install's last, the install's watches and budget end
    with it."""
    ended = attaching.detach(module)
    if ended is None:
        return
    unread.stop(ended.watches)
    if ended.budget:
        ended.budget = False
        budget.pop(ended)


def _unpatch_if_unused():
    """Once no stash is in use (models dropped without an uninstall are collected first),
    transformers' layer class is as it was."""
    if state.live:
        gc.collect()
    if not state.live:
        transformers_adapter.unpatch()


def _stashed(model):
    return [(m, core.stash_of(m)) for m in model.modules() if core.stash_of(m) is not None]


def uninstall_attention_stash(model, *, release=False):
    """Undo install_attention_stash for this model (or a deep copy of one): its layers are as
    they were, other models keep their installs, its budget ends (the one it replaced is back),
    and once no model has the stash transformers' layer class is as it was. What the
    model's forwards still hold is released with their graphs. `model` may be a part of the
    model: its layers are unstashed, and an install's budget ends with the last of its layers.

    Raises InstallError, and changes nothing, if the model has no stash, or while a
    non-reentrant forward through one of its layers whose checkpoint calls the module awaits
    its recompute (_awaiting_a_replay). `release`: True to release first everything the
    model's layers still hold, for forwards whose backward will never run (a step that
    raised), so that the uninstall goes through; a backward through one of them then fails."""
    with state.lock:
        stashed = _stashed(model)
        if not stashed:
            raise InstallError(f"attnstash: {type(model).__name__} has no attention stash installed.")
        if release:
            for _, stash in stashed:
                ops.release_slots(stash.slot_base, ops.SLOTS_PER_RANGE)
        waiting = _awaiting_a_replay(stashed)
        if waiting:
            gc.collect()  # (a graph that only a reference cycle holds, an exception's traceback, goes first)
            waiting = _awaiting_a_replay(stashed)
        if waiting:
            raise _still_awaited(model, *waiting)
        for module, _ in stashed:
            _detach(module)
        _unpatch_if_unused()


def _awaiting_a_replay(stashed):
    """The layers among `stashed` with non-reentrant first forwards, each in a frame of its own
    (the checkpoint calls the layer module: module_call.awaiting_a_replay), whose graph still
    lives, and how many such forwards, or None. Once unstashed, the layer would run attention in
    their recompute, and torch.utils.checkpoint would find other tensors saved than in their
    first forward. (A layer reached through its checkpoint function recomputes in its core.Run,
    which the checkpoint holds, stashed or not; a reentrant recompute saves nothing its first
    forward did. Not seen here: a layer compiled on its own inside the checkpoint, whose graph
    keeps under its class's slots: README.md, Limits.)"""
    names, forwards = [], 0
    for _, stash in stashed:
        waiting = module_call.awaiting_a_replay(stash)
        if waiting:
            names.append(stash.name)
            forwards += waiting
    return (names, forwards) if names else None


def _still_awaited(model, names, forwards):
    return InstallError(
        f"attnstash: cannot uninstall the stash of {type(model).__name__} yet: {', '.join(names)} ran "
        f"{forwards} first forward(s) in a non-reentrant checkpoint that calls the layer module, whose graph still "
        "lives (its backward has not run, or ran with retain_graph=True). That checkpoint saved what the stash's op "
        "saves and will recompute by calling the layer, which, unstashed, would run attention instead, so "
        "torch.utils.checkpoint would find other tensors saved than in the forward. Nothing was uninstalled. Run "
        "the backward through those forwards, or drop their graphs (del the loss and outputs), then uninstall; for "
        "forwards whose backward will never run (a step that raised, whose graph PyTorch may keep), "
        "uninstall_attention_stash(model, release=True).")


def layer_stash_stats(model):
    """{layer index: Held(records, bytes, declined)} held now for this model's stashed layers:
    records (kept or declined), bytes, and how many of those records the budget declined."""
    held = ops.held_by_slot()
    return {stash.index: core.held_by_layer(stash, held) for _, stash in _stashed(model)}
