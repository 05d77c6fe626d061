"""A plan depends on nothing else in the process: with a stash installed on another model, a plan
equals, layer for layer and byte for byte, the plan made with nothing installed."""
import os

import pytest
import torch
import torch.nn.functional as F

import attnstash
import tiny_models
import tiny_torch_models as plain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "examples", "configs", "Llama-3.1-8B.json")


def plans():
    """The plans of models other than the installed one: a transformers model, plain-PyTorch
    models (attention through F.sdpa, and through a name bound at import), and a config."""
    llama = tiny_models.tiny_model("llama", layers=2)
    by_name = plain.gpt(layers=2, by_name=True, checkpointing=None)
    tabled = plain.wrapped(plain.gpt(layers=2, block_class=plain.TableBlock))
    return [
        attnstash.plan(llama, batch_size=2, seq_len=16, device="cpu"),
        attnstash.plan(by_name, plain.ids(), device="cpu", layers=plain.Block),
        attnstash.plan(tabled, plain.ids(), device="cpu"),
        attnstash.plan(LLAMA, batch_size=1, seq_len=64, device="cuda", cuda_capability=(9, 0)),
    ]


def test_a_plan_does_not_depend_on_a_stash_installed_on_another_model():
    alone = plans()
    assert all(p.total_bytes > 0 and not any(layer.refused for layer in p.layers) for p in alone), alone
    other = plain.gpt(layers=2)
    attnstash.install_attention_stash(other, layers=plain.Block)
    try:
        # The install rebinds no name: attention reaches a stashed layer through the op's kernel.
        assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
        assert plain.sdpa_imported_by_name is torch._C._nn.scaled_dot_product_attention
        beside = plans()
    finally:
        attnstash.uninstall_attention_stash(other)
    for a, b in zip(alone, beside):
        assert a.per_layer_bytes == b.per_layer_bytes, str(b)
        assert a == b


def test_the_planner_imported_while_a_stash_is_installed_still_sees_attention():
    """The planner module loaded for the first time while a stash is installed (a fresh interpreter)."""
    import subprocess
    import sys
    script = (
        "import sys, attnstash, tiny_torch_models as plain\n"
        "other = plain.gpt(layers=2)\n"
        "attnstash.install_attention_stash(other, layers=plain.Block)\n"
        "try:\n"
        "    assert 'attnstash.planner' not in sys.modules\n"
        "    import attnstash.planner\n"
        "    p = attnstash.plan(plain.gpt(layers=2, seed=3), plain.ids(), device='cpu', layers=plain.Block)\n"
        "finally:\n"
        "    attnstash.uninstall_attention_stash(other)\n"
        "print(p.total_bytes, [layer.refused for layer in p.layers])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    total, refused = done.stdout.split(" ", 1)
    assert int(total) > 0 and refused.strip() == "[None, None]", done.stdout


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_planning_a_model_of_the_installed_class_leaves_the_installed_one_alone(arch):
    """Another instance of the installed model's class plans as it does alone (the install is per
    layer instance), and the installed model keeps nothing from the plan."""
    alone = attnstash.plan(tiny_models.tiny_model(arch, layers=2, seed=1), batch_size=2, seq_len=16, device="cpu")
    installed = tiny_models.tiny_model(arch, layers=2)
    attnstash.install_attention_stash(installed)
    try:
        beside = attnstash.plan(tiny_models.tiny_model(arch, layers=2, seed=1), batch_size=2, seq_len=16,
                                device="cpu")
        assert attnstash.stash_stats()["records"] == 0
    finally:
        attnstash.uninstall_attention_stash(installed)
    assert alone == beside and alone.total_bytes > 0
