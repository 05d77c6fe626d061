"""The supported-model sweep (tests/python/sweep/) on a fast subset of model types, one per
distinct path through the installer, in this process; the full sweep of every model type of
the installed transformers runs with ATTNSTASH_FULL_SWEEP=1 (or `python
tests/python/sweep_models.py`, which writes the table).

Each case: the outcome is not FAILED and is the one expected; a supported type is bitwise
equal to the normal recompute in every combination (reentrant and non-reentrant; unpadded,
and left-padded where it takes text with a mask), with one keep per stashed attention call,
one replay per keep (or its release with the graph where no backward reaches the layer) and
nothing held after, and its stashed layers include the parts named (encoder and decoder,
vision tower and language model).

The fast subset takes under 30 seconds per transformers release on the 2-core machine (one
thread, the machine otherwise busy; pytest's own figure): 12 s under 5.25.0, 16 s under
5.24.0, 17 s under 5.17.0, 23 s under 4.57.6.
"""
import os

import pytest
import torch
import transformers

import sweep
from attnstash import attention_layers
from attnstash.backends import chosen_backend, kept_backend
from attnstash.install import find_layers
from sweep import category, check_arch
from sweep.inputs import KINDS

RELEASE = tuple(int(n) for n in transformers.__version__.split(".")[:2])


def falcon_attention_is_kept():
    """Whether the installed torch runs Falcon's multi-query attention (a key and value of one
    head for four query heads, without enable_gqa: F.sdpa broadcasts them) on CPU with a backend
    attnstash keeps. torch 2.13 runs it on math, which attnstash refuses; 2.15 on CPU flash."""
    q = torch.empty(2, 4, 24, 16, requires_grad=True)
    kv = torch.empty(2, 1, 24, 16, requires_grad=True)
    return kept_backend("cpu", chosen_backend(q, kv, kv, is_causal=True)) is not None


FALCON_KEPT = falcon_attention_is_kept()


def for_this_release(value):
    """A FAST value as it is, or the one of {release: value} (keys "4", "5", "5.3", ...: from
    that release on) for the installed transformers."""
    if not isinstance(value, dict):
        return value
    def release(key):
        return tuple(map(int, key.split(".")))
    return value[max((k for k in value if release(k) <= RELEASE), key=release)]

# arch -> (expected outcome: a prefix of it; a text it must contain, or None; parts of layer
# names that must be among those stashed; what path it covers), each of the first three
# either as it is or {the transformers release it holds from: value} (for_this_release). Types
# the installed transformers does not have are skipped.
TEXT, ENC_DEC, VLM = ("layers",), ("encoder", "decoder"), ("vision", "language_model")
FAST = {
    "llama": ("supported", None, TEXT, "the reference decoder"),
    "gpt2": ("supported", None, ("h.",), "attention named `attn`, Conv1D projections, no rotary"),
    "gpt_neox": ("supported", None, TEXT, "attention named `attention`, partial rotary"),
    "deepseek_v3": ("supported", None, TEXT, "MoE with multi-head latent attention"),
    "granitemoehybrid": ("supported", None, TEXT, "Mamba-2 and attention layers, MoE"),
    "qwen3_next": ("supported", None, TEXT, "linear attention (gated delta rule) and attention layers"),
    "longcat_flash": ("supported", None, TEXT, "two attention modules per layer, in a ModuleList"),
    "gemma3_text": ("supported", None, TEXT, "sliding-window and full-attention layers"),
    "zamba2": ({"4": "refused at install", "5": "not buildable", "5.4": "supported"}, None, TEXT,
               "one attention block shared by several hybrid layers (4.57: no GradientCheckpointingLayer; "
               "5.0 to 5.3: the model's own training step fails, no rotary_emb)"),
    "hrm_text": ("supported", None, (), "layers run several times per forward, some under no_grad"),
    "falcon": ({"4": "supported" if FALCON_KEPT else "refused at run", "5.25": "supported"},
               {"4": None if FALCON_KEPT else "math backend", "5.25": None}, (),
               "before 5.25, attention that calls F.scaled_dot_product_attention directly, with one K/V head "
               "broadcast to the query heads: kept where torch runs it on a kept backend (CPU flash), refused "
               "where on math; from 5.25 through transformers' attention functions, supported"),
    "diffllama": ({"4": "refused at run", "5.13": "supported"}, {"4": "math backend", "5.13": None}, TEXT,
                  "two attention calls per attention module (5.13 on); F.sdpa directly, on math (before)"),
    "doge": ("refused at run", "requires grad", (),
             "an AttentionInterface of its own, and a learned (dynamic) mask that requires grad"),
    "inkling_text": ("refused at run", "requires grad", (), "a learned position bias, folded into the mask"),
    "bert": ("supported", None, ("bert.",), "an encoder under its masked-LM head, padded"),
    "modernbert": ("supported", None, ("layers",),
                   "an encoder with global and sliding-window attention layers (4.57: attention through a "
                   "module-level function table, which the installer follows)"),
    "bart": ("supported", None, ENC_DEC, "an encoder-decoder: self- and cross-attention in the decoder layers"),
    "t5": ({"4": "skipped", "5.15": "refused at run"}, {"4": "no SDPA", "5.15": "requires grad"}, (),
           "an encoder-decoder whose position bias is a parameter, in the mask (before 5.15: no SDPA)"),
    "whisper": ({"5": "supported", "4": "not buildable"}, {"5": None, "4": "non-reentrant/unpadded: supported"},
                ENC_DEC, "speech seq2seq: input_features into the encoder (4.57: its reentrant step fails without "
                         "the stash, the encoder's output reaching the decoder layers' recomputes undetached)"),
    "vit": ("supported", None, ("vit.",), "an image classifier: pixel_values, no mask"),
    "siglip": ("supported", None, ("vision_model",), "a vision tower (SigLIP's) under an image-classification head"),
    "llava": ("supported", None, VLM, "a vision tower and a text decoder, image placeholder tokens"),
    "qwen2_vl": ("supported", None, ("visual", "language_model"),
                 "one attention call per image in each vision block, images of different sizes"),
    "qwen3_vl": ("supported", None, ("visual", "language_model"),
                 "Qwen2-VL's path with deepstack features fed into the decoder"),
}
# Types whose vision blocks call attention once per image: more calls for more images.
PER_IMAGE = ("qwen2_vl", "qwen3_vl")
NO_TEXT = ("whisper", "vit", "siglip")  # no text with an attention_mask: unpadded only


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread, and a busy machine does not stall them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", list(FAST))
def test_fast_subset(arch, one_thread):
    if arch not in sweep.model_types():
        pytest.skip(f"{arch} is not a model type of this transformers")
    expected, text, parts, _ = (for_this_release(v) for v in FAST[arch])
    row = check_arch(arch)
    assert category(row["outcome"]) != "FAILED", row["outcome"]
    assert row["outcome"].startswith(expected), row["outcome"]
    assert text is None or text in row["outcome"], row["outcome"]
    if expected.startswith("refused"):  # by attnstash, with nothing left held (check_arch checks that too)
        assert row["outcome"].split(": ", 1)[1].startswith("attnstash"), row["outcome"]
    if expected != "supported":
        return
    assert row["stashed"] == row["attention_layers"] and row["stashed"]
    assert row["batches"] == (["unpadded"] if arch in NO_TEXT else list(KINDS)), row["batches"]
    assert len(row["combos"]) == 2 * len(row["batches"])
    for combo, result in row["combos"].items():
        assert result["status"] == "bitwise", (combo, result)
        assert result["keeps"] == result["expected"] > 0, (combo, result)
        # (a layer whose output no backward reaches, such as the vision tower's last layer
        # where the features come from the one before, keeps and is released unreplayed)
        assert result["replays"] + result["released_unused"] == result["keeps"], (combo, result)
        assert result["replays"] > 0 and not result["misses"] and not result["declined"], (combo, result)
    names = row["attention_layer_names"]
    for part in parts:
        assert any(part in name for name in names), (part, names)
    if arch in PER_IMAGE:  # three images (padded batch) call attention more often than two
        probe = row["probe"]
        assert probe["left-padded"]["attention_calls"] > probe["unpadded"]["attention_calls"] > len(names), probe


