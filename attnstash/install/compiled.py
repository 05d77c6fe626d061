"""A stashed layer while torch.compile traces it.

Where dynamo traces an activation checkpoint (a whole model compiled, checkpoint calls inside
it; a checkpoint-wrapped block compiled, as torchtitan does), the checkpoint becomes part of
the compiled graph and compile's partitioner decides what the backward recomputes: the
stash's eager frames, which keep and replay at run time, have nothing to act on there. So a
stashed layer traced by dynamo runs its forward inside a selective activation checkpoint
whose policy saves the fused attention forward ops (backends.KEPT_BACKENDS, forward_op) and
lets everything else be recomputed, as the stash does in eager: the compiled backward reuses
the saved attention output and log-sum-exp instead of running attention again, and the graph
keeps every op it compiles without the stash. The layer choice (num_layers, layers=) is the
install's; what differs from eager (README.md, "Under torch.compile"):
  - the compiled graph holds the saved outputs as autograd does, so stash_stats() counts no
    keeps or replays for them (saved_calls() counts what the compiled graphs save);
  - a budget cannot demote inside a compiled graph: with one in force, tracing a stashed
    layer raises CheckpointingError, and num_layers (planned with attnstash.plan) sizes it;
  - a call PyTorch runs on its math backend is decomposed before the policy sees it, so it
    is recomputed as without the stash (eager refuses it).
Where dynamo cannot trace such a checkpoint (a graph break inside it), torch.utils.checkpoint
runs it eagerly with dynamo off: the layer's forward then runs in an eager frame, and the
stash says once that compile gave up on it (_selective, _fell_back).
A layer compiled on its own inside a checkpoint that runs eagerly (torch.compile(block) inside
checkpoint(...), diffusers' compile_repeated_blocks) is different: that checkpoint reruns the
whole compiled layer, so no policy inside the graph can spare its attention. There the layer's
attention calls are traced as attnstash::_sdpa_compiled on the layer's input (the op decides as
the graph runs, by torch_ops/keep_replay.h's compiled_phase_of, whether it keeps, takes or just
attends), and the registry keeps and replays as in eager (_eager_checkpoint_forward). Its
slots are its class's, not its own, so that the layers of a class share their compiled code;
its recompute's random state is not checked (random_state.py cannot run inside a graph: the
checkpoint's preserve_rng_state restores it); what a forward dropped without a backward kept
goes when its layer input is freed (no node of ours owns it).
"""
import functools
import sys
import threading
import warnings

import torch
import torch._guards
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import backends, ops
from ..ops import FramePhase
from ..errors import CheckpointingError, StashWarning
from . import state
from .found import ATTR, CHECKPOINT_FUNCTION

KEPT_OPS = frozenset(row.forward_op for row in backends.KEPT_BACKENDS if row.forward_op is not None)
_saved = [0]  # attention forwards the compiled graphs traced so far save (a count of traced calls)


def saved_calls():
    """How many attention calls of stashed layers the graphs compiled so far save (counted
    when compile traces them, not per step): the stash at work where stash_stats() counts
    nothing."""
    return _saved[0]


def _policy(ctx, op, *args, **kwargs):
    """Runs while compile traces a stashed layer's region (not at run time): save the fused
    attention forward, recompute the rest. One policy for every layer, so that the layers of a
    model share their compiled code (a per-layer constant would make dynamo recompile each)."""
    if op not in KEPT_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        from ..budget import stash_max_bytes
        limit = stash_max_bytes()
        if limit is not None:
            raise CheckpointingError(
                f"attnstash: torch.compile traces a stashed layer with a budget in force ({limit:,} bytes): a budget "
                "cannot demote or decline inside a compiled graph, which saves the attention output of every "
                "stashed layer it traces. Size the stash by the number of layers instead: no max_bytes (and no "
                "ATTNSTASH_MAX_BYTES), and num_layers set to what attnstash.plan(...) says fits.")
        _saved[0] += 1
    return CheckpointPolicy.MUST_SAVE


