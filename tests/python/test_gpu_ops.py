"""The ops on CUDA with each backend attnstash keeps there (attnstash.backends.KEPT_BACKENDS:
cuDNN, flash and memory-efficient attention), at a scaled-down Qwen3-30B-A3B attention
shape. Skipped without a GPU; run on the GPU machine by tests/gpu/run.sh.

cuDNN accumulates dQ non-deterministically (two autograd runs on the same inputs give
different dQ), so dQ is bounded by autograd's own error against an fp32 reference;
the output, dK and dV are compared bitwise."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import attnstash
from attention_cases import Block, padding_mask, qkv
from attnstash import ops
from attnstash.backends import KEPT_BACKENDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDNN = SDPBackend.CUDNN_ATTENTION


def cuda_qkv(d, batch=2, seq=256, hq=8, hkv=2):
    """Seeded bf16 query, key and value on CUDA in Hugging Face's layout."""
    torch.manual_seed(0)
    return qkv(torch.bfloat16, hq, hkv, d, batch, seq, device="cuda")


def cuda_padding_mask(kind, key_room=0):
    """The [2, 1, 256, 256] bf16 padding mask on CUDA, row b padded by 17 * b keys."""
    return padding_mask(2, 256, kind, torch.bfloat16, device="cuda", key_room=key_room, pad_per_row=17)


BACKENDS = [row.backend for row in KEPT_BACKENDS if row.device == "cuda"]
# Flash attention on CUDA takes no attn_mask (F.sdpa never picks it for a masked call): the others do.
MASKED_BACKENDS = [b for b in BACKENDS if b != SDPBackend.FLASH_ATTENTION]


def test_cudnn_is_the_backend_under_test():
    q, k, v = cuda_qkv(128)
    with sdpa_kernel([CUDNN]):
        assert torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True) == CUDNN.value


def keep_replay_and_autograd(backend, q, k, v, n_runs, causal=False, gqa=False, mask=None):
    """Under `backend`: keep the forward and replay it with a gradient g, then run F.sdpa
    and autograd n_runs times on the same inputs. Returns g, the kept and the replayed
    output, the replay's gradients, and [(output, gradients)] of the autograd runs."""
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    anchor = torch.randn(4, device="cuda", requires_grad=True)
    with sdpa_kernel([backend]):
        assert torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=gqa) == backend.value
        with torch.no_grad():
            kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, mask, is_causal=causal, enable_gqa=gqa)
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        replayed = ops.sdpa_replay(qr, kr, vr, anchor, 0, mask, is_causal=causal, enable_gqa=gqa)
        got = torch.autograd.grad(replayed, (qr, kr, vr), g)
        runs = []
        for _ in range(n_runs):
            qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
            runs.append((out, torch.autograd.grad(out, (qa, ka, va), g)))
    assert attnstash.stash_stats()["records"] == 0
    return g, kept, replayed, got, runs


def check_against_autograd(backend, q, k, v, causal, gqa, mask=None):
    """Output bitwise F.sdpa's under the same backend; each gradient bitwise autograd's
    where autograd itself is bitwise reproducible (5 runs), else no further from an fp32
    reference than autograd's own worst run."""
    g, kept, replayed, got, runs = keep_replay_and_autograd(backend, q, k, v, 5, causal, gqa, mask)
    assert torch.equal(kept, runs[0][0]) and torch.equal(replayed, runs[0][0])
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=ref_mask, is_causal=causal, enable_gqa=gqa)
    exact = torch.autograd.grad(ref_out, (qf, kf, vf), g.float())
    report = {}
    for i, name in enumerate("qkv"):
        autograd_runs = [r[1][i] for r in runs]
        if all(torch.equal(a, autograd_runs[0]) for a in autograd_runs):
            assert torch.equal(got[i], autograd_runs[0]), f"d{name} differs from deterministic autograd"
            report[name] = "bitwise"
        else:
            worst = max((a.float() - exact[i]).abs().max().item() for a in autograd_runs)
            mine = (got[i].float() - exact[i]).abs().max().item()
            assert mine <= worst, f"d{name}: replay error {mine} > autograd's worst {worst}"
            report[name] = f"within autograd spread ({mine:.3g} <= {worst:.3g})"
    print(backend.name, report)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_each_backend_keeps_and_replays_like_autograd(backend, d, causal):
    q, k, v = cuda_qkv(d)
    check_against_autograd(backend, q, k, v, causal, gqa=True)


