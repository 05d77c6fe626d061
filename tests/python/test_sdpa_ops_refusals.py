"""attnstash::sdpa_fwd_keep and attnstash::sdpa_replay on CPU refuse what they cannot keep or
replay with a clear error, and keep nothing: a replay with nothing kept or unlike its forward, an
anchor, output or mask modified in place, another mask, attention dropout, the math backend, a
second keep through the same attention, masks that require grad, nested tensors; inputs that
F.scaled_dot_product_attention itself refuses get its own error, word for word."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import attnstash
from attention_cases import Block, anchor_for, error_of, padding_mask, qkv
from attnstash import ops


def test_replay_with_nothing_kept_fails_clearly():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    misses = attnstash.stash_stats()["misses"]
    msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 3))
    assert "no attention output is kept for this anchor" in msg and "slot 3" in msg
    assert attnstash.stash_stats()["misses"] == misses + 1


def test_anchor_modified_in_place_is_reported_as_a_version_change():
    # (Inside torch.utils.checkpoint, autograd's own saved-tensor check trips first.)
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True)
        anchor.add_(1.0)
        msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0, is_causal=True))
    assert "modified in place" in msg and "version was 0" in msg and "is 1 now" in msg
    assert attnstash.stash_stats()["records"] == 0  # the stale record was released with the error


def refused_and_nothing_kept(call, words):
    """call() (grad off) raises a RuntimeError that says every one of words; nothing stays kept."""
    with torch.no_grad():
        msg = error_of(call)
    assert all(w in msg for w in words), msg
    assert attnstash.stash_stats()["records"] == 0


def under_math(call):
    """call, made under sdpa_kernel([SDPBackend.MATH])."""
    def under(*args):
        with sdpa_kernel([SDPBackend.MATH]):
            return call(*args)
    return under


def replay(q, k, v, anchor, is_causal=True):
    return ops.sdpa_replay(q, k, v, anchor, 0, is_causal=is_causal)


DIFFERING_REPLAYS = [  # a replay unlike its forward (q, k, v, anchor, causal), and what its error says
    pytest.param(lambda q, k, v, a: replay(q[:, :, :-1], k, v, a), ["query", "differs"], id="shape"),
    pytest.param(lambda q, k, v, a: replay(q, k.double(), v, a), ["key", "Double"], id="dtype"),
    pytest.param(lambda q, k, v, a: replay(q, k, v, a, is_causal=False), ["is_causal=1", "is_causal=0"], id="flags"),
    pytest.param(under_math(replay), ["SDPA backend", "math"], id="backend"),
]


@pytest.mark.parametrize("differing_replay,words", DIFFERING_REPLAYS)
def test_replay_rejects_a_call_that_differs_from_its_forward(differing_replay, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True)
    refused_and_nothing_kept(lambda: differing_replay(q, k, v, anchor), words + ["released"])


def test_an_output_modified_in_place_before_its_recompute_is_rejected():
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    with torch.no_grad():
        out = ops.sdpa_fwd_keep(q, k, v, anchor, 0)
        out.mul_(2)
        msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0))
    assert "modified in place" in msg and "output" in msg


def keep(q, k, v, anchor, **kwargs):
    return ops.sdpa_fwd_keep(q, k, v, anchor, 0, **kwargs)


def keep_again_with_another_query(q, k, v, anchor):
    """The same anchor and slot again, with another query: refused, and the first keep stays
    (its replay takes it)."""
    keep(q, k, v, anchor)
    try:
        keep(q + 1, k, v, anchor)
    finally:
        ops.sdpa_replay(q, k, v, anchor, 0)


UNKEEPABLE = [  # a call that cannot be kept (q, k, v, anchor), and what its error says
    pytest.param(lambda q, k, v, a: keep(q[0], k, v, a), ["query must be 4-D", "3-D"], id="3-D"),
    pytest.param(lambda q, k, v, a: keep(q, k, v, a, dropout_p=0.1), ["dropout_p=0.1", "attention dropout"],
                 id="dropout"),
    pytest.param(under_math(keep), ["math backend", "sdpa_kernel", "flash_attention (CPU)"], id="math backend"),
    pytest.param(keep_again_with_another_query,
                 ["already went through this attention (slot 0)", "different result", "inputs_embeds.clone()"],
                 id="second keep"),
    pytest.param(lambda q, k, v, a: keep(q, k, v, torch.zeros([1] * 9, requires_grad=True)),
                 ["at most 8 dimensions"], id="rank 9 anchor"),
]


@pytest.mark.parametrize("unkeepable,words", UNKEEPABLE)
def test_what_cannot_be_kept_fails_clearly_and_keeps_nothing(unkeepable, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    anchor = anchor_for(q)
    refused_and_nothing_kept(lambda: unkeepable(q, k, v, anchor), words)


def test_a_mask_that_requires_grad_is_refused_rather_than_given_no_gradient():
    # The kept path gives masks no gradient (as PyTorch's flash and cuDNN derivatives do);
    # a mask that requires grad is refused instead of silently getting none.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "additive", torch.float32).requires_grad_()
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(q, k, v, anchor_for(q), 0, mask))
    assert "requires grad" in msg and "no gradient" in msg and "detach" in msg


def flip_key_0(mask, b, rows):
    """mask, with key 0 of batch b's query rows `rows` flipped in place."""
    mask[b, :, rows, 0] = ~mask[b, :, rows, 0]
    return mask


ANOTHER_MASK = [  # the recompute's mask, from the first forward's bool padding mask, and what its error says
    pytest.param(lambda m: flip_key_0(m.clone(), 1, slice(None)), ["attn_mask", "different values"], id="values"),
    pytest.param(lambda m: padding_mask(2, 48, "additive", torch.float32), ["attn_mask", "Bool", "Float"],
                 id="dtype"),
    pytest.param(lambda m: flip_key_0(m, 0, 5), ["attn_mask was modified in place"], id="in place"),
]


