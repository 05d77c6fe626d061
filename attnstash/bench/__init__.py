"""attnstash.bench: what the attention stash saves, what it costs, and that it changes nothing.

`python -m attnstash.bench` (attnstash/bench/__main__.py, the command line) builds a Qwen3
decoder from a config (random weights, no download) with attn_implementation="sdpa" and
trains it on random token ids (the ids are also the labels), in one of three modes:

    --mode model   (default) one training step of the whole model, each configuration
                   (no checkpointing, reentrant, reentrant + stash k, SAC, non-reentrant,
                   non-reentrant + stash, stash under a budget) interleaved: model_mode.py
    --mode layer   one decoder layer under reentrant checkpointing, without and with the
                   stash: layer_mode.py
    --mode soak    hundreds of irregular steps under both checkpointing modes; the stash
                   must be empty after every step: soak.py

Any mode runs fp32 weights under torch.autocast with --amp bf16|fp16.

The package has two halves. The library half, which examples/demo.py uses too:
    models.py      the model and its inputs: presets, Shape, build_model, checkpointing
                   (SAC included), batches and masks, autocast, the kept-bytes prediction
    measure.py     the measurement harness: clocks, the paused garbage collector, exact
                   peak memory, interleaved rotated rounds, CPU threads, bitwise comparisons
The experiments and their output, which only the command line uses:
    model_mode.py, layer_mode.py, soak.py   the three experiments (each returns a report dict)
    report.py      tables on stdout, JSON, the PNG of model mode

Importing this package imports nothing else: import the module you need.
"""
