"""Each family of refusal is its own class (attnstash/errors.py), all StashErrors, raised where
a training run meets it: a user or a tool can catch one kind and let the others through."""
import pytest
import torch

import attnstash
from attnstash.install import transformers_adapter
from tiny_torch_models import Block, gpt, ids, loss_and_grads

KINDS = {
    attnstash.ArgumentError: (ValueError,),
    attnstash.InstallError: (ValueError,),
    attnstash.UnsupportedVersionError: (ImportError,),
    attnstash.CheckpointingError: (),
    attnstash.KeepError: (),
    attnstash.ReplayError: (),
    attnstash.PlanError: (),
}


def test_every_kind_is_a_stash_error_and_no_kind_is_another():
    for kind, also in KINDS.items():
        assert issubclass(kind, attnstash.StashError) and issubclass(kind, RuntimeError)
        assert all(issubclass(kind, base) for base in also)
        assert not any(issubclass(kind, other) for other in KINDS if other is not kind), kind


def test_a_value_attnstash_cannot_read_is_an_argument_error():
    with pytest.raises(attnstash.ArgumentError, match="cannot read '8 parsecs' as a byte count"):
        attnstash.parse_bytes("8 parsecs")
    with pytest.raises(attnstash.ArgumentError, match="dtype must be one of"):
        attnstash.plan(gpt(), ids(), dtype="float13")


def test_a_model_the_installer_cannot_serve_is_an_install_error():
    with pytest.raises(attnstash.InstallError, match="found no layers to stash in GPT"):
        attnstash.install_attention_stash(gpt())


def test_a_transformers_outside_the_range_is_an_unsupported_version_error(monkeypatch):
    monkeypatch.setattr(transformers_adapter, "installed_version", lambda: "9.0.0")
    monkeypatch.delenv(transformers_adapter.UNTESTED, raising=False)
    with pytest.raises(attnstash.UnsupportedVersionError, match="transformers 9.0.0 is not supported"):
        transformers_adapter.check_version()


def test_a_training_forward_outside_any_checkpoint_is_a_checkpointing_error(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    model.checkpointing = None
    with pytest.raises(attnstash.CheckpointingError, match="outside"):
        loss_and_grads(model, ids())


def test_attention_the_stash_cannot_keep_is_a_keep_error(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    mask = torch.zeros(12, 12, requires_grad=True)  # a mask that requires grad has a gradient of its own
    with pytest.raises(attnstash.KeepError, match="requires grad"):
        loss_and_grads(model, ids(), mask)


def test_a_recompute_with_nothing_kept_is_a_replay_error(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    loss = torch.nn.functional.cross_entropy(model(ids()).flatten(0, 1), ids().flatten())
    attnstash.stash_clear()  # what was kept for this forward is gone before its backward
    with pytest.raises(attnstash.ReplayError):
        loss.backward()


def test_a_model_the_planner_cannot_run_shape_only_is_a_plan_error():
    class Reads(torch.nn.Module):  # a shape that depends on values the planner does not have
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            y = self.block(x)
            return y * torch.unique(y).numel()

    with pytest.raises(attnstash.PlanError, match="shape-only"):
        attnstash.plan(Reads(), torch.randn(2, 12, 32), layers=Block)
