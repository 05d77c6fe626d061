"""attnstash's own offload (install_attention_stash(offload=True), install/offload.py, Own).
On a CPU the records are in host memory already: offload=True moves nothing, and the run is
the run without it. The mechanism itself (what is moved after each first forward, the order
of the fetches, one wait per backward, what the device holds, the release of a dropped
forward's copies) runs here with CPU stand-ins for its device steps (StandIn); on a GPU,
tests/python/test_gpu_offload.py and the GPU script's offload stage run the real ones."""
import gc

import pytest
import torch

import attnstash
from attnstash.install import core, offload
from offload_cases import KINDS, MODES, build
from tiny_models import assert_bitwise_equal
import tiny_torch_models as plain



class StandIn(offload.Own):
    """Own with CPU stand-ins for its device steps: it takes every tensor, its host copy and its
    fetch are copies, and it logs what it moves and fetches, by record ids."""

    def __init__(self):
        super().__init__()
        self.log = []

    def takes(self, tensor):
        return True

    def to_host(self, tensor):
        return "host", tensor.clone()

    def to_device(self, packed):
        return packed[1].clone()

    def event(self):
        return None

    def wait(self, event, fetched):
        pass

    def moved(self, moved):
        self.log.append(("moved", tuple(r for r, _ in moved.records)))
        super().moved(moved)

    def start(self, moved):
        self.log.append(("fetch", tuple(r for r, _ in moved.records), attnstash.stash_stats()["bytes"]))
        super().start(moved)


def install_stand_in(model, layers, install):
    attnstash.install_attention_stash(model, offload=True, **install)
    stand_in = StandIn()
    for layer in layers:  # the install's offload, which all its layers share
        core.stash_of(layer).install.offload = stand_in
    return stand_in


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_offload_on_a_cpu_moves_nothing_and_changes_nothing(mode, kind):
    runs = []
    for offloads in (False, True):
        model, install, _, _, step = build(kind, mode)
        attnstash.install_attention_stash(model, offload=offloads, **install)
        try:
            before = attnstash.stash_stats()
            runs.append(step(model))
            after = attnstash.stash_stats()
        finally:
            attnstash.uninstall_attention_stash(model)
        assert after["keeps"] - before["keeps"] == after["replays"] - before["replays"] == 3
        assert after["moved_bytes"] == 0 and after["offload_waits"] == before["offload_waits"]
    assert_bitwise_equal(*runs)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_mechanism_moves_each_forwards_records_and_fetches_the_next_ahead(mode, kind):
    model, install, layers, _, step = build(kind, mode)
    without = step(model)
    attnstash.install_attention_stash(model, **install)
    try:
        step(model)  # without offload: what the stash holds for the three layers at once
        all_layers = attnstash.stash_stats()["peak_bytes"]
    finally:
        attnstash.uninstall_attention_stash(model)
    stand_in = install_stand_in(model, layers, install)
    for i, layer in enumerate(layers):  # (a module inside each layer: its call is a plain module call)
        inner = layer.self_attn if kind == "transformers" else layer.qkv
        inner.register_forward_pre_hook(lambda m, a, i=i: stand_in.log.append(("recompute", i))
                                        if torch._C._current_graph_task_id() != -1 else None)
    attnstash.stash_reset_peak()
    try:
        before = attnstash.stash_stats()
        with_offload = step(model)
        after = attnstash.stash_stats()
    finally:
        attnstash.uninstall_attention_stash(model)
    assert_bitwise_equal(without, with_offload)
    moved = [entry[1] for entry in stand_in.log if entry[0] == "moved"]
    assert len(moved) == 3 and all(moved)  # each layer's first forward moved its records
    # Fetched in the order the recomputes come, each once; each but the first ahead of its own
    # recompute, one forward ahead (the first layer's only once the last layer's recompute
    # began): only the first waits.
    events = [e[:2] for e in stand_in.log if e[0] != "moved"]
    fetches = [e[1] for e in events if e[0] == "fetch"]
    assert fetches == moved[::-1], events
    at = events.index
    assert at(("fetch", moved[1])) < at(("recompute", 1)) and at(("fetch", moved[0])) < at(("recompute", 0))
    assert at(("fetch", moved[0])) > at(("recompute", 2)), events
    assert after["offload_waits"] - before["offload_waits"] == 1
    # What the stash held on the device at once: never all three layers' records (one at a
    # time in the forward, the one in use in the backward).
    assert 0 < after["peak_bytes"] <= all_layers // 3 < all_layers
    assert after["replays"] - before["replays"] == 3 and after["misses"] == before["misses"]
    assert after["moved_bytes"] == after["bytes"] == after["records"] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_dropped_forward_drops_its_host_copies_and_its_records(mode, kind):
    model, install, layers, forward, step = build(kind, mode)
    stand_in = install_stand_in(model, layers, install)
    try:
        loss = forward(model)
        stats = attnstash.stash_stats()
        assert stats["records"] == 3 and stats["bytes"] == 0 and stats["moved_bytes"] > 0
        copies = [m for m in stand_in._forwards]
        assert len(copies) == 3 and all(m() is not None for m in copies)
        del loss
        gc.collect()
        assert all(m() is None for m in copies)  # the host copies went with the graph
        assert attnstash.stash_stats()["records"] == 0 and attnstash.stash_stats()["moved_bytes"] == 0
        step(model)  # and the next step trains
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0


def test_offload_must_be_a_bool():
    model = plain.gpt()
    with pytest.raises(attnstash.InstallError, match="offload must be True or False, got 'yes'"):
        attnstash.install_attention_stash(model, layers=plain.Block, offload="yes")
    assert attnstash.layer_stash_stats(model) == {}


def test_a_deep_copy_of_an_offloaded_model_has_one_offload_of_its_own():
    import copy
    model = plain.gpt()
    attnstash.install_attention_stash(model, layers=plain.Block, offload=True)
    try:
        twin = copy.deepcopy(model)
        mine = {id(core.stash_of(b).install.offload) for b in model.blocks}
        theirs = {id(core.stash_of(b).install.offload) for b in twin.blocks}
        assert len(mine) == len(theirs) == 1 and mine != theirs
    finally:
        attnstash.uninstall_attention_stash(model)
