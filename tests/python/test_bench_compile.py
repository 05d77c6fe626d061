"""bench --mode compile (benchmarks/compiled.py) at a tiny shape: every configuration
compiles, the stash's compiled runs keep the graphs of the runs without it and run half their
attention forwards, bitwise; SAC and the eager stash run one attention forward per call too;
the report is written and nothing is left installed or held."""
import json

import attnstash
import compile_cases  # noqa: F401 (puts the repository root, which holds benchmarks/, on sys.path)
from benchmarks.__main__ import main as bench_main
from helpers import nothing_installed

TINY = ["--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--seq", "32", "--batch", "2", "--repeats", "1", "--warmup", "0"]


def test_compile_mode(tmp_path):
    report = bench_main([*TINY, "--mode", "compile", "--backend", "aot_eager", "--out", str(tmp_path)])
    rows = {r["name"]: r for r in report["configs"]}
    assert set(rows) == {"compiled, reentrant", "compiled, non-reentrant", "compiled + stash, reentrant",
                         "compiled + stash, non-reentrant", "compiled SAC", "eager + stash"}
    for mode in ("reentrant", "non-reentrant"):
        plain, stash = rows[f"compiled, {mode}"], rows[f"compiled + stash, {mode}"]
        assert plain["graphs"] >= 1 and stash["graphs"] >= plain["graphs"] and stash["nodes"] >= plain["nodes"]
        assert plain["attention_forwards_per_step"] == 4 and stash["attention_forwards_per_step"] == 2  # 2 layers
        assert stash["bitwise_vs_reference"] is True and stash["reference"] == f"compiled, {mode}"
        assert isinstance(stash["saved_ms_per_layer"], float) and isinstance(stash["efficiency"], float)
    assert rows["compiled SAC"]["attention_forwards_per_step"] == 2 and rows["compiled SAC"]["graphs"] >= 1
    assert rows["eager + stash"]["attention_forwards_per_step"] == 2 and rows["eager + stash"]["graphs"] == 0
    assert json.loads((tmp_path / "compile.json").read_text())["mode"] == "compile"
    assert nothing_installed() and attnstash.stash_stats()["records"] == 0
