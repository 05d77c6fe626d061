"""attnstash::sdpa_fwd_keep and attnstash::sdpa_replay on CPU under torch.library.opcheck
(sdpa_replay on prepared records) and torch.compile(fullgraph=True), which matches eager."""
import pytest
import torch

import attnstash
from attention_cases import anchor_for, qkv
from attnstash import ops


def test_opcheck_sdpa_fwd_keep_on_the_ordinary_path():
    torch.manual_seed(0)
    for dtype, hq, hkv in ((torch.float32, 4, 4), (torch.bfloat16, 8, 2)):
        q, k, v = (t.detach().requires_grad_() for t in qkv(dtype, hq, hkv, 64))
        anchor = torch.randn(3)
        torch.library.opcheck(torch.ops.attnstash.sdpa_fwd_keep.default,
                              (q, k, v, anchor, 0, None, 0.0, True, None, hq != hkv))


@pytest.mark.parametrize("test_util", ["test_schema", "test_autograd_registration", "test_faketensor",
                                       "test_aot_dispatch_dynamic"])
def test_opcheck_sdpa_replay_on_a_prepared_entry(test_util):
    # Each real call of sdpa_replay takes one entry; keep one for every call opcheck makes.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    real_calls = 0

    class Refill(torch.overrides.TorchFunctionMode):
        # opcheck calls the op several times on copies of the arguments: before each real
        # call, keep a forward for exactly those arguments.
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal real_calls
            takes = (torch.ops.attnstash.sdpa_replay.default, torch.ops.attnstash._replay_take.default)
            if func in takes and type(args[0]) is torch.Tensor:
                # (Compiled code passes detached inputs: keep through a detached alias that
                # requires grad, which has the anchor's data pointer, version and shape.)
                anchor_alias = args[3].detach().requires_grad_()
                with torch.no_grad():
                    torch.ops.attnstash.sdpa_fwd_keep.default(*args[:3], anchor_alias, *args[4:])
                real_calls += 1
            return func(*args, **(kwargs or {}))

    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), anchor, 0,
            None, 0.0, True, None, False)
    with Refill():
        torch.library.opcheck(torch.ops.attnstash.sdpa_replay.default, args, test_utils=test_util)
    assert real_calls >= (1 if test_util in ("test_schema", "test_aot_dispatch_dynamic") else 0)
    assert attnstash.stash_stats()["records"] == 0


def test_compiled_fullgraph_call_matches_eager():
    torch.manual_seed(0)
    q, k, v = (t.detach().requires_grad_() for t in qkv(torch.float32, 8, 2, 64))

    def attention(q, k, v, anchor):
        return ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True).sum(dim=1)

    anchor = torch.randn(3)
    eager = attention(q, k, v, anchor)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v, anchor)
    assert torch.equal(eager, compiled)
    g = torch.randn_like(eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(eager, (q, k, v), g),
                                                 torch.autograd.grad(compiled, (q, k, v), g)))


def test_opcheck_the_compiled_op_outside_any_checkpoint():
    # attnstash::_sdpa_compiled (what a layer compiled inside an eager checkpoint calls:
    # install/compiled.py) outside a checkpoint: it attends, keeps nothing, and its node's
    # backward is the kept backend's.
    torch.manual_seed(0)
    for dtype, hq, hkv in ((torch.float32, 4, 4), (torch.bfloat16, 8, 2)):
        q, k, v = (t.detach().requires_grad_() for t in qkv(dtype, hq, hkv, 64))
        anchor = torch.randn(3)
        args = (q, k, v, anchor, 0, None, 0.0, True, None, hq != hkv)
        torch.library.opcheck(torch.ops.attnstash._sdpa_compiled.default, args)
        out = torch.ops.attnstash._sdpa_compiled(*args)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
        assert torch.equal(out, expected)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        expected_grads = torch.autograd.grad(expected.float().sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    assert attnstash.stash_stats()["records"] == 0
