"""The stash's budget (max_bytes): it is never exceeded, a keep over it is declined and
that layer's recompute runs attention as the normal recompute does (same numbers), the
last layers get the budget first, and units read as other tools read them."""

from copy import deepcopy

import pytest
import torch

import attnstash
from attnstash import ops
from tiny_models import assert_bitwise_equal, batch, clone, tiny_model

MODES = {"reentrant": True, "non-reentrant": False}


@pytest.fixture(autouse=True)
def no_budget_after():
    yield
    attnstash.stash_set_max_bytes(None)


def per_layer_bytes(batch_size=2, seq=24, heads=4, head_dim=16):
    return batch_size * heads * seq * head_dim * 4 + batch_size * heads * seq * 4  # fp32 output + LSE


@pytest.mark.parametrize("text,count", [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 GB", 1_500_000_000),
                                        ("1024", 1024), ("64KiB", 65536), ("3kb", 3000), (0, 0), (7, 7),
                                        (None, None), ("2.01MB", 2_010_000), ("2.05GB", 2_050_000_000),
                                        ("0.1KB", 100), ("1.0000001 GB", 1_000_000_100), ("0.5B", 0),
                                        ("0." + "9" * 40 + "B", 0), ("1." + "0" * 40 + "1 TB", 10**12),
                                        ("8EiB", None), (2**63 - 1, 2**63 - 1)])
def test_sizes_read_as_other_tools_read_them_exactly(text, count):
    if count is None and text is not None:  # 8 EiB is 2**63: one past the largest count
        count = 2**63
        with pytest.raises(ValueError, match="2\\*\\*63 - 1"):
            attnstash.parse_bytes(text)
        return
    assert attnstash.parse_bytes(text) == count


@pytest.mark.parametrize("bad", [2**63, 2**64, "9" * 400, "1" + "0" * 30 + "TiB"])
def test_a_count_that_does_not_fit_names_the_range(bad):
    for parse in (attnstash.parse_bytes, attnstash.stash_set_max_bytes):
        with pytest.raises(ValueError, match="from 0 to 2\\*\\*63 - 1"):
            parse(bad)
    assert attnstash.stash_max_bytes() is None


@pytest.mark.parametrize("bad", [-1, True, False, "-3MB", "lots", "8 GiBs", "1e9", 1.5, [1]])
def test_a_bad_size_names_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        attnstash.parse_bytes(bad)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        attnstash.install_attention_stash(model, max_bytes=bad)
    assert not any(hasattr(m, "_attnstash") for m in model.modules())


def test_the_budget_is_the_stashs_own_and_works_without_the_installer():
    q, k, v = (torch.randn(2, 4, 24, 16) for _ in range(3))
    anchors = [torch.randn(3, requires_grad=True) for _ in range(3)]
    one = 2 * 4 * 24 * 16 * 4 + 2 * 4 * 24 * 4
    attnstash.stash_set_max_bytes(2 * one)
    assert attnstash.stash_max_bytes() == 2 * one and attnstash.stash_stats()["max_bytes"] == 2 * one
    declined = attnstash.stash_stats()["declined"]
    with torch.no_grad():
        outs = [ops.sdpa_fwd_keep(q, k, v, a, 0) for a in anchors]
    # The third keep made room by demoting the oldest record: the newest two are kept.
    held = [ops.record_id(a, 0) for a in anchors]
    assert all(held) and attnstash.stash_stats()["bytes"] == 2 * one
    assert attnstash.stash_stats()["declined"] == declined + 1
    with torch.no_grad():  # every recompute still gets the right output: the demoted one runs it
        for a, out in zip(anchors, outs):
            assert torch.equal(ops.sdpa_replay(q, k, v, a, 0), out)
    assert attnstash.stash_stats()["records"] == 0
    attnstash.stash_set_max_bytes("0")
    with torch.no_grad():
        ops.sdpa_fwd_keep(q, k, v, anchors[0], 0)
    assert attnstash.stash_stats()["bytes"] == 0 and ops.held_by_slot()[0] == (1, 0, 1)
    with torch.no_grad():
        ops.sdpa_replay(q, k, v, anchors[0], 0)


