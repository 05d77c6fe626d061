"""A layer refused because of the device planned for says so: that the plan is for CUDA (the
compute capability planned for, or the GPU here), and the plans that would keep it (for the CPU:
--device cpu / device="cpu"; in bf16: --dtype bf16 / dtype="bf16"). CUDA is the default device of
the command (and of attnstash.plan for a config), and an fp32 model's grouped K/V run math there."""
import os

import pytest
import torch
from torch.nn.attention import SDPBackend

import attnstash
from attnstash.planner.__main__ import main
from plan_cases import HF4
from tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "examples", "configs", "Llama-3.1-8B.json")
# transformers 4.57 repeats K/V under the 4-D mask it builds in training: memory-efficient attention
# takes fp32 on CUDA, and nothing is refused.
grouped_kv = pytest.mark.skipif(HF4, reason="transformers 4.57 passes no grouped K/V in training")
CPU_WAY = 'for the CPU (flash_attention: plan with --device cpu, or device="cpu" in attnstash.plan)'
BF16_WAY = 'in bf16 on CUDA (cudnn_attention: --dtype bf16, or dtype="bf16")'


def planned_for(sm="sm90"):
    if torch.cuda.is_available():
        return f"This plan is for cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()}, sm"
    return f"This plan is for CUDA {sm} (no CUDA device here; --sm or cuda_capability= plans for another)"


@grouped_kv
def test_an_fp32_plan_for_cuda_says_it_is_for_cuda_and_how_to_plan_otherwise():
    p = attnstash.plan(tiny_config("llama"), batch_size=2, seq_len=16, dtype="fp32")  # device: CUDA, the default
    assert p.device == "cuda" and all(c.backend == SDPBackend.MATH for layer in p.layers for c in layer.calls)
    for layer in p.layers:
        assert layer.refused.startswith("F.sdpa would run math on cuda, which the stash cannot keep")
        assert planned_for() in layer.refused
        assert layer.refused.endswith(f"The stash would keep it planned {CPU_WAY} or {BF16_WAY}."), layer.refused
    # ... and the plans it names keep every layer.
    for other in (dict(dtype="fp32", device="cpu"), dict(dtype="bf16")):
        q = attnstash.plan(tiny_config("llama"), batch_size=2, seq_len=16, **other)
        assert not any(layer.refused for layer in q.layers) and q.total_bytes > 0, str(q)


@grouped_kv
def test_the_command_says_it_too(capsys):
    assert main([LLAMA, "--batch", "1", "--seq", "64", "--dtype", "fp32", "--sm", "80"]) == 0
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if line.startswith("refused, layers 0-31: ")]
    assert len(refused) == 1, out
    assert planned_for("sm80") in refused[0] and "--device cpu" in refused[0] and "--dtype bf16" in refused[0]
    if not torch.cuda.is_available():  # the rules for sm80, which tries flash first
        assert BF16_WAY.replace("cudnn_attention", "flash_attention") in refused[0]


def test_only_the_plans_that_would_keep_it_are_named():
    # head_dim 6: not a multiple of 8 (cuDNN; the kept CUDA flash), nor of 4 (fp32 memory-efficient
    # attention): in bf16 on CUDA the stash refuses it too; the CPU's flash keeps it.
    p = attnstash.plan(tiny_config("llama", head_dim=6), batch_size=2, seq_len=16, dtype="fp32", device="cuda")
    for layer in p.layers:
        assert planned_for() in layer.refused and layer.refused.endswith(f"The stash would keep it planned {CPU_WAY}.")
        assert "bf16" not in layer.refused
    # a backend forced: the CPU is no way out (the backend is CUDA's); fp16 is one already
    p = attnstash.plan(tiny_config("llama", head_dim=6), batch_size=2, seq_len=16, dtype="fp16", device="cuda",
                       backend="cudnn")
    assert all(layer.refused.endswith(planned_for() + ".") or (torch.cuda.is_available() and "This plan is for"
                                                                in layer.refused) for layer in p.layers), str(p)


def test_a_refusal_that_no_device_changes_names_none():
    p = attnstash.plan(tiny_config("llama", attention_dropout=0.1), batch_size=2, seq_len=16, dtype="bf16",
                       device="cuda")
    assert all(layer.refused.startswith("attention dropout (0.1)") and "This plan is for" not in layer.refused
               for layer in p.layers)
    cpu = attnstash.plan(tiny_config("llama", head_dim=6), batch_size=2, seq_len=16, dtype="fp32", device="cpu")
    assert not any(layer.refused for layer in cpu.layers)
