"""attnstash.plan (attnstash/planner) on CPU: the bytes it predicts per attention layer are the
bytes the stash then holds, on tiny Hugging Face models (dense, grouped K/V, mixture of experts,
a Mamba hybrid, MLA), fp32 and bf16, with and without padding; the F.sdpa calls it sees are the
ones a training forward makes; the layers that fit a budget are the ones install_attention_stash
keeps under that budget."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import attnstash
from attnstash.planner import plan
from plan_cases import config_of, ids_and_mask, installed, measured


def model_of(arch, dtype=torch.float32, device="cpu"):
    """A tiny model with random weights, train mode, reentrant checkpointing, SDPA."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of(arch), attn_implementation="sdpa")
    model.to(device=device, dtype=dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


ARCHS = ["llama", "qwen2", "mixtral", "qwen3_moe", "bamba", "deepseek_v3_equal_dims"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_plan_is_what_the_stash_holds_after_a_training_forward(arch, dtype, padded):
    model = model_of(arch, dtype)
    predicted = plan(model, batch_size=3, seq_len=24, padded=padded)
    assert predicted.device == "cpu" and predicted.dtype == dtype
    held, declined = measured(model, padded)
    assert declined == 0
    assert predicted.per_layer_bytes == held
    assert all(b > 0 for b in held.values())
    assert predicted.total_bytes == sum(held.values())
    # From the config alone, the same.
    assert plan(config_of(arch), batch_size=3, seq_len=24, dtype=dtype, device="cpu", padded=padded).per_layer_bytes == held


def test_a_hybrid_counts_only_its_attention_layers():
    p = plan(config_of("bamba"), batch_size=3, seq_len=24, dtype="fp32", device="cpu")
    assert p.layers_found == 4 and list(p.per_layer_bytes) == [1, 3]
    # output [3, 4 heads, 24, 16] fp32 + LSE [3, 4, 24] fp32, CPU flash (no extras)
    assert set(p.per_layer_bytes.values()) == {3 * 4 * 24 * 16 * 4 + 3 * 4 * 24 * 4}


def test_mla_with_different_head_dims_is_refused_on_cpu_as_the_stash_refuses_it():
    # Query/key head dim 24, value head dim 16: CPU flash needs equal head dims, so F.sdpa runs math.
    model = model_of("deepseek_v3")
    p = plan(model, batch_size=3, seq_len=24)
    call = p.layers[0].calls[0]
    assert (call.query[-1], call.value[-1]) == (24, 16) and call.backend == SDPBackend.MATH
    assert all(layer.refused and layer.bytes is None for layer in p.layers)
    assert p.total_bytes == 0 and p.layers_within(10**12) == 0
    assert "refused" in str(p) and "math" in str(p)
    ids, _ = ids_and_mask(False)
    with installed(model):
        with pytest.raises(RuntimeError, match="(?i)math"):
            model(input_ids=ids, labels=ids)
    assert attnstash.stash_stats()["records"] == 0


# ---- the calls the plan sees ----------------------------------------------------------------

class _Calls(TorchFunctionMode):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask")
            self.calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape),
                               None if mask is None else (tuple(mask.shape), str(mask.dtype).replace("torch.", "")),
                               bool(kwargs.get("is_causal", False)), bool(kwargs.get("enable_gqa", False))))
        return func(*args, **kwargs)


@contextlib.contextmanager
def real_sdpa_calls():
    """The F.sdpa calls the sdpa entry makes, recorded (the entry restored after)."""
    calls = []
    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recorded(module, *args, **kwargs):
        with _Calls(calls):
            return original(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recorded
    try:
        yield calls
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("arch", ARCHS + ["mistral", "mistral_sliding", "deepseek_v3"])
def test_the_plan_sees_the_calls_a_training_forward_makes(arch, padded):
    """Shapes, mask, is_causal and enable_gqa decide the backend on CUDA; on CPU they are
    checked here against a real training forward (Hugging Face's own choices: whether it
    builds a mask, repeats K/V or passes enable_gqa)."""
    model = model_of(arch)
    ids, kwargs = ids_and_mask(padded)
    with real_sdpa_calls() as calls:
        model(input_ids=ids, **kwargs)
    p = plan(model, batch_size=3, seq_len=24, padded=padded)
    seen = [(c.query, c.key, c.value, c.mask, c.is_causal, c.enable_gqa) for layer in p.layers for c in layer.calls]
    assert seen == calls


# ---- the budget -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "bamba"])
def test_the_layers_that_fit_a_budget_are_the_ones_the_installer_keeps(arch):
    model = model_of(arch)
    p = plan(model, batch_size=3, seq_len=24)
    per_layer = list(p.per_layer_bytes.values())
    budget = sum(per_layer[-2:]) + per_layer[-3 if len(per_layer) > 2 else -1] // 2  # two and a half layers
    fit = plan(model, batch_size=3, seq_len=24, max_bytes=budget).layers_that_fit
    assert fit == min(2, len(per_layer)) and p.layers_within(budget) == fit
    assert p.layers_within(str(budget)) == fit  # strings as attnstash.parse_bytes reads them
    held, declined = measured(model, False, n=fit, max_bytes=budget)
    assert declined == 0 and list(held) == list(p.per_layer_bytes)[-fit:]
    if fit < len(per_layer):
        _, declined = measured(model, False, n=fit + 1, max_bytes=budget)
        assert declined == 1


def test_layers_are_counted_from_the_last():
    p = plan(config_of("llama"), batch_size=3, seq_len=24, dtype="fp32", device="cpu", max_bytes="1GiB")
    one = p.layers[0].bytes
    assert p.layers_that_fit == 3
    budgets = (0, one - 1, one, 2 * one, 3 * one - 1, 3 * one, 10 * one)
    assert [p.layers_within(n) for n in budgets] == [0, 0, 1, 2, 2, 3, 3]
    assert "the last 3 of 3 attention layers fit" in str(p)
