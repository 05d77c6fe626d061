"""ops.KEEP, the installer's entry to attnstash::sdpa_fwd_keep (torch_ops/python_module.cpp): with
plain arguments it makes the op's dispatcher call itself, and any other call goes to the op's binding,
so that every call gives what torch.ops.attnstash.sdpa_fwd_keep gives: the same output bitwise, the
same record kept, the same error, and __torch_function__ seen where the binding would see it. And
ops.NEW_TOKEN, its entry to attnstash::_new_token: the kernel called from C, the binding where a mode
would see the call."""
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attnstash
from attention_cases import anchor_for, qkv
from attnstash import ops

BINDING = torch.ops.attnstash.sdpa_fwd_keep.default
TOKEN_BINDING = torch.ops.attnstash._new_token.default


def counting(calls, binding, name):
    def counted(*args):
        calls.append((name, args))
        return binding._op(*args)
    return counted


@pytest.fixture
def binding_calls():
    """The calls ops.KEEP hands to the op's binding, counted (the binding itself still makes them)."""
    calls = []
    ops.NATIVE._set_bindings(counting(calls, BINDING, "keep"), TOKEN_BINDING._op)
    yield calls
    ops.NATIVE._set_bindings(BINDING._op, TOKEN_BINDING._op)


@pytest.fixture
def token_binding_calls():
    """The calls ops.NEW_TOKEN hands to _new_token's binding, counted."""
    calls = []
    ops.NATIVE._set_bindings(BINDING._op, counting(calls, TOKEN_BINDING, "new_token"))
    yield calls
    ops.NATIVE._set_bindings(BINDING._op, TOKEN_BINDING._op)


def test_the_installer_s_entries_are_the_c_functions_that_fall_back_to_the_ops_bindings():
    assert ops.KEEP is ops.NATIVE.keep
    assert ops.NEW_TOKEN is ops.NATIVE.new_token
    with pytest.raises(TypeError, match="binding of attnstash::_new_token, got 3"):
        ops.NATIVE._set_bindings(print, 3)
    q, *rest = arguments(False, None, False)
    with torch.no_grad():  # a subclass goes to the keep's binding: still the op's, not print
        assert type(ops.KEEP(q.as_subclass(Recorded), *rest)) is Recorded
    ops.stash_clear()


class SeenDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


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
            ops.KEEP(q, k, v, token, 0, None, 0.0, False, None, False)
    assert len(ops.held_ids()) == 2
    del direct
    assert len(ops.held_ids()) == 1
    del token, bound
    assert ops.held_ids() == []


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
    return q, k, v, anchor_for(q), 0, attn_mask, 0.0, causal, scale, gqa


@pytest.mark.parametrize("mask,scale,gqa,causal", [(False, None, False, True), (True, 0.3, False, False),
                                                   (False, 0.5, True, True), (True, None, True, False)])
def test_plain_arguments_are_the_op_s_own_call_kept_and_replayed_bitwise(binding_calls, mask, scale, gqa, causal):
    args = arguments(mask, scale, gqa, causal)
    q, k, v, anchor = args[:4]
    with torch.no_grad():  # a reentrant checkpoint's first forward: kept
        direct = ops.KEEP(*args)
    assert binding_calls == []  # made in C
    assert ops.record_id(anchor, 0) != 0
    want = F.scaled_dot_product_attention(q, k, v, args[5], is_causal=causal, scale=scale, enable_gqa=gqa)
    assert torch.equal(direct, want)
    for t in (q, k, v):
        t.requires_grad_(True)

    def recompute():  # its recompute, inside a backward pass: the kept output, through the replay's node
        with torch.enable_grad():  # as a checkpoint's recompute runs
            seen.append(ops.KEEP(q, k, v, anchor, 0, *args[5:]))
        return (None,)
    seen = []
    x = torch.zeros((), requires_grad=True)
    hooked = x * 1
    hooked.grad_fn.register_prehook(lambda grad: recompute())
    hooked.backward()
    assert binding_calls == []
    assert torch.equal(seen[0], want) and seen[0].grad_fn is not None
    assert ops.record_id(anchor, 0) == 0  # taken
    assert attnstash.stash_stats()["records"] == 0


class Recorded(torch.Tensor):
    """A tensor subclass whose __torch_function__ notes each function it sees."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class Noted(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_subclass_or_a_torch_function_mode_reaches_the_binding_and_sees_the_op(binding_calls):
    q, k, v, anchor, *rest = arguments(False, None, False)
    Recorded.seen = []
    out = ops.KEEP(q.as_subclass(Recorded), k, v, anchor, *rest)
    assert BINDING in Recorded.seen and type(out) is Recorded
    with Noted() as mode:
        ops.KEEP(q, k, v, anchor, *rest)
    assert BINDING in mode.seen
    assert len(binding_calls) == 2


@pytest.mark.parametrize("change,index", [(0, 6), (1, 7), (torch.tensor(0.5).item(), 8), (2 ** 70, 4),
                                          (torch.tensor(True), 7)])
def test_arguments_python_would_convert_go_to_the_binding_and_convert_as_it_does(binding_calls, change, index):
    args = list(arguments(False, None, False))
    args[index] = change
    try:
        want = ("result", BINDING._op(*args))
    except Exception as e:  # noqa: BLE001 (whatever the binding raises, the entry must raise)
        want = ("error", type(e), str(e))
    try:
        got = ("result", ops.KEEP(*args))
    except Exception as e:  # noqa: BLE001
        got = ("error", type(e), str(e))
    assert got[0] == want[0] and (torch.equal(got[1], want[1]) if got[0] == "result" else got == want)
    assert len(binding_calls) == (0 if isinstance(change, float) else 1)  # a float scale is plain


def test_the_op_s_errors_come_through_as_the_binding_s(binding_calls):
    q, k, v, anchor, *rest = arguments(False, None, False)
    differs = list(rest)
    differs[3] = not differs[3]  # a recompute causal where its first forward was not
    errors = []
    for call in (ops.KEEP, BINDING._op):
        with torch.no_grad():  # kept again for each (the failed recompute releases it)
            ops.KEEP(q.detach(), k.detach(), v.detach(), anchor, *rest)
        for t in (q, k, v):
            t.requires_grad_(True)

        def recompute(grad, call=call):
            with torch.enable_grad(), pytest.raises(RuntimeError) as info:
                call(q, k, v, anchor, *differs)
            errors.append((type(info.value), str(info.value)))
            return (None,)
        y = torch.zeros((), requires_grad=True) * 1
        y.grad_fn.register_prehook(recompute)
        y.backward()
    assert binding_calls == []
    assert errors[0] == errors[1] and errors[0][1].startswith("attnstash")
    ops.stash_clear()


def test_other_threads_run_python_while_the_entry_s_op_runs():
    """The GIL is released while the op runs, as the binding releases it."""
    q, k, v = qkv(torch.float32, 8, 8, 64, batch=8, seq=512)
    anchor = anchor_for(q)
    counted, done = [0], threading.Event()

    def count():
        while not done.is_set():
            counted[0] += 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    ops.KEEP(q, k, v, anchor, 0, None, 0.0, False, None, False)
    op_time = time.perf_counter() - start  # alone, no other thread waiting for the GIL
    interval = sys.getswitchinterval()
    # Far longer than the op: the counter can run during it only if the op releases the GIL.
    sys.setswitchinterval(max(1.0, 20 * op_time))
    thread = threading.Thread(target=count)
    thread.start()
    try:
        before = counted[0]
        ops.KEEP(q, k, v, anchor, 0, None, 0.0, False, None, False)
        during = counted[0] - before
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    assert during > 0