def test_the_oldest_records_are_demoted_first_whatever_their_sizes():
    # Small, large, then medium (slots 0, 1, 2 of one anchor): the medium keep needs room, and the
    # oldest go first, as many as it takes (the small one is not enough, so the large one goes
    # too), never the largest alone, which would have been enough.
    anchor = torch.randn(3, requires_grad=True)
    calls = [tuple(torch.randn(1, 2, seq, 8) for _ in range(3)) for seq in (4, 12, 8)]
    size = [seq * 2 * 8 * 4 + seq * 2 * 4 for seq in (4, 12, 8)]
    attnstash.stash_set_max_bytes(size[1] + size[2] - 1)  # the large one alone would make room
    with torch.no_grad():
        outs = [ops.sdpa_fwd_keep(q, k, v, anchor, slot) for slot, (q, k, v) in enumerate(calls)]
    held = ops.held_by_slot()
    assert [held[slot] for slot in range(3)] == [(1, 0, 1), (1, 0, 1), (1, size[2], 0)], held
    with torch.no_grad():  # the demoted recomputes run attention themselves
        for slot, ((q, k, v), out) in enumerate(zip(calls, outs)):
            assert torch.equal(ops.sdpa_replay(q, k, v, anchor, slot), out)
    assert attnstash.stash_stats()["records"] == 0


def test_a_budget_set_by_an_install_ends_with_it(installed):
    attnstash.stash_set_max_bytes("1MiB")
    first, second = tiny_model("llama"), tiny_model("llama", seed=1)
    attnstash.install_attention_stash(first, max_bytes=1)
    assert attnstash.stash_max_bytes() == 1
    attnstash.uninstall_attention_stash(first)
    assert attnstash.stash_max_bytes() == 2**20  # the budget from before the install
    installed(second)  # no max_bytes: nothing declined
    declined = attnstash.stash_stats()["declined"]
    ids = batch()
    second(input_ids=ids, labels=ids).loss.backward()
    assert attnstash.stash_stats()["declined"] == declined


def test_overlapping_installs_nest_their_budgets():
    a, b, c = (tiny_model("llama", seed=s) for s in range(3))
    attnstash.install_attention_stash(a, max_bytes=100)
    attnstash.install_attention_stash(b, max_bytes=200)
    attnstash.install_attention_stash(c)  # no budget of its own: the one in force stays
    assert attnstash.stash_max_bytes() == 200
    attnstash.uninstall_attention_stash(a)  # ends while b's lasts: b's stays in force
    assert attnstash.stash_max_bytes() == 200
    attnstash.uninstall_attention_stash(b)  # the last of them: the budget from before a
    assert attnstash.stash_max_bytes() is None
    attnstash.install_attention_stash(a, max_bytes=300)
    attnstash.stash_set_max_bytes(400)  # set by hand meanwhile: it stays after a ends
    attnstash.uninstall_attention_stash(a)
    assert attnstash.stash_max_bytes() == 400
    attnstash.uninstall_attention_stash(c)


def test_each_install_on_one_model_gives_its_own_budget_back():
    model = tiny_model("llama")
    attnstash.install_attention_stash(model, layers=[model.model.layers[0]], max_bytes=100)
    attnstash.install_attention_stash(model, layers=[model.model.layers[1]], max_bytes=200)
    assert attnstash.stash_max_bytes() == 200
    attnstash.uninstall_attention_stash(model)  # both installs end: the budget from before the first
    assert attnstash.stash_max_bytes() is None


def test_a_budget_lasts_until_the_last_of_its_install_s_layers_is_uninstalled():
    model = tiny_model("llama")
    attnstash.install_attention_stash(model, max_bytes=100)
    attnstash.uninstall_attention_stash(model.model.layers[0])  # one layer of the install ends
    assert attnstash.stash_max_bytes() == 100 and attnstash.layer_stash_stats(model)
    attnstash.uninstall_attention_stash(model.model)  # the rest of it: the install ends
    assert attnstash.stash_max_bytes() is None and not attnstash.layer_stash_stats(model)


