"""attnstash.plan for CUDA. Without a GPU, the rules (attnstash/planner/cuda_rules.py) pick the
backend torch's documented choice gives and honour the settings torch honours; on a GPU (these
tests skip without CUDA) the plan is what each CUDA backend, and torch's own choice, keeps, and
the rules pick what torch picks."""
import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnstash
from attnstash.planner import cuda_rules, plan
from plan_cases import HF4, config_of, ids_and_mask, installed, measured, needs_cuda, no_cuda
from tiny_models import tiny_config


# ---- the rules for CUDA without a GPU ---------------------------------------------------------

def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


B, S = 2, 256
RULES = [  # (what, query, key/value, head dim v, mask?, is_causal, enable_gqa, dtype, capability) -> backend
    ("GQA bf16 on sm90: cuDNN first", 32, 4, 128, False, True, True, torch.bfloat16, (9, 0), "CUDNN_ATTENTION"),
    ("GQA bf16 on sm80: flash", 32, 4, 128, False, True, True, torch.bfloat16, (8, 0), "FLASH_ATTENTION"),
    ("masked bf16 on sm80: efficient", 8, 8, 128, True, False, False, torch.bfloat16, (8, 0), "EFFICIENT_ATTENTION"),
    ("masked bf16 on sm90: cuDNN", 8, 8, 128, True, False, False, torch.bfloat16, (9, 0), "CUDNN_ATTENTION"),
    ("GQA fp32: only math", 32, 4, 128, False, True, True, torch.float32, (9, 0), "MATH"),
    ("MHA fp32: efficient", 8, 8, 128, False, True, False, torch.float32, (9, 0), "EFFICIENT_ATTENTION"),
    ("head dim 256 bf16 on sm90: cuDNN", 8, 8, 256, False, True, False, torch.bfloat16, (9, 0), "CUDNN_ATTENTION"),
    ("head dim 256 bf16 on sm100: flash", 8, 8, 256, False, True, False, torch.bfloat16, (10, 0),
     "FLASH_ATTENTION"),
    ("head dim 72 bf16 on sm90: not cuDNN (% 8 is fine: 72), cuDNN", 8, 8, 72, False, True, False, torch.bfloat16,
     (9, 0), "CUDNN_ATTENTION"),
    ("head dim 20 bf16 on sm90: flash (cuDNN needs % 8)", 8, 8, 20, False, True, False, torch.bfloat16, (9, 0),
     "FLASH_ATTENTION"),
]


@pytest.mark.parametrize("case", RULES, ids=[r[0] for r in RULES])
def test_the_cuda_rules_pick_the_documented_backend(case):
    _, hq, hkv, d, masked, causal, gqa, dtype, capability, expected = case
    q, k, v = meta(B, hq, S, d, dtype=dtype), meta(B, hkv, S, d, dtype=dtype), meta(B, hkv, S, d, dtype=dtype)
    mask = meta(B, 1, S, S, dtype=torch.bool) if masked else None
    chosen, why = cuda_rules.cuda_backend_without_device(q, k, v, mask, 0.0, causal, gqa, capability=capability)
    assert chosen == getattr(SDPBackend, expected), why


def test_the_cuda_rules_honour_the_settings_torch_honours(monkeypatch):
    q, k = meta(B, 32, S, 128), meta(B, 4, S, 128)

    def choice(**kw):
        return cuda_rules.cuda_backend_without_device(q, k, k, None, 0.0, True, True, **kw)[0]

    assert choice() == SDPBackend.CUDNN_ATTENTION
    assert choice(cudnn_version=91400) == SDPBackend.FLASH_ATTENTION
    assert choice(capability=(8, 9)) == SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert choice() == SDPBackend.MATH  # efficient takes no grouped K/V
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert choice() == SDPBackend.FLASH_ATTENTION
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert choice() == SDPBackend.FLASH_ATTENTION
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    torch.use_deterministic_algorithms(True)
    try:
        assert choice() == SDPBackend.FLASH_ATTENTION
    finally:
        torch.use_deterministic_algorithms(False)


@no_cuda
def test_cuda_flash_with_a_head_dim_not_a_multiple_of_8_is_refused_as_the_stash_refuses_it():
    cfg = tiny_config("llama", head_dim=12)
    p = plan(cfg, batch_size=2, seq_len=32, dtype="bf16", device="cuda", cuda_capability=(8, 0))
    if HF4:  # transformers 4.57 passes a mask: no flash, and memory-efficient needs head dims % 8: math
        assert p.layers[0].calls[0].backend == SDPBackend.MATH
        assert all("math" in layer.refused for layer in p.layers)
    else:
        assert p.layers[0].calls[0].backend == SDPBackend.FLASH_ATTENTION
        assert all("not a multiple of 8" in layer.refused for layer in p.layers)


