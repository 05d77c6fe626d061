"""The per-rank side of test_distributed.py.

Each spawned process joins one gloo group and runs the scenarios it is given in order
(DDP or FSDP2 over a tiny Hugging Face model with reentrant gradient checkpointing, FSDP2 over a
torchtitan-style plain-PyTorch one with checkpoint_wrapper, DeepSpeed ZeRO-3 over a PEFT-LoRA
one). A scenario trains its own model copy three times
from the same seed: without the stash, again without it, and with the stash on every
decoder layer. The rank saves what it saw to <out_dir>/<scenario>.rank<N>.pt, or the
traceback to <scenario>.rank<N>.error, and the parent asserts on those files.

The parent does the checking: a child raises only when it cannot run (and then stops: the
other rank may be waiting in a collective, so no later scenario could run safely)."""
import datetime
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

STEPS = 3
LAYERS = 3
TORCH_SCENARIOS = ("ddp-llama", "ddp-qwen3_moe", "fsdp2-llama", "fsdp2-qwen3_moe", "fsdp2-torchtitan",
                   "fsdp2-torchtitancompiled")
DEEPSPEED_SCENARIO = "deepspeed_zero3_lora-llama"


def rank_batch(rank, step):
    from tiny_models import batch
    return batch(seed=1000 + 100 * step + rank)  # different data on every rank and step


def _stats_since(before):
    import attnstash
    after = attnstash.stash_stats()
    return {"keeps": after["keeps"] - before["keeps"], "replays": after["replays"] - before["replays"],
            "records": after["records"], "bytes": after["bytes"]}


# ---- DDP and FSDP2 -------------------------------------------------------------------------

