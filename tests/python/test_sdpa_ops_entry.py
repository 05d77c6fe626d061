"""The installer's ways into the ops. The native frame (torch_ops/frames.h): inside a frame that
keeps, every call of aten::scaled_dot_product_attention, by whatever name, is
attnstash::sdpa_fwd_keep on the frame's anchor at its next slot (the same output bitwise, the same
record kept and replayed, the same error), on the thread that opened it only, and outside every
frame torch's own. And ops.NEW_TOKEN, its entry to attnstash::_new_token: the kernel called from C,
the binding where a mode would see the call; ops.record_id, stash_record_id's kernel called from C;
ops.saved_tensor_hooks_depth, the depth of torch's saved-tensor hook stack."""
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attnstash
from attention_cases import anchor_for, qkv
from attnstash import ops

TOKEN_BINDING = torch.ops.attnstash._new_token.default
KEEP = torch.ops.attnstash.sdpa_fwd_keep


def counting(calls, binding, name):
    def counted(*args):
        calls.append((name, args))
        return binding._op(*args)
    return counted


@pytest.fixture
def token_binding_calls():
    """The calls ops.NEW_TOKEN hands to _new_token's binding, counted."""
    calls = []
    ops.NATIVE._set_token_binding(counting(calls, TOKEN_BINDING, "new_token"))
    yield calls
    ops.NATIVE._set_token_binding(TOKEN_BINDING._op)


class SeenDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class Noted(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def open_frame(anchor, base=0, limit=-1, keep=True):
    phase = ops.FramePhase.reentrant_first if keep else ops.FramePhase.unreachable
    assert ops.frame_open(anchor, base, limit, phase, True, ops.RandomCheck.none, None) is keep


def test_the_token_entry_is_the_c_function_that_falls_back_to_the_binding():
    assert ops.NEW_TOKEN is ops.NATIVE.new_token
    with pytest.raises(TypeError, match="binding of attnstash::_new_token, got 3"):
        ops.NATIVE._set_token_binding(3)
    assert ops.NEW_TOKEN().requires_grad  # the binding it had is still set


def test_a_token_from_c_is_the_binding_s_and_releases_as_the_binding_s_does(token_binding_calls):
    """What the token test of test_sdpa_ops_phases.py checks of ops.new_token, against the binding's
    token: the same kind of tensor, and freed, the records under it released."""
    direct, bound = ops.NEW_TOKEN(), TOKEN_BINDING()
    assert token_binding_calls == []  # made in C
    for token in (direct, bound):
        assert (token.dim(), token.dtype, token.device.type, token.requires_grad, token.is_leaf, token.item()) == \
            (0, torch.float32, "cpu", True, True, 0.0)
        assert token.grad_fn is None and type(token) is torch.Tensor
    q, k, v = qkv(torch.float32, 4, 4, 16)
    with torch.no_grad():
        for token in (direct, bound):
            KEEP(q, k, v, token, 0)
    assert len(ops.held_ids()) == 2
    del direct
    assert len(ops.held_ids()) == 1
    del token, bound
    assert ops.held_ids() == []


def test_record_id_is_the_op_s_kernel_called_directly():
    """ops.record_id, which module_call.py asks of every pending first forward, is the C function,
    and answers as attnstash::stash_record_id does: the record kept on (anchor, slot), 0 on another
    slot, once taken, and for a tensor nothing is kept on; bad arguments say what it takes."""
    assert ops.record_id is ops.NATIVE.record_id
    op = torch.ops.attnstash.stash_record_id
    q, k, v = qkv(torch.float32, 4, 4, 16)
    anchor, other = ops.NEW_TOKEN(), ops.NEW_TOKEN()
    with torch.no_grad():
        KEEP(q, k, v, anchor, 3)
    kept = ops.record_id(anchor, 3)
    assert kept != 0 and kept == op(anchor, 3) and kept in ops.held_ids()
    for args in ((anchor, 4), (other, 3), (q, 3)):
        assert ops.record_id(*args) == op(*args) == 0
    with torch.enable_grad():
        torch.ops.attnstash.sdpa_replay(q, k, v, anchor, 3)
    assert ops.record_id(anchor, 3) == op(anchor, 3) == 0
    with pytest.raises(TypeError, match=r"takes \(anchor tensor, slot\)"):
        ops.record_id(3, 3)
    with pytest.raises(TypeError, match=r"takes \(anchor tensor, slot\)"):
        ops.record_id(anchor)
    with pytest.raises(TypeError):
        ops.record_id(anchor, "3")
    assert attnstash.stash_stats()["records"] == 0


def test_a_mode_that_would_see_the_token_s_call_gets_it_through_the_binding(token_binding_calls):
    with Noted() as function_mode:
        ops.NEW_TOKEN()
    with SeenDispatch() as dispatch_mode:
        token = ops.NEW_TOKEN()
    assert TOKEN_BINDING in function_mode.seen and TOKEN_BINDING in dispatch_mode.seen
    assert token.requires_grad and token.dim() == 0
    assert [name for name, _ in token_binding_calls] == ["new_token", "new_token"]
    with torch.autocast("cpu"), torch.no_grad():  # no mode: from C
        ops.NEW_TOKEN()
    assert len(token_binding_calls) == 2


def arguments(mask, scale, gqa, causal=False):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 2 if gqa else 4, 16)
    attn_mask = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2]) if mask else None
    return q, k, v, attn_mask, causal, scale, gqa


