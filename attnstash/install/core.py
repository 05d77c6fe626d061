"""The installer's rules, the same for every model. The adapters (transformers_adapter,
diffusers_adapter, torch_adapter) only find a model's layers; everything below holds for all.

Layer. A stashed layer is a module whose forward an activation checkpoint runs. Its
checkpointed forward is reached one of two ways (LayerStash.reach):
  - CHECKPOINT_FUNCTION: the model calls `checkpoint_function(fn, *args)` with the layer's
    forward as fn (transformers' `layer._gradient_checkpointing_func`); the stash stands in
    for that function (CheckpointCall), runs fn inside the checkpoint as a Run, and sees the
    call from outside too: its grad mode and its output's graph.
  - MODULE_CALL: the checkpoint calls the layer module itself (diffusers' blocks, torch's
    checkpoint_wrapper, `torch.utils.checkpoint.checkpoint(block, x)` in a model's forward):
    the layer's forward runs inside the checkpoint, and the stash wraps it (stashed_forward).
Either way every stashed layer's `forward` attribute is stashed_forward, which runs each of its
forwards in a frame (where no Run does) and refuses a training forward outside any checkpoint.
While torch.compile traces a stashed layer, none of this runs: compiled.py says what does.
(A transformers layer that another checkpoint wraps, torch's checkpoint_wrapper as FSDP recipes
apply it, is reached as a MODULE_CALL: its own gradient_checkpointing is off.)

Anchor. What ties a recompute to its first forward (torch_ops/schemas.cpp): for a
CHECKPOINT_FUNCTION layer, a token its Run holds for the checkpoint call (so that offloading,
which hands the recompute a copy of the layer input, cannot break the tie); for a MODULE_CALL
layer, the forward's first tensor argument (positional first, then keyword), which the
recompute is handed again (a reentrant checkpoint passes a detached alias of it), or, under
saved-tensor hooks, which may hand it a copy, a token module_call.py keeps for the forward.

Phase, frame and slots. Each forward of a stashed layer runs in a frame on its thread's
stack, opened by the phase the forward starts in (ops.frame_phase: the rule and its cases are
torch_ops/keep_replay.h's FramePhase). The native frame decides by it whether the forward's calls
keep and what it owns (torch_ops/frames.h); run_frame, what it checks and refuses; the ops
decide each call's phase again from what they see. Inside the native frame, which run_frame
opens around the forward, its attention calls, by whatever name, go to the ops at the layer's
slots; random_state.py says what the frame checks of the random state before each call.

What a stashed layer carries in its __dict__, and how copies of it are made: attaching.py.
"""
import functools
import sys

import torch

from .. import ops
from ..ops import FramePhase, RandomCheck
from . import compiled, dropout, module_call, offload, random_state, state
from ..errors import CheckpointingError, KeepError, ReplayError
from .found import ATTR, CHECKPOINT_FUNCTION
from .random_state import preserves_rng

class LayerStash:
    """One stashed layer: its index and name (for messages), how its checkpointed forward is
    reached, its class's forward, its slots, and the attention calls of its last first forward that kept (None
    before one; attention_layers prints it)."""
    __slots__ = ("index", "name", "reach", "slot_base", "calls", "forward", "kind", "pending", "install",
                 "recompute_random", "checkpoint_call", "unseen", "__weakref__")

    def __init__(self, index, name, reach, install, forward=None, kind=""):
        self.index, self.name, self.reach, self.calls, self.kind = index, name, reach, None, kind  # kind: class name
        self.pending = []  # MODULE_CALL first forwards awaiting their recompute under a token (module_call.py)
        self.install = install  # the state.Install it belongs to (its offload among what it holds)
        install.layers += 1
        self.recompute_random = ops.RandomCheck.none  # what its recomputes check of the random state (random_state.py)
        self.forward = forward  # the layer class's forward function (what torch.compile traces: compiled.py)
        self.checkpoint_call = None  # its CheckpointCall, for the checkpoint function it last read (stand_in)
        self.unseen = False  # a training forward with grad off ran outside its Run (_eager_forward)
        self.slot_base = ops.new_slot_base()
        state.live.add(self)

    def slots(self):
        return range(self.slot_base, self.slot_base + ops.SLOTS_PER_RANGE)