@pytest.mark.parametrize("another_mask,words", ANOTHER_MASK)
def test_a_recompute_with_another_mask_is_refused(another_mask, words):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "bool", torch.float32)
    anchor = anchor_for(q)
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
    refused_and_nothing_kept(lambda: ops.sdpa_replay(q, k, v, anchor, 0, another_mask(mask)), words)


@pytest.mark.parametrize("make_alias", [pytest.param(lambda m: m.detach(), id="detached"),
                                        pytest.param(lambda m: m[:], id="view")])
def test_a_recompute_given_an_alias_of_the_mask_checks_its_version_not_its_values(make_alias):
    # A reentrant checkpoint hands its recompute a detached alias of a positional mask.
    # Its values are the first forward's memory, so comparing them cannot show a change;
    # the shared version counter does, and nothing is read (on a GPU that read would
    # synchronise once per layer). A mask in other memory is compared by value.
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, 4, 4, 64)
    mask = padding_mask(2, 48, "bool", torch.float32)
    anchor = anchor_for(q)

    def replay_reads_values(m):
        with torch.profiler.profile() as prof:
            ops.sdpa_replay(q, k, v, anchor, 0, m)
        return "aten::equal" in [e.name for e in prof.events()]

    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
        assert not replay_reads_values(make_alias(mask))
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
        assert replay_reads_values(mask.clone())
        for through in ("first forward's handle", "alias"):
            ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask)
            view = make_alias(mask)
            target = mask if through == "first forward's handle" else view
            flip_key_0(target, 0, 5)
            msg = error_of(lambda: ops.sdpa_replay(q, k, v, anchor, 0, view))
            assert "attn_mask was modified in place" in msg, through
    assert attnstash.stash_stats()["records"] == 0


# ---- inputs F.sdpa refuses get PyTorch's own words --------------------------------------------

REFUSED_BY_FSDPA = [  # from q, k, v [2, 4, 8, 16]: (q, k, v, mask, kwargs) F.sdpa refuses, and a piece of its error
    pytest.param(lambda q, k, v: (q, k.bfloat16(), v, None, {}),
                 "Expected query, key, and value to have the same dtype", id="dtypes differ"),
    pytest.param(lambda q, k, v: (torch.randn(2, 6, 8, 16), k, v, None, {"enable_gqa": True}),
                 "must divide the number of heads", id="heads do not divide"),
    pytest.param(lambda q, k, v: (q, torch.randn(2, 4, 8, 32), v, None, {}),
                 "Expected size for first two dimensions of batch2", id="head_dim differs"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(2, 1, 9, 8), {}), "9", id="mask shape"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(2, 1, 8, 8, dtype=torch.int32), {}),
                 "Expected attn_mask dtype to be bool or float", id="mask dtype"),
    pytest.param(lambda q, k, v: (q, k, v, torch.zeros(3, 5, dtype=torch.bool), {}),
                 "must match the size", id="bool mask of a shape that does not broadcast"),
    pytest.param(lambda q, k, v: (q.long(), k.long(), v.long(), None, {}), "dtype", id="integer dtype"),
]


@pytest.mark.parametrize("refused,words", REFUSED_BY_FSDPA)
def test_inputs_fsdpa_refuses_get_its_own_error_when_kept(refused, words):
    torch.manual_seed(0)
    q, k, v, mask, kwargs = refused(*(torch.randn(2, 4, 8, 16) for _ in range(3)))
    with pytest.raises(RuntimeError) as plain:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    assert words in str(plain.value)
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(q, k, v, anchor_for(q.float()), 0, mask, **kwargs))
    assert msg == str(plain.value)  # F.sdpa's own error, word for word
    assert attnstash.stash_stats()["records"] == 0


def test_a_mask_that_requires_grad_in_a_reentrant_checkpoint_gets_the_mask_error():
    block = Block(64, 4, 4, 16, torch.float32, False, use_stash=True)
    x = torch.randn(2, 8, 64, requires_grad=True)
    mask = torch.zeros(2, 1, 8, 8, requires_grad=True)
    msg = error_of(lambda: checkpoint(block, x, mask, use_reentrant=True))
    assert "attn_mask requires grad" in msg and "detach" in msg


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_query_gets_a_clear_error_when_kept(layout):
    nt = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 7, 16)],
                                    layout=torch.jagged if layout == "jagged" else torch.strided)
    with torch.no_grad():
        msg = error_of(lambda: ops.sdpa_fwd_keep(nt, nt, nt, torch.randn(3, requires_grad=True), 0))
    assert "nested" in msg and "dense" in msg


def test_a_mask_that_requires_grad_only_in_the_recompute_is_refused_there():
    # A learned bias folded into the mask: under a reentrant checkpoint's first forward (no
    # grad) it looks like any mask; in the recompute it requires grad, and the kept path
    # would give it none.
    torch.manual_seed(0)
    block = Block(64, 4, 4, 16, torch.float32, False, use_stash=True)
    bias = torch.nn.Parameter(torch.zeros(1, 1, 8, 8))
    x = torch.randn(2, 8, 64, requires_grad=True)

    def biased(x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 16).transpose(1, 2) for p in (block.q, block.k, block.v))
        return ops.sdpa_fwd_keep(q, k, v, x, 0, bias * 1.0).sum()

    y = checkpoint(biased, x, use_reentrant=True)
    msg = error_of(lambda: y.backward())
    assert "attn_mask requires grad" in msg and "no gradient" in msg and "kept output has been released" in msg
    assert attnstash.stash_stats()["records"] == 0