def in_a_recompute(fn):
    """fn() inside a backward pass, with grad on, as a checkpoint's recompute runs it."""
    seen = []

    def recompute(grad):
        with torch.enable_grad():
            seen.append(fn())
        return (None,)
    y = torch.zeros((), requires_grad=True) * 1
    y.grad_fn.register_prehook(recompute)
    y.backward()
    return seen[0]


@pytest.mark.parametrize("mask,scale,gqa,causal", [(False, None, False, True), (True, 0.3, False, False),
                                                   (False, 0.5, True, True), (True, None, True, False)])
def test_inside_a_frame_f_sdpa_is_the_op_kept_and_replayed_bitwise(mask, scale, gqa, causal):
    q, k, v, attn_mask, causal, scale, gqa = arguments(mask, scale, gqa, causal)
    anchor = anchor_for(q)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    want = attend()
    open_frame(anchor, base=7)
    with torch.no_grad():  # a reentrant checkpoint's first forward: kept
        first = attend()
    calls, kept, noted, failure = ops.frame_close(False)
    assert (calls, noted, failure) == (1, False, None) and kept == [ops.record_id(anchor, 7)] and kept[0]
    assert torch.equal(first, want)
    for t in (q, k, v):
        t.requires_grad_(True)

    def recompute():  # its recompute: the kept output, through the replay's node
        open_frame(anchor, base=7, limit=1)
        try:
            return attend()
        finally:
            assert ops.frame_close(False)[0] == 1
    again = in_a_recompute(recompute)
    assert torch.equal(again, want) and "ReentrantReplayFunction" in again.grad_fn.name()
    assert ops.record_id(anchor, 7) == 0  # taken
    assert attnstash.stash_stats()["records"] == 0


def test_every_name_of_attention_reaches_the_frame_and_none_outside_it():
    q, k, v = qkv(torch.float32, 4, 4, 16)
    anchor = anchor_for(q)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 16, 32)
    names = [lambda: F.scaled_dot_product_attention(q, k, v),
             lambda: torch._C._nn.scaled_dot_product_attention(q, k, v), lambda: sdpa_by_name(q, k, v),
             lambda: torch.ops.aten.scaled_dot_product_attention(q, k, v), lambda: mha(x, x, x, need_weights=False)]
    keeps = attnstash.stash_stats()["keeps"]
    with torch.no_grad():
        for call in names:  # outside every frame: torch's own, nothing kept
            call()
        assert attnstash.stash_stats()["keeps"] == keeps
        open_frame(anchor)
        for call in names:
            call()
        calls, kept, _, failure = ops.frame_close(False)
    assert calls == len(names) and len(kept) == len(names) and failure is None
    assert attnstash.stash_stats()["keeps"] == keeps + len(names)
    ops.stash_clear()