def stash_of(layer):
    return layer.__dict__.get(ATTR)


# ---- frames ------------------------------------------------------------------------------------

# FramePhase and RandomCheck values as plain ints, read on the hot path (a global, where the enum
# class's attribute is a lookup through its metaclass).
_RECOMPUTE = int(FramePhase.recompute)
_RECOMPUTE_WITHOUT_GRAD = int(FramePhase.recompute_without_grad)
_REENTRANT_FIRST_HOOKED = int(FramePhase.reentrant_first_hooked)
_NON_REENTRANT_FIRST = int(FramePhase.non_reentrant_first)
_OUTSIDE_CHECKPOINT = int(FramePhase.outside_checkpoint)
_RANDOM_NONE = RandomCheck.none
_UNSEEN = random_state.first_check(None)  # a first forward's check where its checkpoint cannot be seen


def run_frame(stash, fn, args, kwargs, phase, anchor=None, limit=None, random=_UNSEEN, token=None):
    """fn(*args, **kwargs) as one forward of a stashed layer, in the native frame of the phase it
    starts in (`phase`: ops.frame_phase's), open around it on this thread (ops.frame_run;
    torch_ops/frames.h: it decides by the phase whether the forward's calls keep, and owns what an
    interrupted reentrant first forward kept; ops.frame_is_open finds it). Returns (fn's output,
    the attention calls it made, whether they kept, what offload.py moved off the device after a
    first forward or None).
    One function, not an open and a run: each Python call on this path is paid cold inside a
    training step.
    `limit`: for a recompute, how many attention calls its first forward made; `random`: for a
    first forward, the random check (random_state.first_check of its checkpoint function; where
    that cannot be seen, the default). `token`: what the ops anchor on in place of the layer input
    `anchor`, where a Run holds one (Run.token). With a token, `anchor` is read only by a first
    forward whose `random` is not none (the random state's device) or whose layer has its own
    offload (offload.mover_for), and may be None otherwise (Run.__call__ reads it only then)."""
    if phase <= _RECOMPUTE_WITHOUT_GRAD:  # a recompute: it makes the calls its first forward made
        first, mover, random = False, None, stash.recompute_random
    else:
        if phase == _OUTSIDE_CHECKPOINT:
            raise CheckpointingError(
                f"attnstash: {stash.name} is stashed, but its training forward runs outside any activation "
                "checkpoint (grad mode on, outside backward, no checkpoint's saved-tensor hooks), so there is no "
                "recompute to save and the stash could only cost memory. Checkpoint this layer (reentrant or not), "
                "or do not stash it.")
        if phase == _REENTRANT_FIRST_HOOKED and token is None and anchor.requires_grad:
            raise CheckpointingError(
                f"attnstash: {stash.name} runs a reentrant checkpoint under saved-tensor hooks (offloaded "
                "checkpointing: torch.autograd.graph.save_on_cpu, or an offloading context), and its input is a "
                "leaf tensor that requires grad (no op before the checkpoint): the hooks may give the recompute a "
                "copy of it, and with no node before the checkpoint nothing can tie the recompute to its first "
                "forward for as long as the graph lives. Feed the layer the output of an op (e.g. the embedding's), "
                "use non-reentrant checkpointing, turn offloading off for it, or do not stash it.")
        first = True
        mover = offload.mover_for(stash, anchor, phase == _NON_REENTRANT_FIRST) \
            if token is not None and offload.may_move(stash, phase) else None
    # The ops anchor on the token where one is held, else on the layer input.
    try:
        out, calls, keep, kept, noted = ops.frame_run(fn, args, kwargs, anchor if token is None else token,
                                                      stash.slot_base, -1 if limit is None else limit, phase,
                                                      mover is not None, random, anchor)
    except BaseException as error:
        # (an interrupted forward, an error or Ctrl-C: the native frame released what it owns)
        noted, failure = ops.frame_interrupted()
        if noted:
            stash.recompute_random = random_state.NOTED
        if failure is not None:
            raise frame_error(stash, first, limit, *failure, error) \
                from (error if failure[0] == ops.Failure.op else None)
        raise
    if noted:
        stash.recompute_random = random_state.NOTED
    if first and keep:  # a first forward that keeps must have called attention
        stash.calls = calls
        if calls == 0 and not compiled.calls_the_ops(stash.kind):
            raise compiled.no_attention(stash)
    return out, calls, keep, (offload.move_out(mover, kept) if mover is not None and kept else None)