@pytest.mark.parametrize("backend", MASKED_BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_each_masked_backend_keeps_and_replays_like_autograd(backend, kind):
    # With a mask Hugging Face repeats K/V instead of passing enable_gqa. seq 256: the
    # cuDNN NaN bug of torch 2.11 hits masked seq % 128 == 64.
    q, k, v = cuda_qkv(128, hq=8, hkv=8)
    check_against_autograd(backend, q, k, v, False, gqa=False, mask=cuda_padding_mask(kind))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_efficient_attention_with_a_mask_it_must_re_lay_out(kind):
    # Row stride 259, not a multiple of 8: F.sdpa pads and slices the mask before the
    # memory-efficient kernel, and so must the kept forward and the replay's backward.
    q, k, v = cuda_qkv(128, hq=8, hkv=8)
    mask = cuda_padding_mask(kind, key_room=3)
    assert mask.stride(2) == 259
    check_against_autograd(SDPBackend.EFFICIENT_ATTENTION, q, k, v, False, gqa=False, mask=mask)


def same_bits(a, b):
    """Bitwise equality that also holds for NaN and inf entries."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


@pytest.mark.parametrize("backend", MASKED_BACKENDS, ids=lambda b: b.name)
def test_fully_masked_rows_are_what_f_sdpa_gives(backend):
    """Left padding as Hugging Face masks it: the padded query rows attend to nothing, and
    one row's padding spans more than a 128-key tile. What such rows get depends on the
    value F.sdpa gives a boolean mask's false places, which differs by backend and torch
    (cuDNN: -65504 on torch 2.6 to 2.11, -inf later; efficient: -inf): the kept output and
    the replay's gradients must be F.sdpa's and autograd's bit for bit, NaN and all."""
    q, k, v = cuda_qkv(128, hq=8, hkv=8)
    seq = q.shape[2]
    keep = torch.ones(2, 1, seq, seq, dtype=torch.bool, device="cuda").tril()
    for b, pad in enumerate((40, 150)):
        keep[b, :, :, :pad] = False  # causal: query rows < pad now attend to nothing
    _, kept, replayed, got, runs = keep_replay_and_autograd(backend, q, k, v, 3, mask=keep)
    assert same_bits(kept, runs[0][0]) and same_bits(replayed, runs[0][0])
    for i, name in enumerate("qkv"):
        autograd_runs = [r[1][i] for r in runs]
        if all(same_bits(a, autograd_runs[0]) for a in autograd_runs):
            assert same_bits(got[i], autograd_runs[0]), f"d{name} differs from deterministic autograd"
        else:  # cuDNN's dQ: the same non-finite places, and no further off than autograd's runs
            ref = autograd_runs[0]
            assert torch.equal(got[i].isfinite(), ref.isfinite()), f"d{name}: non-finite entries differ"
            fin = ref.isfinite()
            spread = max((a[fin].float() - ref[fin].float()).abs().max().item() for a in autograd_runs[1:])
            assert (got[i][fin].float() - ref[fin].float()).abs().max().item() <= spread, f"d{name}"


def test_reentrant_checkpoint_on_cuda_keeps_once_and_replays_once():
    torch.manual_seed(0)
    block = Block(1024, 8, 2, 128, fused_kv=True).cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = attnstash.stash_stats()
    with sdpa_kernel([CUDNN]):
        y = checkpoint(block, x, use_reentrant=True)
        mid = attnstash.stash_stats()
        y.float().square().mean().backward()
    after = attnstash.stash_stats()
    assert mid["records"] == 1
    # output (bf16) + LSE (fp32, [B, H, S, 1]) + cuDNN's two 0-dim int64 philox tensors
    assert mid["bytes"] == 2 * 8 * 256 * 128 * 2 + 2 * 8 * 256 * 4 + 2 * 8
    assert after["keeps"] - before["keeps"] == 1 and after["replays"] - before["replays"] == 1
    assert after["records"] == 0
    block.use_stash = False
    x2 = x.detach().clone().requires_grad_()
    with sdpa_kernel([CUDNN]):
        y2 = checkpoint(block, x2, use_reentrant=True)
    assert torch.equal(y, y2)


def test_replay_rejects_a_query_on_another_device():
    q, k, v = cuda_qkv(64)
    anchor = torch.randn(4, device="cuda", requires_grad=True)
    with sdpa_kernel([CUDNN]), torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True, enable_gqa=True)
        with pytest.raises(RuntimeError, match="query .* differs"):
            ops.sdpa_replay(q.cpu(), k, v, anchor, 0, is_causal=True, enable_gqa=True)
    assert attnstash.stash_stats()["records"] == 0


def test_opcheck_on_cuda():
    q, k, v = (t.detach().requires_grad_() for t in cuda_qkv(64, seq=128))
    with sdpa_kernel([CUDNN]):
        torch.library.opcheck(torch.ops.attnstash.sdpa_fwd_keep.default,
                              (q, k, v, torch.randn(3, device="cuda"), 0, None, 0.0, True, None, True))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("backwards", [1, 2], ids=["one backward", "retain_graph, then another"])
