"""The installer under torch.compile (inductor) on CUDA, bf16: the whole model compiled (the
checkpoints traced: install/compiled.py's selective policy) and each block compiled inside the
model's eager checkpoint (attnstash::_sdpa_compiled, both checkpointing modes). Against the
same compiled run without the stash: one attention forward per call per step instead of two,
the loss bitwise, the gradients bitwise where the backward is deterministic (else within the
run-to-run spread of the run without the stash: cuDNN accumulates dQ in any order), nothing
held after. Skipped without a GPU; run on the GPU machine by tests/gpu/run.sh."""
import pytest
import torch

import attnstash
import tiny_torch_models as plain
from compile_cases import compiled_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def compile_whole(model):
    return torch.compile(model)


def compile_each_block(model):
    for block in model.blocks:
        block.compile()
    return model


def runs(mode, use_stash, compile_it):
    def build():
        model = plain.gpt(checkpointing=mode, dim=512, heads=8).to("cuda", torch.bfloat16)
        ids = plain.ids(batch=2, seq=256).cuda()
        return model, lambda run: plain.loss_and_grads(run, ids)
    results, forwards, _ = compiled_run(use_stash, build, lambda model, counting: compile_it(model),
                                        backend="inductor", layers=plain.Block)
    return results, forwards


def largest_difference(a, b):
    return max((ga[k].float() - gb[k].float()).abs().max().item() for (_, ga), (_, gb) in zip(a, b) for k in ga)


@pytest.mark.parametrize("compile_it, mode", [(compile_whole, "non-reentrant"), (compile_each_block, "non-reentrant"),
                                              (compile_each_block, "reentrant")],
                         ids=["torch.compile(model)", "block.compile(), non-reentrant", "block.compile(), reentrant"])
def test_compiled_training_on_cuda_runs_attention_once_and_matches_the_run_without(compile_it, mode):
    reference, forwards_a = runs(mode, False, compile_it)
    again, _ = runs(mode, False, compile_it)
    stashed, forwards_b = runs(mode, True, compile_it)
    assert forwards_a == 2 * 3 and forwards_b == 3, (forwards_a, forwards_b)
    assert all(torch.equal(la, lb) for (la, _), (lb, _) in zip(reference, stashed))
    spread = largest_difference(reference, again)
    assert largest_difference(reference, stashed) <= 2 * spread, (largest_difference(reference, stashed), spread)
    assert attnstash.stash_stats()["records"] == 0