def frame_error(stash, first, limit, why, message, dropout_p, error):
    """The installer's error for a call the native frame of a forward of `stash` (a `first` one, or
    a recompute whose first forward made `limit` calls) refused (torch_ops/frames.h, Failure),
    `error` the one that call raised."""
    name = stash.name
    if why == ops.Failure.op:
        holder = dropout.holder(dropout_p, error.__traceback__) if dropout_p else ""
        return (KeepError if first else ReplayError)(f"attnstash: {name}: {message}{holder}")
    if why == ops.Failure.limit:
        return CheckpointingError(
            f"attnstash: {name}: its recompute calls attention more often than its first forward did "
            f"({limit} times): the recompute does not repeat the first forward, so the kept outputs cannot "
            "stand in for its attention. Do not stash this layer.")
    return random_state.refusal(name)


# ---- how a stashed layer's forwards get their frames ---------------------------------------------

PREVIOUS = "_attnstash_forward"  # a stashed layer's forward set on it before the install, if one was


def stashed_forward(layer, *args, **kwargs):
    """A stashed layer's `forward`, bound to the layer in its __dict__ (so that it runs wherever
    the layer's module call runs, inside its checkpoint or outside). It calls the forward the
    layer had: the one set on the layer before the install (accelerate's hooks set one), else its
    class's, looked up at each call (FSDP2 swaps the class). One function bound to each layer,
    not an object per layer: torch.compile then compiles a model's layers as one code (an
    object per layer would be a guard per layer, and a recompile of each)."""
    previous = layer.__dict__.get(PREVIOUS)
    if torch.compiler.is_compiling():  # traced: compiled.py
        return compiled.layer_forward(layer, previous, args, kwargs, in_frame)
    forward = previous if previous is not None else type(layer).forward.__get__(layer)
    if state.dynamo_callback() is None:  # plain eager: nothing for torch.compiler.disable to turn off
        return _eager_forward(layer, forward, args, kwargs)
    return _eager_forward_undynamoed(layer, forward, args, kwargs)


def _eager_forward(layer, forward, args, kwargs):
    stash = layer.__dict__.get(ATTR)
    if stash is None or ops.frame_is_open(stash.slot_base):  # not stashed, or inside its Run, which has the frame
        return forward(*args, **kwargs)
    phase = ops.frame_phase(-1)  # (the call outside its checkpoint is not seen here)
    if stash.reach is CHECKPOINT_FUNCTION and layer.training:
        if getattr(layer, "gradient_checkpointing", False):
            # Its frames come from its Run, which a training forward must reach. A reentrant
            # first forward runs without grad, where this cannot be told from a no-grad forward;
            # its recompute, which runs in backward with grad and without a Run, can.
            if phase == _RECOMPUTE:
                if _ran_before_the_install(stash):
                    return forward(*args, **kwargs)
                raise _unreached(stash, layer, recompute=True)
            if phase != _NON_REENTRANT_FIRST and phase != _OUTSIDE_CHECKPOINT:  # grad off
                stash.unseen = True
                return forward(*args, **kwargs)
            reached = state.thread.reached
            before = reached.get(stash.slot_base, 0)
            out = forward(*args, **kwargs)
            if reached.get(stash.slot_base, 0) == before:
                raise _unreached(stash, layer, recompute=False)
            return out
        if phase == _OUTSIDE_CHECKPOINT:
            raise compiled.checkpointing_off(stash)
    # Eval and generation: untouched; a recompute follows its first forward, whatever the
    # training flag says by then.
    if not layer.training and phase > _RECOMPUTE_WITHOUT_GRAD:
        return forward(*args, **kwargs)
    return in_frame(stash, forward, args, kwargs, phase)