def test_a_frame_that_does_not_keep_and_modes_inside_a_frame():
    """A frame that does not keep passes every call to torch; a TorchFunctionMode inside a frame
    that keeps sees torch's own F.sdpa, whose call the frame still keeps."""
    q, k, v = qkv(torch.float32, 4, 4, 16)
    anchor = anchor_for(q)
    with torch.no_grad():
        open_frame(anchor, keep=False)
        F.scaled_dot_product_attention(q, k, v)
        assert ops.frame_close(False)[0] == 0 and attnstash.stash_stats()["records"] == 0
        open_frame(anchor)
        with Noted() as mode:
            F.scaled_dot_product_attention(q, k, v)
        assert ops.frame_close(False)[0] == 1
    assert torch._C._nn.scaled_dot_product_attention in mode.seen
    assert ops.record_id(anchor, 0) != 0
    ops.stash_clear()


def test_a_call_the_op_refuses_raises_its_error_and_the_frame_says_why():
    q, k, v, mask, causal, scale, gqa = arguments(False, None, False)
    anchor = anchor_for(q)
    open_frame(anchor)
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v)
    ops.frame_close(False)
    for t in (q, k, v):
        t.requires_grad_(True)

    def recompute():  # causal where its first forward was not
        open_frame(anchor, limit=1)
        with pytest.raises(RuntimeError) as raised:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return raised.value, ops.frame_close(False)
    error, (calls, _, _, failure) = in_a_recompute(recompute)
    assert calls == 1 and failure[0] == ops.Failure.op and failure[1] == str(error)
    assert str(error).startswith("attnstash") and "is_causal" in str(error)
    ops.stash_clear()
    with pytest.raises(RuntimeError, match="a frame was closed on a thread that has none open"):
        ops.frame_close(False)


def test_frame_run_opens_calls_and_closes_in_one_call_and_an_interrupted_one_releases_what_it_owns():
    """ops.frame_run, the installer's way into a frame (core.run_frame): fn's output and what the
    frame_close after it would say; while fn runs, ops.frame_is_open finds the frame by its slot
    base. Where fn raises (an error, Ctrl-C), the error propagates, the frame is closed and releases
    what it kept (a reentrant first forward owns it), and ops.frame_interrupted says why."""
    q, k, v = qkv(torch.float32, 4, 4, 16)
    anchor = anchor_for(q)
    first, none = ops.FramePhase.reentrant_first, ops.RandomCheck.none
    seen = []

    def attend(scale=None):
        seen.append((ops.frame_is_open(7), ops.frame_is_open(7 + ops.SLOTS_PER_RANGE), ops.frame_depth()))
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    want = attend()
    with torch.no_grad():
        out, calls, keep, ids, noted = ops.frame_run(attend, (), {"scale": None}, anchor, 7, -1, first, True, none,
                                                     None)
    assert torch.equal(out, want) and (calls, keep, noted) == (1, True, False)
    assert ids == [ops.record_id(anchor, 7)] and ids[0] != 0
    assert seen == [(False, False, 0), (True, False, 1)] and not ops.frame_is_open(7) and ops.frame_depth() == 0
    ops.stash_clear()

    other = anchor_for(q)

    def interrupted():
        F.scaled_dot_product_attention(q, k, v)
        assert ops.record_id(other, 0) != 0
        raise KeyboardInterrupt
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        ops.frame_run(interrupted, (), None, other, 0, -1, first, False, none, None)
    assert ops.frame_depth() == 0 and ops.record_id(other, 0) == 0 and attnstash.stash_stats()["records"] == 0
    assert ops.frame_interrupted() == (False, None)

    def twice():  # a recompute that calls attention more often than its first forward
        return F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v)

    def recompute():
        with pytest.raises(RuntimeError, match="more often than its first forward did .1 times"):
            ops.frame_run(twice, (), None, other, 0, 1, ops.FramePhase.recompute, False, none, None)
        return ops.frame_interrupted()
    with torch.no_grad():
        ops.frame_run(F.scaled_dot_product_attention, (q, k, v), None, other, 0, -1, first, False, none, None)
    for t in (q, k, v):
        t.requires_grad_(True)
    noted, failure = in_a_recompute(recompute)
    assert not noted and failure[0] == ops.Failure.limit and ops.frame_depth() == 0
    assert attnstash.stash_stats()["records"] == 0  # the first call took the record
    with pytest.raises(TypeError, match="frame_run takes .fn, args tuple, kwargs dict or None"):
        ops.frame_run(twice, [], None, other, 0, 0, first, False, none, None)
    assert ops.frame_interrupted() == (False, None)  # reset as each frame_run starts