def test_a_deep_copy_s_uninstall_leaves_the_original_s_budget():
    model = tiny_model("llama")
    attnstash.install_attention_stash(model, max_bytes=100)
    copy = deepcopy(model)
    attnstash.uninstall_attention_stash(copy)  # the copy set no budget of its own
    assert attnstash.stash_max_bytes() == 100
    attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_max_bytes() is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fits", [0, 1, 2, 3])
def test_a_budget_keeps_the_last_layers_that_fit_and_trains_bitwise(installed, mode, fits):
    base = tiny_model("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
    ids = batch()

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        held = attnstash.layer_stash_stats(model) if hasattr(model.model.layers[0], "_attnstash") else None
        loss.backward()
        return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), held

    reference, _ = step(clone(base))
    model = clone(base)
    installed(model, max_bytes=fits * per_layer_bytes())
    before = attnstash.stash_stats()
    got, held = step(model)
    after = attnstash.stash_stats()
    assert_bitwise_equal(got, reference)
    kept = {i for i, h in held.items() if h.bytes}
    assert kept == set(range(3 - fits, 3))  # the last layers: released first in backward
    assert all(held[i] == (1, 0, 1) for i in range(3 - fits))  # the others hold declined records
    assert after["peak_bytes"] <= fits * per_layer_bytes()
    assert after["declined"] - before["declined"] == 3 - fits
    assert after["replays"] - before["replays"] == fits
    assert after["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_the_budget_is_never_exceeded_over_varied_steps(installed, mode):
    # Batches of varying length (padded and not), several micro-batches in flight, both
    # checkpointing modes; install resets the peak, so peak_bytes covers the whole run.
    base = tiny_model("qwen2", layers=4)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
    budget = 3 * per_layer_bytes(seq=24)
    rng = torch.Generator().manual_seed(0)
    steps = []
    for step in range(6):
        micro = []
        for m in range(1 + step % 3):
            seq = int(torch.randint(8, 40, (1,), generator=rng))
            ids = torch.randint(0, 97, (2, seq), generator=rng)
            mask = torch.ones_like(ids)
            if (step + m) % 2:
                mask[1, : seq // 3] = 0
            micro.append((ids, mask))
        steps.append(micro)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for micro in steps:
            pending = [model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
                       for ids, mask in micro]  # every micro-batch's forward before the backwards
            for loss in reversed(pending):
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = train(clone(base))
    model = clone(base)
    attnstash.stash_reset_peak()
    installed(model, max_bytes=budget)
    before = attnstash.stash_stats()
    losses, params = train(model)
    after = attnstash.stash_stats()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert 0 < after["peak_bytes"] <= budget
    assert after["declined"] > before["declined"] and after["replays"] > before["replays"]
    assert after["records"] == 0


def test_a_demoted_non_reentrant_record_is_refilled_through_the_record(installed):
    # Non-reentrant: a record kept behind its node and demoted later (another keep needed
    # the room) is refilled by its recompute, and the node's backward uses that.
    base = tiny_model("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids_a, ids_b = batch(seed=1), batch(seed=2)

    def two(model):
        model.zero_grad(set_to_none=True)
        a = model(input_ids=ids_a, labels=ids_a).loss
        b = model(input_ids=ids_b, labels=ids_b).loss  # its keeps demote a's, oldest first
        b.backward()
        a.backward()
        return (a.detach() + b.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})

    reference = two(clone(base))
    model = clone(base)
    installed(model, max_bytes=3 * per_layer_bytes())
    before = attnstash.stash_stats()
    got = two(model)
    after = attnstash.stash_stats()
    assert_bitwise_equal(got, reference)
    assert after["declined"] - before["declined"] == 3 and after["replays"] - before["replays"] == 3
