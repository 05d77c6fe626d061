"""benchmarks: what the attention stash saves, what it costs, and that it changes nothing.

`python -m benchmarks --mode model|layer|profile|seq-sweep|soak|dit|host|compile` (__main__.py), run from
the repository root: the benchmark is the repository's, not part of the installed package.

    models.py    the decoder (Qwen3), checkpointing (SAC included), inputs, the planner's
                 prediction and the attention forward the stash skips; examples/demo.py uses it
    harness.py   what every mode shares: Config, Run, the check, interleaved timing
                 (torch.utils.benchmark), peak memory; examples/demo.py uses it
    decoder.py   model, layer and seq-sweep modes
    profile.py   profile mode (torch.profiler's event tree and key_averages)
    soak.py      soak mode
    dit.py       dit mode (diffusers' Flux transformer) and host mode
    compiled.py  compile mode (torch.compile, with and without the stash, SAC)
    report.py    tables (torch.utils.benchmark.Compare and one plain table), JSON, PNGs

Importing this package imports nothing else: import the module you need.
"""
