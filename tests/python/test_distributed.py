"""The stash under torch.distributed (gloo, 2 processes on CPU): DDP, FSDP2 (of a Hugging Face
model and of a torchtitan-style plain-PyTorch one) and (when installed) DeepSpeed ZeRO-3
training gives every rank the
same losses, gradients and parameters with the stash on all decoder layers as without
it, bitwise, and every rank ends with an empty stash.

Starting two processes that import torch and transformers costs far more than the
training itself, so one spawn (distributed_worker.run) runs every scenario in turn and
writes what each rank saw to a temporary folder; each test asserts on its scenario's
files here, in the parent. A child's exception fails the tests of the scenarios it did
not finish, with the child's traceback."""
import importlib.util
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

import distributed_worker
from distributed_worker import DEEPSPEED_SCENARIO, LAYERS, STEPS, TORCH_SCENARIOS

WORLD = 2
DEADLINE_S = 300  # a hung collective fails the tests instead of hanging the suite
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and importlib.util.find_spec("peft") is not None
SCENARIOS = TORCH_SCENARIOS + ((DEEPSPEED_SCENARIO,) if HAVE_DEEPSPEED else ())


@pytest.fixture(scope="module")
def ranks_ran(tmp_path_factory):
    """Spawn the WORLD ranks once for the module; (out folder, what went wrong or None)."""
    tmp = tmp_path_factory.mktemp("distributed")
    out = tmp / "out"
    out.mkdir()
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
    # Two ranks on a 2-core machine: one thread each; gloo on the loopback interface.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                      GLOO_SOCKET_IFNAME=saved["GLOO_SOCKET_IFNAME"] or "lo")
    problem = None
    try:
        # A FileStore rendezvous: no port to pick, none to collide on.
        ctx = mp.spawn(distributed_worker.run, args=(WORLD, str(tmp / "rendezvous"), str(out), SCENARIOS),
                       nprocs=WORLD, join=False)
    finally:
        for k, v in saved.items():  # the children have their environment already
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                problem = f"the {WORLD} ranks did not finish within {DEADLINE_S} s"
                break
    except mp.ProcessRaisedException as e:
        problem = f"a rank raised:\n{e}"
    except mp.ProcessExitedException as e:
        problem = f"a rank died: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return out, problem


def results_of(ranks_ran, scenario):
    out, problem = ranks_ran
    errors = sorted(out.glob(f"{scenario}.rank*.error"))
    if errors:
        pytest.fail("\n".join(f"{p.name}:\n{p.read_text()}" for p in errors), pytrace=False)
    paths = [out / f"{scenario}.rank{r}.pt" for r in range(WORLD)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"{scenario} did not run to the end on every rank: {problem}", pytrace=False)
    return [torch.load(p) for p in paths]


def differing(a, b):
    """Names of the tensors that are not bitwise equal."""
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def assert_same_run(got, reference, what):
    assert len(got["losses"]) == len(reference["losses"]) == STEPS
    for step, (x, y) in enumerate(zip(got["losses"], reference["losses"])):
        assert torch.equal(x, y), f"{what}: step {step} loss {x.item()!r} != {y.item()!r}"
    for step, (g, r) in enumerate(zip(got["grads"], reference["grads"])):
        names = differing(g, r)
        assert not names, f"{what}: step {step} gradients differ: {names}"
    names = differing(got["params"], reference["params"])
    assert not names, f"{what}: parameters after training differ: {names}"


def assert_the_stash_changes_nothing(results, compiled=False):
    for rank, result in enumerate(results):
        base = result["baseline"]
        assert base["keeps"] == base["replays"] == 0  # no stash installed there
        assert base["grads"][0].keys() == base["params"].keys()  # every trained parameter got a gradient
        # The baseline is bitwise reproducible, so bitwise is the bar for the stash.
        assert_same_run(result["baseline_again"], base, f"rank {rank}, the baseline run twice")
        stashed = result["stashed"]
        assert_same_run(stashed, base, f"rank {rank}, with the stash vs without")
        if compiled:  # the compiled graphs save the attention (install/compiled.py): nothing kept, half the forwards
            assert stashed["keeps"] == stashed["replays"] == 0, (rank, stashed["keeps"], stashed["replays"])
            assert base["graphs"] >= 1 and stashed["graphs"] >= base["graphs"] and stashed["nodes"] >= base["nodes"]
            assert base["attention_forwards"] == 2 * LAYERS and stashed["attention_forwards"] == LAYERS, \
                (rank, base["attention_forwards"], stashed["attention_forwards"])
        else:
            assert stashed["keeps"] == stashed["replays"] == LAYERS * STEPS, (rank, stashed["keeps"],
                                                                              stashed["replays"])
        assert stashed["records"] == 0 and stashed["bytes"] == 0, (rank, stashed["records"], stashed["bytes"])
    # The ranks saw different data but train one model: different losses, the same
    # (reduced) gradients and parameters.
    r0, r1 = (r["stashed"] for r in results)
    assert all(not torch.equal(a, b) for a, b in zip(r0["losses"], r1["losses"]))
    for step in range(STEPS):
        names = differing(r0["grads"][step], r1["grads"][step])
        assert not names, f"step {step}: the ranks' gradients differ: {names}"
    names = differing(r0["params"], r1["params"])
    assert not names, f"the ranks' parameters differ: {names}"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_ddp_training_with_the_stash_matches_without_on_every_rank(arch, ranks_ran):
    assert_the_stash_changes_nothing(results_of(ranks_ran, f"ddp-{arch}"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fsdp2_training_with_the_stash_matches_without_on_every_rank(arch, ranks_ran):
    assert_the_stash_changes_nothing(results_of(ranks_ran, f"fsdp2-{arch}"))


def test_fsdp2_training_of_a_torchtitan_style_model_with_the_stash_matches_without_on_every_rank(ranks_ran):
    # Blocks wrapped by torch's checkpoint_wrapper, then fully_shard: the installer finds them.
    assert_the_stash_changes_nothing(results_of(ranks_ran, "fsdp2-torchtitan"))


def test_fsdp2_training_of_a_torchtitan_style_model_compiled_per_block_with_the_stash_matches_without(ranks_ran):
    # torchtitan's order: checkpoint_wrapper, then each wrapped block compiled, then fully_shard.
    assert_the_stash_changes_nothing(results_of(ranks_ran, "fsdp2-torchtitancompiled"), compiled=True)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed (and peft) not installed: pip install deepspeed==0.19.8")
def test_deepspeed_zero3_lora_training_with_the_stash_matches_without_on_every_rank(ranks_ran):
    assert_the_stash_changes_nothing(results_of(ranks_ran, DEEPSPEED_SCENARIO))