def in_frame(stash, forward, args, kwargs, phase=None):
    """One forward of a stashed layer in a frame whose anchor is its input (Anchor, above): a
    MODULE_CALL layer's, and a CHECKPOINT_FUNCTION layer's whose checkpoint torch.compile could
    not trace and ran eagerly (compiled._selective). `phase`: ops.frame_phase(-1), where read."""
    if phase is None:
        phase = ops.frame_phase(-1)
    anchor = state.anchor_of(stash, args, kwargs)
    entry = module_call.pending_for(stash, anchor, phase)
    if entry is None and phase == _RECOMPUTE:
        if _ran_before_the_install(stash):
            return forward(*args, **kwargs)
        module_call.refuse_an_untied_recompute(stash, anchor)
    out, _, _, moved = run_frame(stash, forward, args, kwargs, phase, anchor, token=entry and entry.token)
    if moved is not None:
        entry.moved = moved  # (a first forward: its entry holds what offload.py moved)
    return out


def _ran_before_the_install(stash):
    """Whether a recompute that no Run or pending first forward ties to one of this layer's
    first forwards repeats a forward that ran before the install: no forward of the layer has
    kept since (stash.calls), nor run with grad off outside its Run (stash.unseen: a reentrant
    first forward that did not reach its checkpoint function looks so). It then runs as without
    the stash, as that forward did."""
    return stash.calls is None and not stash.unseen


# Where a torch.compile'd caller runs a stashed layer eagerly (a graph break, a skipped frame),
# dynamo's frame callback is set: the eager forward then runs with it turned off, as compile
# must not trace the stash's bookkeeping.
_eager_forward_undynamoed = torch.compiler.disable(_eager_forward)


def _unreached(stash, layer, recompute):
    """A forward of a layer that its own checkpoint function checkpoints, seen from outside that
    function (no Run of it is active), that did not reach it (_eager_forward): its recompute, or
    its training forward."""
    what = "its recompute ran" if recompute else "its training forward ran"
    before = (", or this recompute's first forward ran before install_attention_stash and a forward without grad "
              "ran since (install between steps)") if recompute else ""
    return CheckpointingError(
        f"attnstash: {stash.name}: {what} with gradient_checkpointing on, but without calling its checkpoint "
        f"function ({type(layer).__name__}._gradient_checkpointing_func), which is where attnstash reaches the "
        "checkpointed forward; nothing was kept. The library that checkpoints it "
        f"({_library_of(layer)}) checkpoints its layers another way than the releases attnstash supports "
        f"(README.md, Compatibility){before}.")


def _library_of(layer):
    top = type(layer).__module__.split(".")[0]
    version = getattr(sys.modules.get(top), "__version__", None)
    return f"{top} {version}" if version else top


def stand_in(layer, checkpoint):
    """What a layer reads as its checkpoint function (transformers_adapter.patch): a
    CheckpointCall for a stashed layer, the function itself for any other."""
    stash = layer.__dict__.get(ATTR)
    if stash is None:
        return checkpoint
    if torch.compiler.is_compiling():  # traced (compiled.py): dynamo follows a new one, not one kept from eager
        return CheckpointCall(stash, checkpoint, True)
    call = stash.checkpoint_call
    if call is None or call.checkpoint is not checkpoint:  # in eager, one per layer and checkpoint function
        call = stash.checkpoint_call = CheckpointCall(stash, checkpoint, False)
    return call