CONTEXT = functools.partial(create_selective_checkpoint_contexts, _policy)
"""The context_fn of every stashed layer's selective checkpoint under torch.compile."""


def _selective(stash, fn, in_frame):
    """A stashed layer's forward `fn` run inside a selective checkpoint that saves its attention
    (CONTEXT), nested inside the checkpoint that runs it: the inner region's policy decides for
    the ops it holds. Where dynamo cannot trace that checkpoint (a graph break inside the layer:
    a side effect such as the forward wrappers of the `kernels` package, which transformers 5.25
    requires), the checkpoint runs eagerly with dynamo off (torch.utils.checkpoint's own
    fallback), and calls this eagerly too: fn then runs in an eager frame, in_frame(stash, fn,
    args, kwargs) (core.in_frame), which keeps and replays as for a layer that is not compiled."""
    def run(*args, **kwargs):
        if not torch.compiler.is_compiling():
            _fell_back(stash)
            return in_frame(stash, fn, args, kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=CONTEXT, **kwargs)
    return run


def _fell_back(stash):
    """Says, once per install, that torch.compile gave up on a stashed layer's checkpoint."""
    if stash.install.compile_fell_back:
        return
    stash.install.compile_fell_back = True
    warnings.warn(
        f"attnstash: torch.compile traced the activation checkpoint of {stash.name} but could not compile it: a graph "
        "break inside the checkpointed forward (TORCH_LOGS=graph_breaks shows where) makes torch.utils.checkpoint run "
        "the layer eagerly, with dynamo off. attnstash keeps and replays its attention eagerly there, so its "
        "recompute still runs no attention forward, but the layer is not compiled. Where the break is the forward "
        "wrapper of the `kernels` package (a side effect inside the checkpoint; transformers 5.25 requires that "
        "package), torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True lets dynamo compile "
        "the checkpoint. (Said once per install.)", StashWarning, stacklevel=2)


def layer_forward(layer, previous, args, kwargs, in_frame):
    """A stashed layer's forward as dynamo traces it (core.stashed_forward under torch.compile;
    `previous`: the forward set on the layer before the install, or None):
    a MODULE_CALL layer's, which its checkpoint calls, runs in the selective checkpoint; a
    CHECKPOINT_FUNCTION layer's gets it from its checkpoint function (checkpoint_call), which may
    run inside this forward (transformers 5.23 and later) or around it (before); a layer
    compiled inside an eager checkpoint routes its attention to the ops (_eager_checkpoint_forward).
    `in_frame`: core.in_frame, for _selective."""
    stash = layer.__dict__.get(ATTR)
    # The forward the layer had: one set on it before the install, else its class's (read from
    # the stash: dynamo cannot call a method looked up on some classes, those diffusers lets
    # into graphs).
    if stash is None:  # uninstalled, with a forward set over this one since (which passes through)
        return (previous or type(layer).forward.__get__(layer))(*args, **kwargs)
    forward = previous if previous is not None else functools.partial(stash.forward, layer)
    if not layer.training:
        return forward(*args, **kwargs)  # eval, generation: untouched
    if not torch.is_grad_enabled():
        # A reentrant checkpoint's first forward (its input requires grad; dynamo guards on
        # that), or a forward under no_grad: plain.
        anchor = state.anchor_of(stash, args, kwargs)
        if anchor.requires_grad:
            return _eager_checkpoint_forward(layer, forward, args, kwargs, anchor)
        return forward(*args, **kwargs)
    if _inside_eager_checkpoint():  # the layer compiled, its checkpoint not
        return _eager_checkpoint_forward(layer, forward, args, kwargs, state.anchor_of(stash, args, kwargs))
    if stash.reach is not CHECKPOINT_FUNCTION:
        return _selective(stash, forward, in_frame)(*args, **kwargs)
    if not getattr(layer, "gradient_checkpointing", False):
        raise checkpointing_off(stash)
    return forward(*args, **kwargs)