# ---- on a GPU ---------------------------------------------------------------------------------

GPU_CASES = [  # (backend, arch, padded): efficient takes no grouped K/V, so unpadded it needs MHA
    (SDPBackend.CUDNN_ATTENTION, "llama", False), (SDPBackend.CUDNN_ATTENTION, "llama", True),
    (SDPBackend.FLASH_ATTENTION, "llama", False),
    (SDPBackend.EFFICIENT_ATTENTION, "llama_mha", False), (SDPBackend.EFFICIENT_ATTENTION, "llama", True),
    (SDPBackend.CUDNN_ATTENTION, "qwen3_moe", False), (SDPBackend.EFFICIENT_ATTENTION, "qwen3_moe", True),
]


def gpu_model(arch):
    torch.manual_seed(0)
    cfg = tiny_config("llama", num_key_value_heads=4) if arch == "llama_mha" else config_of(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.to(device="cuda", dtype=torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


@needs_cuda
@pytest.mark.parametrize("backend, arch, padded", GPU_CASES,
                         ids=[f"{b.name}-{a}-{'padded' if p else 'unpadded'}" for b, a, p in GPU_CASES])
def test_on_the_gpu_the_plan_is_what_each_backend_keeps(backend, arch, padded):
    if HF4 and backend == SDPBackend.FLASH_ATTENTION:
        pytest.skip("transformers 4.57 passes a mask in training, which flash does not take")
    model = gpu_model(arch)
    p = plan(model, batch_size=3, seq_len=32, backend=backend, padded=padded)
    assert p.device == "cuda" and all(c.backend == backend for layer in p.layers for c in layer.calls), str(p)
    with sdpa_kernel([backend]):
        held, declined = measured(model, padded, device="cuda", seq=32)
    assert declined == 0 and p.per_layer_bytes == held


@needs_cuda
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_on_the_gpu_the_plan_is_what_torchs_own_choice_keeps(padded):
    model = gpu_model("qwen3_moe")
    p = plan(model, batch_size=3, seq_len=32, padded=padded)
    held, _ = measured(model, padded, device="cuda", seq=32)
    assert p.per_layer_bytes == held, str(p)


@needs_cuda
def test_on_the_gpu_flash_with_a_mask_is_refused_as_the_stash_refuses_it():
    model = gpu_model("llama")
    p = plan(model, batch_size=3, seq_len=32, backend="flash", padded=True)
    assert all(layer.refused for layer in p.layers)
    ids, kwargs = ids_and_mask(True, seq=32, device="cuda")
    with installed(model), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError):
            model(input_ids=ids, labels=ids, **kwargs)
    assert attnstash.stash_stats()["records"] == 0


GPU_SHAPES = [  # (query heads, kv heads, qk dim, v dim, masked, causal, gqa, dtype)
    (32, 4, 128, 128, False, True, True, torch.bfloat16), (8, 8, 128, 128, True, False, False, torch.bfloat16),
    (8, 8, 64, 64, False, True, False, torch.float16), (32, 4, 128, 128, False, True, True, torch.float32),
    (8, 8, 128, 128, False, True, False, torch.float32), (8, 8, 256, 256, False, True, False, torch.bfloat16),
    (8, 8, 192, 128, False, True, False, torch.bfloat16), (8, 8, 192, 128, True, False, False, torch.bfloat16),
    (8, 8, 20, 20, False, True, False, torch.bfloat16), (8, 8, 72, 72, True, False, False, torch.bfloat16),
]


@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "-".join(str(x).replace("torch.", "") for x in s))
def test_on_the_gpu_the_rules_pick_what_torch_picks(shape):
    hq, hkv, dqk, dv, masked, causal, gqa, dtype = shape
    q = torch.empty(2, hq, 256, dqk, dtype=dtype, device="cuda")
    k = torch.empty(2, hkv, 256, dqk, dtype=dtype, device="cuda")
    v = torch.empty(2, hkv, 256, dv, dtype=dtype, device="cuda")
    mask = torch.ones(2, 1, 256, 256, dtype=torch.bool, device="cuda") if masked else None
    torch_choice = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=gqa))
    ruled, why = cuda_rules.cuda_backend_without_device(q, k, v, mask, 0.0, causal, gqa,
                                                      capability=torch.cuda.get_device_capability(),
                                                      cudnn_version=torch.backends.cudnn.version())
    assert ruled == torch_choice, why
