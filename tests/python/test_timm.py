"""The installer on timm's VisionTransformer with set_grad_checkpointing(True) (timm checkpoints
each block itself, through checkpoint_seq): its blocks named with layers=, both checkpointing
modes, loss and every gradient bitwise, one keep and one replay per block, nothing held.

timm needs torchvision, which does not import next to the CPU torch 2.13 of the main test
environment; `make test` runs this file in its own venv (`make test-timm`: torch 2.14.1 and
torchvision 0.29.1, attnstash built for that torch)."""
import copy

import pytest
import torch

timm = pytest.importorskip("timm", reason="timm (and torchvision) are not installed here: make test-timm runs "
                                          "this file in a venv of its own")

import attnstash  # noqa: E402
from timm.layers.config import set_reentrant_ckpt  # noqa: E402
from timm.models.vision_transformer import Block, VisionTransformer  # noqa: E402

MODES = ("reentrant", "non-reentrant")


@pytest.fixture(params=MODES)
def mode(request):
    set_reentrant_ckpt(request.param == "reentrant")
    yield request.param
    set_reentrant_ckpt(False)


def vit(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=5,
                              **kwargs).train()
    model.set_grad_checkpointing(True)
    return model


def assert_bitwise_equal(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert not [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]


def loss_and_grads(model, images, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_vision_transformer_with_grad_checkpointing_trains_bitwise_like_without_the_stash(mode, installed):
    base = vit()
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randn(2, 3, 32, 32, generator=g), torch.tensor([1, 3])
    reference = loss_and_grads(copy.deepcopy(base), images, labels)
    assert_bitwise_equal(reference, loss_and_grads(copy.deepcopy(base), images, labels))
    model = copy.deepcopy(base)
    assert installed(model, layers=Block) == [0, 1, 2]
    before = attnstash.stash_stats()
    assert_bitwise_equal(loss_and_grads(model, images, labels), reference)
    after = attnstash.stash_stats()
    assert (after["keeps"] - before["keeps"], after["replays"] - before["replays"]) == (3, 3)
    assert after["records"] == 0


def test_stochastic_depth_and_dropout_with_the_random_state_restored_train_bitwise(mode, installed):
    # drop_path and projection dropout draw random numbers in every block; timm's checkpoint
    # keeps torch's preserve_rng_state=True, so the recompute draws them again.
    base = vit(drop_path_rate=0.2, proj_drop_rate=0.1, pos_drop_rate=0.1)
    g = torch.Generator().manual_seed(2)
    images, labels = torch.randn(2, 3, 32, 32, generator=g), torch.tensor([0, 4])
    reference = loss_and_grads(copy.deepcopy(base), images, labels)
    model = copy.deepcopy(base)
    installed(model, layers=Block)
    assert_bitwise_equal(loss_and_grads(model, images, labels), reference)