class CheckpointCall:
    """Stands in for a CHECKPOINT_FUNCTION layer's checkpoint function: calls it with a Run of
    the layer's forward, from outside the checkpoint, where the grad mode of the call and the
    graph of its output can be seen. `random`: what its Runs' first forwards check of the random
    state (random_state.first_check of preserves_rng of the function). `traced`: made
    while torch.compile traces (stand_in), where it is called in the same trace (a layer reads
    its checkpoint function as it calls it)."""
    __slots__ = ("stash", "checkpoint", "random", "traced")

    def __init__(self, stash, checkpoint, traced):
        self.stash, self.checkpoint, self.traced = stash, checkpoint, traced
        self.random = random_state.first_check(preserves_rng(checkpoint))

    def __call__(self, fn, *args, **kwargs):
        if self.traced:  # compiled.py
            return compiled.checkpoint_call(self.stash, self.checkpoint, fn, args, kwargs, in_frame)
        # Whether a backward can reach the checkpoint, as seen from outside it (Run.outer_grad,
        # ops.frame_phase): grad mode is on and one of its tensor arguments requires grad. A reentrant
        # checkpoint gives its output a node only then: one whose inputs need no grad (a frozen model
        # part fed by frozen embeddings, a patcher run for its outputs) is never recomputed, and its
        # first forward keeps nothing.
        outer_grad = False
        if torch.is_grad_enabled():
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    outer_grad = True
                    break
        run = _new_run(Run, fn)  # (Run has no __new__ or __init__ of its own: a Python call less per checkpoint call)
        run.stash, run.fn, run.outer_grad, run.random = self.stash, fn, outer_grad, self.random
        run.kept_calls, run.token, run.moved = None, ops.NEW_TOKEN(), None
        return self.checkpoint(run, *args, **kwargs)


_new_run = functools.partial.__new__


class Run(functools.partial):
    """A stashed layer's forward as its checkpoint runs it: once in the forward, once in the
    recompute; both in a frame, and the recompute replays exactly the calls its first forward
    kept. A functools.partial of that forward (the same func, args and keywords), so that a
    checkpoint function that looks into what it is given finds the layer as it would without
    the stash (LLaMA-Factory's: `func.func.__self__` when `isinstance(func, partial)`). Whatever
    holds it for the recompute (the checkpoint's graph) holds its token, and so what its first
    forward kept: a graph dropped without a backward releases it."""
    # Made by CheckpointCall alone: `fn`, the forward; `outer_grad`, whether a backward can reach
    # the checkpoint from outside (CheckpointCall.__call__); `random`, its first forward's random
    # check (CheckpointCall.random); `kept_calls`, the attention calls the first forward kept (None
    # before it, 0: it kept nothing); `token`, what the ops anchor on (Anchor, above:
    # ops.new_token); `moved`, what offload.py moved off the device after the first forward.
    __slots__ = ("stash", "fn", "outer_grad", "random", "kept_calls", "token", "moved")

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        stash = self.stash
        phase = ops.frame_phase(self.outer_grad)
        if phase <= _RECOMPUTE_WITHOUT_GRAD:
            if self.moved is not None:
                self.moved.fetch()
            limit = self.kept_calls if self.kept_calls is not None else 0
            return run_frame(stash, self.fn, args, kwargs, phase, limit=limit, token=self.token)[0]
        reached = state.thread.reached
        reached[stash.slot_base] = reached.get(stash.slot_base, 0) + 1
        # The layer input, only where the first forward reads it (run_frame says when); the ops anchor on the token.
        anchor = state.anchor_of(stash, args, kwargs, getattr(self.fn, "keywords", None)) \
            if self.random is not _RANDOM_NONE or stash.install.offload is not None else None
        out, calls, keep, self.moved = run_frame(stash, self.fn, args, kwargs, phase, anchor, random=self.random,
                                                 token=self.token)
        self.kept_calls = calls if keep else 0
        return out


def held_by_layer(stash, held):
    """(records, bytes, declined) held for one layer, from ops.held_by_slot()."""
    slots = stash.slots()
    rows = [h for slot, h in held.items() if slot in slots]
    return ops.Held(*(sum(column) for column in zip(*rows))) if rows else ops.Held(0, 0, 0)