def test_a_frame_routes_only_the_calls_of_its_own_thread():
    q, k, v = qkv(torch.float32, 4, 4, 16)
    anchor = anchor_for(q)
    seen = []

    def other():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)
        seen.append(ops.frame_depth())
    with torch.no_grad():
        open_frame(anchor)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert ops.frame_close(False)[0] == 0
    assert seen == [0] and attnstash.stash_stats()["records"] == 0


def test_other_threads_run_python_while_a_frame_s_op_runs():
    """F.sdpa releases the GIL while it runs, the op it becomes inside a frame included."""
    q, k, v = qkv(torch.float32, 8, 8, 64, batch=8, seq=512)
    anchor = anchor_for(q)
    counted, done = [0], threading.Event()

    def count():
        while not done.is_set():
            counted[0] += 1

    def kept():
        open_frame(anchor)
        try:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v)
        finally:
            assert ops.frame_close(False)[0] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    kept()
    op_time = time.perf_counter() - start  # alone, no other thread waiting for the GIL
    interval = sys.getswitchinterval()
    # Far longer than the op: the counter can run during it only if the op releases the GIL.
    sys.setswitchinterval(max(1.0, 20 * op_time))
    thread = threading.Thread(target=count)
    thread.start()
    try:
        before = counted[0]
        kept()  # the same forward again: it shares the record
        during = counted[0] - before
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
        ops.stash_clear()
    assert during > 0


def test_saved_tensor_hooks_depth_counts_this_thread_s_hook_pairs():
    """ops.saved_tensor_hooks_depth, which offload.py reads before looking below a non-reentrant
    checkpoint's own hooks, counts the pairs pushed on this thread, as torch's stack holds them: 0
    outside, one more for each saved_tensors_hooks (and for a non-reentrant checkpoint's forward),
    back as each exits; another thread's are its own."""
    def same(t):
        return t
    seen = []

    def inside_checkpoint(x):
        seen.append(ops.saved_tensor_hooks_depth())
        return x * 2

    assert ops.saved_tensor_hooks_depth() == 0
    with torch.autograd.graph.saved_tensors_hooks(same, same):
        assert ops.saved_tensor_hooks_depth() == 1
        with torch.autograd.graph.saved_tensors_hooks(same, same):
            assert ops.saved_tensor_hooks_depth() == 2
            other = []
            thread = threading.Thread(target=lambda: other.append(ops.saved_tensor_hooks_depth()))
            thread.start()
            thread.join()
            assert other == [0]
        assert ops.saved_tensor_hooks_depth() == 1
        x = torch.ones(2, requires_grad=True)
        torch.utils.checkpoint.checkpoint(inside_checkpoint, x, use_reentrant=False).sum().backward()
    assert seen[0] == 2 and ops.saved_tensor_hooks_depth() == 0