def test_the_probe_names_checkpointed_attention_outside_the_layers_found(monkeypatch, one_thread):
    """A checkpointed layer the installer does not find would run its attention again in the
    recompute unseen: the probe names where, and the stash's recomputed counter counts it (either
    fails the type in check_arch). Here the installer is made to miss the last decoder layer."""
    import copy

    import attnstash
    from sweep import inputs, run
    row = run.new_row("llama")
    head, base = run._build("llama", row)
    batch = inputs.batch(base, head, "unpadded")
    assert run.probe(copy.deepcopy(base), batch)[3] == {}
    # With the stash on, stash_stats()["recomputed"] sees it too (here: one layer left out).
    reference = run.train_step(run._copy(base, "reentrant"), batch)
    install = attnstash.install_attention_stash
    monkeypatch.setattr(attnstash, "install_attention_stash", lambda model: install(model, 3))
    result = run._stash_combo(base, "reentrant", batch, reference, 4)
    assert result["status"] == "failed" and result["recomputed"] == 1, result
    assert "recomputed outside the stash +1" in result["detail"], result
    found = attnstash.attention_layers
    monkeypatch.setattr(attnstash, "attention_layers", lambda model: found(model)[:-1])
    assert run.probe(copy.deepcopy(base), batch)[3] == {"model.layers.3.self_attn": 1}


def test_hybrid_layers_have_at_least_two_attention_layers():
    """The tiny hybrids keep their non-attention layers and have two attention layers."""
    archs = [a for a in ("granitemoehybrid", "qwen3_next") if a in sweep.model_types()]
    if not archs:
        pytest.skip("no hybrid of the list in this transformers")
    for arch in archs:
        _, model = sweep.build(arch)
        found = [i for i, _, _ in attention_layers(model)]
        layers = len(find_layers(model))
        assert len(found) >= 2 and layers > len(found), (arch, found, layers)


def test_every_model_type_has_one_head():
    """Every type of the auto mappings gets a row, under the first head of the priority list
    whose mapping has it (the base model only for those no other head lists)."""
    types = sweep.model_types()
    from transformers.models.auto import modeling_auto
    assert set(modeling_auto.MODEL_MAPPING_NAMES) <= set(types)
    assert types["bert"][0] == "masked LM" and types["bart"][0] == "seq2seq LM"
    assert types["whisper"][0] == "speech seq2seq" and types["vit"][0] == "image classification"
    assert types["llama"][0] == "causal LM" and types["llava"][0] == "image-text-to-text"


@pytest.mark.skipif(os.environ.get("ATTNSTASH_FULL_SWEEP") != "1",
                    reason="the full sweep takes 5 to 10 minutes: set ATTNSTASH_FULL_SWEEP=1 (or run make sweep)")
def test_full_sweep_has_no_failed_rows():
    rows = sweep.sweep(list(sweep.model_types()), jobs=1, timeout=300)
    failed = [row for row in rows if category(row["outcome"]) == "FAILED"]
    assert not failed, sweep.markdown(failed)
