"""attnstash.plan (attnstash/planner): the bytes it predicts per attention layer are the bytes the stash then
holds, on tiny Hugging Face models (dense, grouped K/V, mixture of experts, a Mamba hybrid,
MLA), fp32 and bf16, with and without padding; the layers that fit a budget are the ones
install_attention_stash keeps under that budget; the command prints the table for the
example configs; bad input is refused clearly. GPU tests (skipped without CUDA) compare the
prediction with what the CUDA backends keep, and the no-GPU rules with torch's own choice."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import attnstash
from attnstash import backends
from attnstash.planner import StashPlan, cuda_rules, plan
from attnstash.planner.__main__ import main
from attnstash.planner.sources import read_config
from tiny_models import VOCAB, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "examples", "configs")
CUDA = torch.cuda.is_available()
HF4 = int(transformers.__version__.split(".")[0]) < 5
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(CUDA, reason="decides by torch, not by the rules, where a CUDA GPU is present")

# Tiny configs beyond tests/python/tiny_models.py: a Mamba hybrid (attention on layers 1 and
# 3 only) and MLA (DeepSeek-V3: query/key head dim 24, value head dim 16; or equal dims).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, use_cache=False, tie_word_embeddings=False)
EXTRA = {
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16,
                  mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16, mamba_expand=2),
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1, n_shared_experts=1),
}
EXTRA["deepseek_v3_equal_dims"] = dict(EXTRA["deepseek_v3"], qk_nope_head_dim=8, qk_rope_head_dim=8)


def config_of(arch):
    if arch == "mistral_sliding":  # a sliding window shorter than the sequence: Hugging Face passes a mask
        return tiny_config("mistral", sliding_window=8)
    if arch in ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe"):
        return tiny_config(arch)
    model_type = "deepseek_v3" if arch.startswith("deepseek_v3") else arch
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **EXTRA[arch]})


def model_of(arch, dtype=torch.float32, device="cpu"):
    """A tiny model with random weights, train mode, reentrant checkpointing, SDPA."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of(arch), attn_implementation="sdpa")
    model.to(device=device, dtype=dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def ids_and_mask(padded, batch=3, seq=24, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g).to(device)
    if not padded:
        return ids, {}
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[0, :5] = 0  # left padding of different lengths
    mask[1, :2] = 0
    return ids, {"attention_mask": mask}


@contextlib.contextmanager
def installed(model, n=None, max_bytes=None):
    layers = attnstash.install_attention_stash(model, n, max_bytes=max_bytes)
    try:
        yield layers
    finally:
        attnstash.uninstall_attention_stash(model)
        attnstash.stash_set_max_bytes(None)


def measured(model, padded, device="cpu", n=None, max_bytes=None, seq=24):
    """{layer: bytes} the stash holds after one training forward (all attention layers
    stashed, or the last n), and the number of declined keeps; the backward then releases."""
    ids, kwargs = ids_and_mask(padded, seq=seq, device=device)
    with installed(model, n, max_bytes):
        declined = attnstash.stash_stats()["declined"]
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        held = attnstash.layer_stash_stats(model)
        declined = attnstash.stash_stats()["declined"] - declined
        loss.backward()
    assert attnstash.stash_stats()["entries"] == 0
    return {layer: h.bytes for layer, h in held.items()}, declined


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
    assert attnstash.stash_stats()["entries"] == 0


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


# ---- the command and the example configs ----------------------------------------------------

EXAMPLES = {  # bf16, batch 4, seq 4096, cuDNN: output + LSE [B, H, S, 1] fp32 + two 8-byte philox scalars
    "Qwen3-30B-A3B.json": (48, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Llama-3.1-8B.json": (32, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Mistral-7B-v0.3.json": (32, 4 * 32 * 4096 * 128 * 2 + 4 * 32 * 4096 * 4 + 16),
    "Qwen2.5-7B.json": (28, 4 * 28 * 4096 * 128 * 2 + 4 * 28 * 4096 * 4 + 16),
}


def run_main(capsys, *argv):
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_example_configs_are_shipped():
    assert sorted(os.listdir(CONFIGS)) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_command_prints_each_example_configs_table(name, capsys):
    layers, per_layer = EXAMPLES[name]
    out = run_main(capsys, os.path.join(CONFIGS, name), "--batch", "4", "--seq", "4096", "--dtype", "bf16",
                   "--backend", "cudnn", "--max-bytes", "8GiB")
    assert f"{per_layer:,}" in out and "cudnn_attention" in out
    assert f"all {layers} attention layers stashed: {layers * per_layer:,} bytes" in out
    fit = min(layers, 8 * 2**30 // per_layer)
    assert f"the last {fit} of {layers} attention layers fit" in out


def test_the_function_returns_the_table_the_command_prints(capsys):
    path = os.path.join(CONFIGS, "Llama-3.1-8B.json")
    out = run_main(capsys, path, "--batch", "2", "--seq", "256", "--max-bytes", "100MB", "--padded", "--sm", "80")
    p = plan(path, batch_size=2, seq_len=256, device="cuda", max_bytes="100MB", padded=True, cuda_capability=(8, 0))
    assert out == str(p) + "\n"
    assert p.dtype == torch.bfloat16  # the config's torch_dtype
    assert p.max_bytes == 10**8 and p.layers_that_fit == p.layers_within(10**8)
    assert [layer.index for layer in p.layers] == list(range(32)) and p.layers_found == 32


@no_cuda
def test_qwen3_30b_a3b_plans_cudnn_on_hopper_as_the_seed_measured(capsys):
    """The seed measured 136,314,896 bytes per stashed layer and micro-batch at this shape on
    an H200 (cuDNN). Without a GPU the rules decide: torch >= 2.11 on sm90 tries cuDNN first."""
    path = os.path.join(CONFIGS, "Qwen3-30B-A3B.json")
    out = run_main(capsys, path, "--batch", "4", "--seq", "4096")
    assert "136,314,896" in out and "cudnn_attention" in out and "no CUDA device here" in out
    assert "the CUDA wheels of torch 2.11 to 2.15" in out or torch.backends.cudnn.version()
    assert "[4, 32, 4096, 128]" in out  # the query: 32 heads of 128
    if HF4:  # transformers 4.57 builds a 4-D mask in training (it checks for packed sequences) and repeats K/V
        assert "[4, 1, 4096, 4096] bool" in out and "[4, 32, 4096, 128]  [4, 32, 4096, 128]" in out
    else:  # transformers 5: no mask (is_causal), grouped K/V: 4 KV heads
        assert "causal" in out and "[4, 4, 4096, 128]" in out
    # On an A100 (sm80) cuDNN is not tried first: flash without a mask (its extras are a
    # 2-element uint64 rng state and a uint64 scalar), memory-efficient with one. (Llama-3.1-8B:
    # the same query shape, quicker to build than 128 experts a layer.)
    out = run_main(capsys, os.path.join(CONFIGS, "Llama-3.1-8B.json"), "--batch", "4", "--seq", "4096", "--sm", "80")
    if HF4:
        assert "efficient_attention" in out and "136,314,896" in out
    else:
        assert "flash_attention" in out and f"{136_314_880 + 24:,}" in out


def test_the_cpu_plan_has_no_extras(capsys):
    out = run_main(capsys, os.path.join(CONFIGS, "Qwen3-30B-A3B.json"), "--batch", "4", "--seq", "4096",
                   "--device", "cpu")
    assert "136,314,880" in out and "flash_attention" in out and "torch on cpu" in out


def test_python_dash_m_runs_the_command():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "attnstash.planner", os.path.join(CONFIGS, "Llama-3.1-8B.json"),
                           "--batch", "1", "--seq", "128", "--backend", "cudnn"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LlamaAttention" in done.stdout and f"{1 * 32 * 128 * 128 * 2 + 1 * 32 * 128 * 4 + 16:,}" in done.stdout


def test_attnstash_plan_is_callable_as_a_function():
    assert isinstance(attnstash.plan(config_of("llama"), batch_size=1, seq_len=8, dtype="fp32", device="cpu"), StashPlan)


# ---- bad input --------------------------------------------------------------------------------

def command_error(capsys, *argv):
    """The one line a bad command line prints (exit status 2), with no traceback."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_command_lines_say_what_is_wrong(tmp_path, capsys):
    good = os.path.join(CONFIGS, "Llama-3.1-8B.json")
    assert "no such config file" in command_error(capsys, str(tmp_path / "missing.json"), "--batch", "1", "--seq", "8")
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    assert "is not valid JSON" in command_error(capsys, str(broken), "--batch", "1", "--seq", "8")
    typeless = tmp_path / "typeless.json"
    typeless.write_text(json.dumps({"hidden_size": 64}))
    assert 'has no "model_type"' in command_error(capsys, str(typeless), "--batch", "1", "--seq", "8")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model"}))
    assert "no-such-model" in command_error(capsys, str(unknown), "--batch", "1", "--seq", "8")
    with open(good) as f:
        values = json.load(f)
    for field, bad, words in (("hidden_size", "abc", '"hidden_size" must be a number (like 4096), got \'abc\''),
                              ("num_attention_heads", -3, '"num_attention_heads" must be positive (like 32), got -3'),
                              ("intermediate_size", [1], '"intermediate_size" must be a number')):
        config = tmp_path / f"bad-{field}.json"
        config.write_text(json.dumps({**values, field: bad}))
        err = command_error(capsys, str(config), "--batch", "1", "--seq", "8")
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert "dtype must be one of" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--dtype", "int8")
    assert "cannot read '8 gigs' as a byte count" in command_error(capsys, good, "--batch", "1", "--seq", "8",
                                                                   "--max-bytes", "8 gigs")
    assert "batch_size must be a positive int, got 0" in command_error(capsys, good, "--batch", "0", "--seq", "8")
    assert "invalid int value" in command_error(capsys, good, "--batch", "four", "--seq", "8")
    assert "backend must be" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--backend", "fastest")
    assert "--sm (cuda_capability) must be a compute capability" in command_error(capsys, good, "--batch", "1", "--seq", "8",
                                                                "--sm", "hopper")
    assert "device" in command_error(capsys, good, "--batch", "1", "--seq", "8", "--device", "tpu")
    assert "required" in command_error(capsys, good, "--seq", "8")


def test_bad_arguments_to_the_function_say_what_is_wrong():
    cfg = config_of("llama")
    for bad, message in [(dict(batch_size=True), "got the bool"), (dict(seq_len=0), "seq_len must be a positive int"),
                         (dict(seq_len=2.5), "seq_len must be a positive int"), (dict(dtype="int8"), "dtype"),
                         (dict(max_bytes=-1), "byte count"), (dict(backend="fast"), "backend must be")]:
        args = {**dict(source=cfg, batch_size=1, seq_len=8, device="cpu"), **bad}
        with pytest.raises(ValueError, match=message):
            plan(**args)
    with pytest.raises(ValueError, match="expected a model, a transformers config"):
        plan(42, batch_size=1, seq_len=8)


def test_a_model_the_installer_refuses_is_refused_with_its_reasons():
    eager = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        plan(eager, batch_size=1, seq_len=8)
    # No attention at all: transformers refuses SDPA for it, or the installer finds no attention layers.
    mamba = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                                     use_cache=False)
    with pytest.raises(ValueError, match='cannot build mamba with attn_implementation="sdpa"|no attention layers'):
        plan(mamba, batch_size=1, seq_len=8, device="cpu")


def test_a_config_is_read_from_a_file_a_folder_or_a_dict_alike(tmp_path):
    values = json.load(open(os.path.join(CONFIGS, "Qwen2.5-7B.json")))
    (tmp_path / "config.json").write_text(json.dumps(values))
    plans = [plan(source, batch_size=1, seq_len=64, device="cpu", dtype="fp32")
             for source in (str(tmp_path / "config.json"), tmp_path, values)]
    assert read_config(tmp_path)[0] == values
    assert all(p.per_layer_bytes == plans[0].per_layer_bytes and len(p.layers) == 28 for p in plans)


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
    assert attnstash.stash_stats()["entries"] == 0


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