def _full(t):
    """A tensor as a plain, full one: FSDP2 keeps parameters and gradients as sharded
    DTensors, so gather them (a collective: every rank calls this for the same tensors in
    the same order)."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def _wrap(model, wrapper):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Reentrant checkpointing runs each checkpointed layer's backward as a nested
        # backward started from inside the outer one. find_unused_parameters=True fails
        # with it ("Expected to mark a variable ready only once"): DDP walks the autograd
        # graph at the end of forward to find the parameters that will get no gradient,
        # and the layers' parameters are not in that graph (the first forward of a
        # reentrant checkpoint runs under no_grad), so DDP marks them unused and then
        # sees their gradients arrive. The default find_unused_parameters=False works:
        # every parameter gets exactly one gradient per step, and DDP's per-parameter
        # hooks bucket and allreduce them as they are accumulated, also inside the nested
        # backwards. (transformers 5 fuses the MoE experts into 3-D parameters, so even an
        # expert no token picked gets a zero gradient; 4.x has one module per expert, and
        # there these batches happen to route tokens to every expert.) static_graph=True
        # works too, but is not needed, so the test runs DDP's defaults.
        return DDP(model, find_unused_parameters=False)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(wrapper)


def _train_torch(wrapper, arch, stash, rank):
    import attnstash
    from tiny_models import tiny_model

    model = tiny_model(arch, layers=LAYERS, seed=0)  # the same weights on every rank
    if stash:  # on the Hugging Face model, before it is wrapped, as a user would
        assert attnstash.install_attention_stash(model, LAYERS) == list(range(LAYERS))
    wrapped = _wrap(model, wrapper)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    before = attnstash.stash_stats()
    losses, grads = [], []
    for step in range(STEPS):
        ids = rank_batch(rank, step)
        opt.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    stats = _stats_since(before)
    params = {n: _full(p) for n, p in model.named_parameters()}
    if stash:
        attnstash.uninstall_attention_stash(model)
    return {"losses": losses, "grads": grads, "params": params, **stats}


def _train_torchtitan(stash, rank, compiled=False):
    """A plain-PyTorch decoder as torchtitan trains one: each block wrapped by checkpoint_wrapper
    (non-reentrant), then (compiled) each wrapped block compiled (block.compile(), aot_eager),
    then fully_shard on each wrapped block and on the model; the stash installed after the
    wrapping, finding the wrapped blocks by itself. Compiled: the graphs and call nodes dynamo
    compiled, and the fused attention forwards of the last step."""
    import attnstash
    import torch._dynamo
    from torch.distributed.fsdp import fully_shard
    from compile_cases import Counting, attention_forwards
    from tiny_torch_models import gpt, ids, wrapped

    torch._dynamo.reset()
    model = wrapped(gpt(layers=LAYERS, seed=0))
    if stash:
        assert attnstash.install_attention_stash(model) == list(range(LAYERS))
    counting = Counting("aot_eager")
    for block in model.blocks:
        if compiled:
            block.compile(backend=counting)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = attnstash.stash_stats()
    losses, grads, forwards = [], [], None

    def step(number):
        tokens = ids(seed=1000 + 100 * number + rank)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()

    for number in range(STEPS - 1):
        step(number)
    forwards = attention_forwards(lambda: step(STEPS - 1))
    stats = {**_stats_since(before), "graphs": counting.graphs, "nodes": counting.nodes,
             "attention_forwards": forwards}
    params = {n: _full(p) for n, p in model.named_parameters()}
    if stash:
        attnstash.uninstall_attention_stash(model)
    return {"losses": losses, "grads": grads, "params": params, **stats}


# ---- DeepSpeed ZeRO-3 with PEFT LoRA -------------------------------------------------------

def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed
    # Not `import deepspeed.comm.torch as ...`: deepspeed.comm's own `torch` attribute is torch.
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    # DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce op (about a minute
    # of g++ on first use). Only inference_all_reduce uses it; training collectives go
    # through torch.distributed (gloo) either way, so skip the build.
    ds_comm_torch.build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the group already set up
    return deepspeed


def _train_deepspeed(arch, stash, rank):
    """PEFT LoRA on a frozen base, every parameter partitioned by ZeRO-3: the set-up that
    forces reentrant checkpointing. Gradients and parameters of the trainable (LoRA)
    weights are gathered in full with DeepSpeed's safe_get_full_* (collectives)."""
    deepspeed = _deepspeed()  # first: it picks the CPU accelerator before anything uses it
    import attnstash
    import peft
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from tiny_models import tiny_model

    model = tiny_model(arch, layers=LAYERS, seed=0)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if stash:
        assert attnstash.install_attention_stash(model, LAYERS) == list(range(LAYERS))
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2),
                                           config=config)
    torch.manual_seed(1234)  # LoRA dropout: the same masks in every run
    before = attnstash.stash_stats()
    losses, grads = [], []
    for step in range(STEPS):
        ids = rank_batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        losses.append(loss.detach().clone())
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                      if p.requires_grad})
        engine.step()
    stats = _stats_since(before)
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
              if p.requires_grad}
    if stash:
        attnstash.uninstall_attention_stash(model)
    engine.destroy()
    return {"losses": losses, "grads": grads, "params": params, **stats}


# ---- the spawned process -------------------------------------------------------------------

def _train(scenario, stash, rank):
    wrapper, arch = scenario.split("-")
    if wrapper == "deepspeed_zero3_lora":
        return _train_deepspeed(arch, stash, rank)
    if arch.startswith("torchtitan"):
        return _train_torchtitan(stash, rank, compiled=arch == "torchtitancompiled")
    return _train_torch(wrapper, arch, stash, rank)


def run(rank, world_size, init_file, out_dir, scenarios):
    """torch.multiprocessing.spawn target."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=90))
    try:
        for scenario in scenarios:
            path = os.path.join(out_dir, f"{scenario}.rank{rank}")
            try:
                result = {"baseline": _train(scenario, False, rank),
                          "baseline_again": _train(scenario, False, rank),
                          "stashed": _train(scenario, True, rank)}
            except BaseException:
                with open(path + ".error", "w") as f:
                    f.write(traceback.format_exc())
                raise
            torch.save(result, path + ".pt")
    finally:
        dist.destroy_process_group()