def test_hugging_face_training_step_on_cuda(backend, padded, use_reentrant, backwards):
    """A tiny Llama in bf16 with every layer stashed, under either checkpointing mode: the
    loss bitwise the normal recompute's; each gradient bitwise where the normal runs are
    bitwise equal, else no further from its nearest normal run than the normal runs are
    from each other. With two backwards, the first keeps the graph (retain_graph=True) and
    each replays (test_backward_twice.py on CPU)."""
    from tiny_models import assert_within_run_spread, batch, clone, tiny_model
    if padded and backend not in MASKED_BACKENDS:
        pytest.skip("flash attention takes no mask: PyTorch never picks it for padded batches")
    base = tiny_model("llama", layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    base = base.to("cuda", torch.bfloat16)
    ids = batch(batch_size=2, seq=128).cuda()
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :20] = 0

    def step(model):
        with sdpa_kernel([backend]):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            if backwards == 2:
                loss.backward(retain_graph=True)
                loss = loss * 0.5
            loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    normal = [step(clone(base)) for _ in range(4)]
    model = clone(base)
    attnstash.install_attention_stash(model, 2)
    before = attnstash.stash_stats()
    try:
        loss, grads = step(model)
    finally:
        attnstash.uninstall_attention_stash(model)
    after = attnstash.stash_stats()
    assert (after["keeps"] - before["keeps"], after["replays"] - before["replays"]) == (2, 2 * backwards)  # not a no-op
    assert_within_run_spread(normal, (loss, grads))
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mixed", [False, True], ids=["all-fp32", "v-in-autocast-dtype"])
def test_cuda_autocast_keeps_and_replays_what_fsdpa_under_autocast_computes(dtype, mixed):
    # fp32 query/key (as Hugging Face's rotary embedding leaves them) and value fp32 or
    # already in the autocast dtype: both ops cast as F.sdpa does under CUDA autocast.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 128, device="cuda") for _ in range(3))
    if mixed:
        v = v.to(dtype)
    anchor = torch.randn(4, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        backend = torch._fused_sdp_choice(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
        with sdpa_kernel([SDPBackend(backend)]):
            with torch.no_grad():
                kept = ops.sdpa_fwd_keep(q, k, v, anchor, 0, is_causal=True)
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            replayed = ops.sdpa_replay(qr, kr, vr, anchor, 0, is_causal=True)
            qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qa, ka, va, is_causal=True)
    assert kept.dtype == dtype and torch.equal(kept, ref) and torch.equal(replayed, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(replayed, (qr, kr, vr), g)
    want = torch.autograd.grad(ref, (qa, ka, va), g)
    for name, a, b in zip("kv", got[1:], want[1:]):  # dK, dV deterministic; dQ: see check_against_autograd
        assert torch.equal(a, b), name
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hugging_face_fp32_model_under_cuda_autocast(dtype, use_reentrant):
    """fp32 weights under CUDA autocast with every layer stashed: the loss bitwise the normal
    recompute's, every layer kept and replayed once, nothing held after."""
    from tiny_models import batch, clone, tiny_model
    base = tiny_model("llama", layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2).cuda()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = batch(batch_size=2, seq=128).cuda()

    def step(model):
        with torch.autocast("cuda", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    normal = step(clone(base))
    model = clone(base)
    attnstash.install_attention_stash(model)
    before = attnstash.stash_stats()
    try:
        loss = step(model)
    finally:
        attnstash.uninstall_attention_stash(model)
    after = attnstash.stash_stats()
    assert torch.equal(loss, normal)
    assert after["keeps"] - before["keeps"] == 2 and after["replays"] - before["replays"] == 2
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_cuda_budget_keeps_the_last_layer_and_never_passes_its_bytes(use_reentrant):
    """A budget that fits one of two layers on the GPU: the last layer keeps, the first is
    declined (its recompute runs attention), the bytes held never pass the budget, and the
    loss is bitwise the normal recompute's."""
    from tiny_models import batch, clone, tiny_model
    base = tiny_model("llama", layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    base = base.to("cuda", torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = batch(batch_size=2, seq=128).cuda()

    def step(model, max_bytes=None):
        if max_bytes is not False:
            attnstash.install_attention_stash(model, max_bytes=max_bytes)
        try:
            loss = model(input_ids=ids, labels=ids).loss
            held = attnstash.layer_stash_stats(model) if max_bytes is not False else None
            loss.backward()
            stats = attnstash.stash_stats()
        finally:
            if max_bytes is not False:
                attnstash.uninstall_attention_stash(model)
            attnstash.stash_set_max_bytes(None)
        return loss.detach(), held, stats

    normal, _, _ = step(clone(base), max_bytes=False)
    _, unlimited, _ = step(clone(base))
    one = unlimited[1].bytes  # what one layer keeps
    assert unlimited[0].bytes == one > 0
    loss, held, stats = step(clone(base), max_bytes=one)
    assert torch.equal(loss, normal)
    assert held == {0: (1, 0, 1), 1: (1, one, 0)}
    assert stats["peak_bytes"] <= one and stats["records"] == 0