def no_attention(stash):
    """The refusal of a stashed layer whose training forward called no attention (eager,
    core.run_frame, and traced alike)."""
    return CheckpointingError(
        f"attnstash: {stash.name} is stashed, but its training forward called no "
        "F.scaled_dot_product_attention, so nothing was kept and the stash would save nothing. Its attention "
        "runs another implementation (eager, flash_attention_2, flex attention, a kernel of its own: load the "
        "model with attn_implementation=\"sdpa\", or use diffusers' native attention backend), or it calls "
        "scaled_dot_product_attention through a reference it took before the install. Or do not stash this "
        "layer.")


def checkpointing_off(stash):
    """The refusal of a training forward of a CHECKPOINT_FUNCTION layer whose checkpointing is
    off (eager, core.py, and traced alike)."""
    return CheckpointingError(
        f"attnstash: {stash.name} is stashed, but checkpointing is off for it (its gradient_checkpointing is False: "
        "checkpointing disabled, or every_n_layers left it out, and no other checkpoint runs it), so there is no "
        "recompute to save and the stash could only cost memory. Enable checkpointing on every stashed layer "
        "(model.activation_checkpointing_enable(), gradient_checkpointing_enable() before transformers 5.23), or "
        "do not stash this one (num_layers, layers=).")


@torch.compiler.assume_constant_result
def _inside_eager_checkpoint():
    """Whether dynamo traces the layer, grad on, from inside an activation checkpoint that runs
    eagerly (the layer compiled on its own, as by torch.compile(block) inside checkpoint(...) or
    diffusers' compile_repeated_blocks): a recompute, or the first forward of a non-reentrant
    checkpoint (its saved-tensor hooks). Evaluated once, as dynamo traces, from the eager state
    it traces in."""
    return ops.frame_phase(-1) != FramePhase.outside_checkpoint  # (grad on: a recompute, or non-reentrant)


def _eager_checkpoint_forward(layer, forward, args, kwargs, anchor):
    """A layer compiled inside an eager checkpoint, as dynamo traces it: a compiled frame on its
    input around its forward (_frame_open, _frame_close), inside which its k-th attention call
    becomes attnstash::_sdpa_compiled on that input at slot `class base + k` (attention), which
    keeps in the checkpoint's first forward and takes it back in its recompute, as the graph runs
    (torch_ops/keep_replay.h, compiled_phase_of)."""
    _frame_open(anchor, _class_slots(type(layer).__name__))
    out = forward(*args, **kwargs)
    calls = _frame_calls()
    _frame_close(anchor)
    if calls == _SPLIT:
        raise CheckpointingError(
            f"attnstash: {layer.__dict__[ATTR].name} is compiled on its own inside an activation checkpoint that "
            "runs eagerly, and torch.compile breaks its graph inside it: what it keeps cannot be traced across the "
            "break. Remove the graph break (fullgraph=True shows where it is), compile the whole model instead, or "
            "do not stash this layer.")
    if calls == 0:  # it must call attention, as in eager
        raise no_attention(layer.__dict__[ATTR])
    _calls_the_ops(type(layer).__name__)
    return out


# Compiled frames (torch_ops/frames.h). _frame_open and _frame_close are nodes of the layer's
# graph that dynamo keeps (allow_in_graph, side-effectful) and AOT autograd does not record: they
# run wherever the graph is traced (dynamo's fake run, each of AOT's traces) and wherever it runs
# as traced (a backend such as "eager"), in order, so that the layer's attention calls in between
# reach `attention`. A frame belongs to one trace (_trace), or, opened where the graph runs, to
# that run of it (the Python frame that runs the graph): a trace that a graph break or an error
# cut short, or a run that raised, leaves its frame behind, which _live drops.
class _Frames(threading.local):
    def __init__(self):
        self.open = []  # [trace, anchor, slot base, calls, run], innermost last


