"""examples/demo.py at tiny sizes on CPU (the README's main job, `make demo`): every
configuration trains with losses bitwise equal to plain checkpointing, the stash keeps exactly
the bytes predicted and never more than its budget, and nothing is installed after. Timings are
recorded, never asserted."""
import importlib.util
import json

import attnstash
from helpers import nothing_installed
from test_bench import ROOT, D, H, S, kept


def load_demo():
    spec = importlib.util.spec_from_file_location("attnstash_demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_trains_every_configuration_with_equal_losses(tmp_path):
    demo = load_demo()
    budget_before = attnstash.stash_max_bytes()
    report = demo.main(["--steps", "2", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "8", "--seq", "64", "--amp-steps", "2", "--amp-seq", "32", "--budget-steps", "6",
                        "--min-seq", "16", "--lora-steps", "2", "--lora-tokens", "32", "--no-progress",
                        "--out", str(tmp_path)])
    assert attnstash.stash_max_bytes() == budget_before and demo.all_equal(report)
    plain, amp, budget, lora = (report[k] for k in ("plain", "amp", "budget", "diffusers-lora"))
    assert plain["same_initial_weights"] and plain["losses"]["plain"] == plain["losses"]["stash"]
    assert plain["kept_by_layer"] == {"0": kept(1, H, S, D), "1": kept(1, H, S, D)} == {
        "0": plain["predicted_bytes_per_layer"], "1": plain["predicted_bytes_per_layer"]}
    assert amp["shape"]["dtype"] == "fp32" and amp["autocast"] == "bf16"
    assert amp["kept_bytes"] == 2 * kept(1, H, 32, D, 2)
    assert budget["max_bytes"] == kept(1, H, S, D) and budget["declined"] > 0 and budget["keeps"] > 0
    for step in budget["per_step"]:
        assert 16 <= step["seq"] <= 64 and step["peak_bytes"] <= budget["max_bytes"]
        assert step["bytes"] == step["predicted_held"] and step["keeps"] + step["declined"] == 2
    # LoRA on a Flux transformer: 4 blocks (2 double, 2 single), each one joint attention over 32 + 64 tokens.
    assert lora["losses_bitwise_equal"] == [True, True] and lora["stashed"] == [0, 1, 2, 3]
    assert lora["kept_bytes"] == 4 * kept(1, 4, 32 + 64, 32) == 4 * lora["predicted_bytes_per_layer"]
    assert lora["losses"]["plain"][0] != lora["losses"]["plain"][1]  # the adapters train
    assert json.loads((tmp_path / "demo.json").read_text())["budget"]["per_step"] == budget["per_step"]
    assert (tmp_path / "demo.png").stat().st_size > 0 and (tmp_path / "demo_budget.png").stat().st_size > 0
    assert nothing_installed()


def test_the_demo_tokenizer_round_trips_bytes():
    tok = load_demo().ByteTokenizer()
    text = "Low water, ferry — 7 passengers"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < tok.vocab_size
