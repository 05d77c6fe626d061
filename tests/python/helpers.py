"""Generic test helpers that need only torch (and attnstash): comparing runs bitwise or within the
spread of normal runs, the stash's counters, and whether any stash is installed. The op-level
tests import them from here, so that they collect without transformers; tiny_models.py (the
Hugging Face decoders) re-exports them for the tests that build those."""
import copy
import importlib.util

import torch


def clone(model):
    return copy.deepcopy(model)


def assert_bitwise_equal(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    different = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not different, f"gradients differ: {different}"


def assert_within_run_spread(normal, got):
    """For a backward that is not deterministic (cuDNN accumulates dQ in any order): `got`'s
    loss bitwise the first normal run's, and each gradient bitwise where the normal runs are,
    else no further from its nearest normal run than they are from each other. `normal`: (loss,
    [grad]) of several runs without the stash; `got`: one with it."""
    loss, grads = got
    assert torch.equal(loss, normal[0][0])
    for i, g in enumerate(grads):
        runs = [n[1][i] for n in normal]
        spread = max((a - b).abs().max().item() for j, a in enumerate(runs) for b in runs[j + 1:])
        nearest = min((g - r).abs().max().item() for r in runs)
        assert nearest <= spread, (i, nearest, spread)


def nothing_installed():
    """No stash is installed anywhere: F.scaled_dot_product_attention is torch's own and
    transformers' layer class (where transformers is installed) carries no stand-in for the
    checkpoint function."""
    import torch.nn.functional as F
    if F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention:
        return False
    if importlib.util.find_spec("transformers") is None:
        return True  # no transformers: no layer class of it to carry a stand-in
    from transformers.modeling_layers import GradientCheckpointingLayer
    return "_gradient_checkpointing_func" not in vars(GradientCheckpointingLayer)


def counters():
    """The stash's (keeps, replays) so far."""
    import attnstash
    s = attnstash.stash_stats()
    return s["keeps"], s["replays"]