_frames = _Frames()
_SPLIT = -1  # _frame_calls: the layer's frame was opened by a trace a graph break ended


def _trace():
    """What a compiled frame belongs to: the trace running (torch._guards.TracingContext: dynamo's
    and AOT autograd's traces of one graph share it), None where a graph runs as traced."""
    return torch._guards.TracingContext.try_get()


def _running():
    """(id, code) of each Python frame on this thread's stack."""
    frame, running = sys._getframe(1), set()
    while frame is not None:
        running.add((id(frame), frame.f_code))
        frame = frame.f_back
    return running


def _live():
    """This thread's compiled frames, less those left behind (above)."""
    trace = _trace()
    if trace is not None:
        live = [f for f in _frames.open if f[0] is trace]
    elif _frames.open:
        running = _running()
        live = [f for f in _frames.open if f[0] is None and f[4] in running]
    else:
        live = _frames.open
    if len(live) != len(_frames.open):
        _frames.open = live
        ops.set_compiled_frames(len(live))
    return _frames.open


@torch.compiler.allow_in_graph
def _frame_open(anchor, base):
    trace = _trace()
    caller = sys._getframe(1)
    run = None if trace is not None else (id(caller), caller.f_code)
    del caller
    _live().append([trace, anchor, base, 0, run])
    ops.set_compiled_frames(len(_frames.open))
    return anchor


@torch.compiler.allow_in_graph
def _frame_close(anchor):
    frames = _live()
    if frames and frames[-1][1] is anchor:
        frames.pop()
        ops.set_compiled_frames(len(frames))
    return anchor


torch.fx.node.has_side_effect(_frame_open)
torch.fx.node.has_side_effect(_frame_close)


@torch.compiler.assume_constant_result
def _frame_calls():
    """As dynamo traces the layer: the attention calls of its frame so far (_SPLIT if it has none
    in this trace: a graph break ended the one that opened it)."""
    frames = _live()
    return frames[-1][3] if frames else _SPLIT


def open_frames():
    """The compiled frames open on this thread (none between steps: the tests check it)."""
    return len(_live())


def attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """An attention call while this thread has a compiled frame open (torch_ops/frames.h,
    CompiledAttention): attnstash::_sdpa_compiled on the innermost live frame's anchor at its next
    slot; None where no frame is live (the call is not a frame's)."""
    frames = _live()
    if not frames:
        return None
    frame = frames[-1]
    slot = frame[2] + frame[3]
    frame[3] += 1
    return torch.ops.attnstash._sdpa_compiled(query, key, value, frame[1], slot, attn_mask, dropout_p, is_causal,
                                              scale, enable_gqa)


ops.set_compiled_attention(attention)


@torch.compiler.assume_constant_result
def _class_slots(layer_class):
    """The slot base the layers of one class use when compiled inside an eager checkpoint (one per
    class name, so that they share their compiled code; the anchor tells their records apart)."""
    if layer_class not in _slots:
        _slots[layer_class] = ops.new_slot_base()
    return _slots[layer_class]


_slots = {}


def calls_the_ops(layer_class):
    """Whether layers of this class run compiled graphs that call attention through the ops
    themselves (_eager_checkpoint_forward traced one that did): the eager frame around such a
    layer (its checkpoint function's, core.Run) routes none of its calls, and must not say it
    called no attention."""
    return layer_class in _calling


@torch.compiler.assume_constant_result
def _calls_the_ops(layer_class):
    """Notes, as dynamo traces, that this class's graph calls the ops (calls_the_ops)."""
    _calling.add(layer_class)
    return True


_calling = set()


def checkpoint_call(stash, checkpoint_function, fn, args, kwargs, in_frame):
    """A stashed CHECKPOINT_FUNCTION layer's checkpoint function as dynamo traces it
    (core.CheckpointCall under torch.compile): fn runs in the selective checkpoint inside it
    (_selective, with `in_frame`)."""
    return checkpoint_function(_selective(stash, fn, in_frame), *args, **kwargs)
