"""The supported-architecture sweep (tests/python/sweep_models.py) on a fast subset of
model types, one per distinct path through the installer, in this process; the full sweep
of every causal-LM type of the installed transformers runs with ATTNSTASH_FULL_SWEEP=1
(or `python tests/python/sweep_models.py`, which writes the table).

Each case: the outcome is not FAILED and is the one expected; a supported type is bitwise
equal to the normal recompute in all four combinations (reentrant and non-reentrant,
unpadded and left-padded), with one keep and one replay per stashed attention call and
nothing held after."""
import os

import pytest
import torch
import transformers

import sweep_models
from attnstash import attention_layers
from attnstash.install import find_layers
from sweep_models import category, check_arch

MAJOR = transformers.__version__.split(".")[0]

# arch -> (expected outcome: a prefix of it, or {transformers major version: prefix}; a text
# its message must contain, or None; what path it covers). Types the installed transformers
# does not have are skipped.
FAST = {
    "llama": ("supported", None, "the reference decoder"),
    "gpt2": ("supported", None, "attention named `attn`, Conv1D projections, no rotary"),
    "gpt_neox": ("supported", None, "attention named `attention`, partial rotary"),
    "deepseek_v3": ("supported", None, "MoE with multi-head latent attention"),
    "granitemoehybrid": ("supported", None, "Mamba-2 and attention layers, MoE"),
    "qwen3_next": ("supported", None, "linear attention (gated delta rule) and attention layers"),
    "longcat_flash": ("supported", None, "two attention modules per layer, in a ModuleList"),
    "gemma3_text": ("supported", None, "sliding-window and full-attention layers"),
    "zamba2": ({"5": "supported", "4": "refused at install"}, None,
               "one attention block shared by several hybrid layers (4.57: no GradientCheckpointingLayer)"),
    "hrm_text": ("supported", None, "layers run several times per forward, some under no_grad"),
    "falcon": ("refused at run", "math backend",
               "attention that calls F.scaled_dot_product_attention directly, with K/V F.sdpa runs on math"),
    "diffllama": ({"5": "supported", "4": "refused at run"}, None,
                  "two attention calls per attention module (5.x); F.sdpa directly, on math (4.57)"),
    "doge": ("refused at run", "requires grad",
             "an AttentionInterface of its own, and a learned (dynamic) mask that requires grad"),
    "inkling_text": ("refused at run", "requires grad", "a learned position bias, folded into the mask"),
}

@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread, and a busy machine does not stall them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", list(FAST))
def test_fast_subset(arch, one_thread):
    if arch not in sweep_models.causal_lm_types():
        pytest.skip(f"{arch} is not a causal-LM type of this transformers")
    expected, text, _ = FAST[arch]
    if isinstance(expected, dict):
        expected = expected[MAJOR]
    row = check_arch(arch)
    assert category(row["outcome"]) != "FAILED", row["outcome"]
    assert row["outcome"].startswith(expected), row["outcome"]
    assert text is None or text in row["outcome"], row["outcome"]
    if expected == "supported":
        assert row["stashed"] == row["attention_layers"] and row["stashed"]
        assert len(row["combos"]) == 4
        for combo, result in row["combos"].items():
            assert result["status"] == "bitwise", (combo, result)
            assert result["keeps"] == result["replays"] == result["expected"] > 0, (combo, result)
    else:  # refused: by attnstash, with nothing left held (check_arch checks that too)
        assert row["outcome"].split(": ", 1)[1].startswith("attnstash"), row["outcome"]


def test_hybrid_layers_have_at_least_two_attention_layers():
    """The tiny hybrids keep their non-attention layers and have two attention layers."""
    for arch in ("granitemoehybrid", "qwen3_next"):
        if arch not in sweep_models.causal_lm_types():
            continue
        model = sweep_models.build(arch)
        found = [i for i, _, _ in attention_layers(model)]
        layers = len(find_layers(model))
        assert len(found) >= 2 and layers > len(found), (arch, found, layers)


@pytest.mark.skipif(os.environ.get("ATTNSTASH_FULL_SWEEP") != "1",
                    reason="the full sweep takes about 10 minutes: set ATTNSTASH_FULL_SWEEP=1 (or run make sweep)")
def test_full_sweep_has_no_failed_rows():
    archs = list(sweep_models.causal_lm_types())
    rows = sweep_models.sweep(archs, jobs=os.cpu_count() or 1, timeout=300)
    failed = [row for row in rows if category(row["outcome"]) == "FAILED"]
    assert not failed, sweep_models.markdown(failed)
