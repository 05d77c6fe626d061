"""The installer on models written in plain PyTorch (tiny_torch_models): a nanoGPT-style model
that checkpoints its blocks itself (layers=), torch's checkpoint_wrapper (found by itself), a
block with several attention calls, attention through a name imported before the install,
the random-state check, a recompute after model.eval(), and the refusals. Each gives the
normal recompute's loss and every gradient bitwise, with one keep and one replay per
attention call, and nothing held after."""
import copy

import pytest
import torch

import attnstash
from attnstash import ops
from tiny_torch_models import AliasBlock, Block, MatmulBlock, Projections, TableBlock, gpt, ids, loss_and_grads, wrapped
from helpers import assert_bitwise_equal, counters

MODES = ("reentrant", "non-reentrant")


def assert_the_stash_gives_the_normal_recompute(base, installed, calls, **install):
    """`base` trained once without and once with the stash (on a copy each): bitwise the same,
    `calls` keeps and replays, nothing held."""
    tokens = ids()
    reference = loss_and_grads(copy.deepcopy(base), tokens)
    assert_bitwise_equal(reference, loss_and_grads(copy.deepcopy(base), tokens))  # reproducible
    model = copy.deepcopy(base)
    stashed = installed(model, **install)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)
    assert counters() == (keeps + calls, replays + calls)
    assert attnstash.stash_stats()["records"] == 0
    return stashed


@pytest.mark.parametrize("mode", MODES)
def test_a_model_that_checkpoints_its_blocks_itself_with_the_block_class_named(mode, installed):
    assert assert_the_stash_gives_the_normal_recompute(gpt(checkpointing=mode), installed, 3, layers=Block) == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_layers_named_as_modules_are_taken_in_model_order(mode, installed):
    base = gpt(checkpointing=mode)
    tokens = ids()
    reference = loss_and_grads(copy.deepcopy(base), tokens)
    model = copy.deepcopy(base)
    assert installed(model, layers=[model.blocks[2], model.blocks[0]]) == [0, 1]  # indices among those named
    assert attnstash.layer_stash_stats(model).keys() == {0, 1}
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)
    assert counters() == (keeps + 2, replays + 2)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_wrapper_layers_are_found_by_themselves(mode, installed):
    base = wrapped(gpt(), mode)
    stashed = assert_the_stash_gives_the_normal_recompute(base, installed, 3)
    assert stashed == [0, 1, 2]
    names = [name for _, name, _ in attnstash.attention_layers(base)]
    assert names == [f"blocks.{i}._checkpoint_wrapped_module" for i in range(3)]


@pytest.mark.parametrize("mode", MODES)
def test_several_attention_calls_per_forward_are_each_kept_and_replayed(mode, installed):
    base = gpt(checkpointing=mode, calls=3)
    assert_the_stash_gives_the_normal_recompute(base, installed, 9, layers=Block)


@pytest.mark.parametrize("mode", MODES)
def test_attention_through_a_name_imported_before_the_install(mode, installed):
    base = gpt(checkpointing=mode, by_name=True)
    assert_the_stash_gives_the_normal_recompute(base, installed, 3, layers=Block)


@pytest.mark.parametrize("mode", MODES)
def test_attention_picked_from_a_module_level_table_is_found(mode, installed):
    base = wrapped(gpt(block_class=TableBlock), mode)
    assert assert_the_stash_gives_the_normal_recompute(base, installed, 3) == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_attention_through_a_module_level_alias_is_found(mode, installed):
    base = wrapped(gpt(block_class=AliasBlock), mode)
    assert assert_the_stash_gives_the_normal_recompute(base, installed, 3) == [0, 1, 2]


def test_a_block_class_made_at_run_time_is_read_from_its_code(installed):
    # exec'd: no source for inspect to read (a notebook cell run by exec, a generated class).
    namespace = {"F": torch.nn.functional, "Projections": Projections}
    exec("class RunTimeBlock(Projections):\n"
         "    def forward(self, x, mask=None):\n"
         "        b, s, d = x.shape\n"
         "        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)\n"
         "        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
         "        return x + self.proj(out.transpose(1, 2).reshape(b, s, d))\n", namespace)
    base = wrapped(gpt(block_class=namespace["RunTimeBlock"]), "reentrant")
    assert assert_the_stash_gives_the_normal_recompute(base, installed, 3) == [0, 1, 2]


def test_a_block_that_only_mentions_attention_in_its_text_is_not_one_to_stash():
    model = wrapped(gpt(block_class=MatmulBlock))
    assert attnstash.attention_layers(model) == []
    with pytest.raises(attnstash.InstallError, match="none of the 3 layers found in GPT is one to stash.*reads the "
                                                     "classes' code.*layers= or filter_fn="):
        attnstash.install_attention_stash(model)


def test_the_code_reader_follows_decorators_and_static_methods_and_survives_odd_attributes():
    import functools
    from attnstash.install.found import calls_any

    def decorated(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    class Unreadable:  # a class attribute whose every lookup raises (a lazy proxy, a mock)
        def __getattr__(self, name):
            raise RuntimeError(name)

    class Decorated(torch.nn.Module):
        odd = Unreadable()

        @decorated
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    class Static(torch.nn.Module):
        attend = staticmethod(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q))

    class NamedLikeIt(torch.nn.Module):  # wraps the function's name, never calls it
        @functools.wraps(torch.nn.functional.scaled_dot_product_attention)
        def forward(self, x):
            return x

    words = ("scaled_dot_product_attention",)
    assert calls_any(Decorated, words) and calls_any(Static, words)
    assert not calls_any(NamedLikeIt, words)


def test_num_layers_counts_from_the_last(installed):
    base = gpt(checkpointing="reentrant", layers=4)
    assert assert_the_stash_gives_the_normal_recompute(base, installed, 2, layers=Block, n=2) == [2, 3]


@pytest.mark.parametrize("mode", MODES)
def test_dropout_before_attention_with_the_random_state_restored_trains_bitwise(mode, installed):
    base = gpt(checkpointing=mode, dropout=0.3)
    assert_the_stash_gives_the_normal_recompute(base, installed, 3, layers=Block)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_before_attention_without_the_random_state_restored_is_refused(mode, installed):
    # preserve_rng_state=False, which the installer cannot see from inside a checkpoint it did
    # not call: the recompute's random numbers differ, so its query, key and value do.
    model = gpt(checkpointing=mode, dropout=0.3, preserve_rng_state=False)
    installed(model, layers=Block)
    with pytest.raises(attnstash.CheckpointingError, match="draws random numbers before its attention.*"
                                                          "preserve_rng_state=True"):
        loss_and_grads(model, ids())
    assert attnstash.stash_stats()["records"] == 0


def test_dropout_after_attention_without_the_random_state_restored_is_the_user_s_own_business(installed):
    # No random numbers before the attention: the kept output is the recompute's too, and the
    # step is what checkpointing gives without the stash (checkpointing's own contract).
    base = gpt(checkpointing="non-reentrant", preserve_rng_state=False)
    for block in base.blocks:
        block.mlp.insert(1, torch.nn.Dropout(0.3))
    assert_the_stash_gives_the_normal_recompute(base, installed, 3, layers=Block)


@pytest.mark.parametrize("mode", MODES)
def test_a_recompute_follows_its_first_forward_whatever_the_training_flag_says(mode, installed):
    # model.eval() between a forward and its backward: the recompute still takes what its
    # first forward kept.
    def step(model):
        model.zero_grad(set_to_none=True)
        tokens = ids()
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        model.eval()
        loss.backward()
        model.train()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    base = gpt(checkpointing=mode)
    reference = step(copy.deepcopy(base))
    model = copy.deepcopy(base)
    installed(model, layers=Block)
    keeps, replays = counters()
    assert_bitwise_equal(step(model), reference)
    assert counters() == (keeps + 3, replays + 3)


def test_a_block_without_checkpointing_is_refused_with_the_reason(installed):
    model = gpt(checkpointing=None)
    installed(model, layers=Block)
    with pytest.raises(attnstash.CheckpointingError, match=r"layer 0 \(blocks.0, Block\).*outside any activation "
                                                          "checkpoint"):
        loss_and_grads(model, ids())
    with torch.no_grad():  # no training forward: untouched
        model(ids())
    model.eval()
    model(ids())


def test_a_layer_that_calls_no_attention_is_refused(installed):
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=[model.blocks[0].mlp])
    with pytest.raises(attnstash.CheckpointingError, match=r"layer 0 \(blocks.0.mlp, Sequential\).*called no "
                                                          "F.scaled_dot_product_attention"):
        loss_and_grads(model, ids())


@pytest.mark.parametrize("bad,words", [
    (torch.nn.Conv1d, "GPT has no module of that class"),
    (int, "must be a torch.nn.Module subclass"),
    (42, "must be a torch.nn.Module subclass or an iterable"),
    ([], "layers= is empty"),
    ([torch.nn.Linear(2, 2)], "not a module of GPT"),
    (["blocks.0"], "not a torch.nn.Module"),
])
def test_bad_layers_are_refused_with_what_was_expected(bad, words):
    model = gpt()
    with pytest.raises(attnstash.InstallError, match=words):
        attnstash.install_attention_stash(model, layers=bad)
    assert not any(hasattr(m, "_attnstash") for m in model.modules())


def test_a_plain_model_without_layers_to_find_says_what_was_looked_for():
    with pytest.raises(attnstash.InstallError, match="found no layers to stash in GPT: looked for .*checkpoint_wrapper"
                                                     ".*Name them with layers="):
        attnstash.install_attention_stash(gpt())


def test_the_same_block_class_in_two_models_keeps_each_its_own(installed):
    a, b = gpt(checkpointing="reentrant", seed=0), gpt(checkpointing="non-reentrant", seed=1)
    tokens = ids()
    ref_a, ref_b = loss_and_grads(copy.deepcopy(a), tokens), loss_and_grads(copy.deepcopy(b), tokens)
    installed(a, layers=Block)
    installed(b, layers=Block)
    assert_bitwise_equal(loss_and_grads(a, tokens), ref_a)
    assert_bitwise_equal(loss_and_grads(b, tokens), ref_b)
    attnstash.uninstall_attention_stash(a)
    assert_bitwise_equal(loss_and_grads(b, tokens), ref_b)


def test_every_stashed_layer_has_a_range_of_slots_of_its_own(installed):
    # Across models, deep copies and installs made on several threads at once (the registry hands
    # the ranges out: csrc/stash_registry.h, stash_new_slot_range).
    import threading
    models = [gpt(checkpointing="reentrant", seed=s) for s in range(4)]
    threads = [threading.Thread(target=installed, args=(m,), kwargs={"layers": Block}) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    models.append(copy.deepcopy(models[0]))
    bases = [m.__dict__["_attnstash"].slot_base for model in models for m in model.modules() if "_attnstash" in m.__dict__]
    assert len(bases) == 5 * 3 and len(set(bases)) == len(bases)
    assert all(b > 0 and b % ops.SLOTS_PER_RANGE == 0 for b in bases)
    tokens = ids()
    reference = loss_and_grads(gpt(checkpointing="reentrant", seed=0), tokens)
    assert_bitwise_equal(loss_and_grads(models[-1], tokens), reference)
    attnstash.uninstall_attention_stash(models[-1])


def _sac(save):
    """Selective activation checkpointing that saves the ops `save` names (substrings of their
    names) and recomputes the rest."""
    import functools
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if any(s in str(op) for s in save) else CheckpointPolicy.PREFER_RECOMPUTE)
    return functools.partial(create_selective_checkpoint_contexts, policy)


@pytest.mark.parametrize("save", [("mm",), ("scaled_dot_product", "attnstash")], ids=["matmuls", "attention"])
def test_selective_checkpointing_with_the_stash_trains_bitwise(save, installed, monkeypatch):
    # SAC saving matmuls and the stash keeping attention share the work; SAC saving attention
    # too holds each attention output twice (README, Limits), and must still be exact.
    base = gpt(checkpointing="non-reentrant")

    def sac_forward(self, tokens, mask=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False, context_fn=_sac(save))
        return self.head(x)

    monkeypatch.setattr(type(base), "forward", sac_forward)
    tokens = ids()
    reference = loss_and_grads(copy.deepcopy(base), tokens)
    model = copy.deepcopy(base)
    installed(model, layers=Block)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)
    assert counters() == (keeps + 3, replays + 3)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_layers_chosen_by_filter_fn_are_those_it_accepts_by_module_and_name(mode, installed):
    base = gpt(checkpointing=mode)
    seen = []

    def filter_fn(module, fqn):
        seen.append(fqn)
        return isinstance(module, Block) and fqn != "blocks.1"

    stashed = assert_the_stash_gives_the_normal_recompute(base, installed, 2, filter_fn=filter_fn)
    assert stashed == [0, 1]
    assert seen[0] == "" and "blocks.1" in seen  # every module of model.named_modules(), the model first
    assert [name for _, name, _ in attnstash.attention_layers(base, filter_fn=filter_fn)] == ["blocks.0", "blocks.2"]


@pytest.mark.parametrize("kwargs,words", [
    ({"filter_fn": lambda m, fqn: False}, r"filter_fn accepted none of the modules of GPT .*filter_fn\(module, fqn\)"),
    ({"filter_fn": "blocks"}, "filter_fn must be a callable .module, fqn. -> bool, got str"),
    ({"filter_fn": lambda m, fqn: True, "layers": Block}, "give layers= or filter_fn=, not both"),
])
def test_a_bad_filter_fn_is_refused_with_what_was_expected(kwargs, words):
    model = gpt()
    with pytest.raises(attnstash.InstallError, match=words):
        attnstash.install_attention_stash(model, **kwargs)
    assert not any(hasattr(m, "_attnstash") for m in model.modules())


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("bad_call", [
    lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_bias=None, **kw),
    lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.5),
], ids=["unknown keyword", "too many positional"])
def test_attention_arguments_torch_does_not_take_get_torch_s_own_error_inside_a_stashed_layer(installed, monkeypatch,
                                                                                            mode, bad_call):
    """F.scaled_dot_product_attention is torch's own function everywhere: its arguments are
    bound by torch, with torch's error, inside a stashed layer as outside, and nothing is kept."""
    import tiny_torch_models
    monkeypatch.setitem(tiny_torch_models.ATTENTION_FUNCTIONS, "sdpa", bad_call)
    model = gpt(checkpointing=mode, block_class=TableBlock)
    with pytest.raises(TypeError) as plain:
        loss_and_grads(model, ids())
    installed(model, layers=TableBlock)
    with pytest.raises(TypeError) as stashed:
        loss_and_grads(model, ids())
    assert str(stashed.value) == str(plain.value) and "scaled_dot_product_attention()" in str(plain.value)
    assert attnstash.stash_stats()["records"] == 0 and ops.frame_depth() == 0


def _saved_and_loaded(model):
    """torch.save(model) and torch.load of what it wrote (a whole model, not its state_dict)."""
    import io
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _slot_bases(model):
    return [m.__dict__["_attnstash"].slot_base for m in model.modules() if "_attnstash" in m.__dict__]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["the model checkpoints its blocks", "checkpoint_wrapper"])
def test_a_stashed_model_saved_whole_loads_stashed_with_an_install_of_its_own(mode, how, installed):
    # torch.save(model) mid-training: the loaded model is stashed as the saved one was (slots and
    # an install of its own, nothing the original held), trains bitwise, and uninstalls apart.
    base = gpt(checkpointing=mode) if how != "checkpoint_wrapper" else wrapped(gpt(), mode)
    tokens = ids()
    reference = loss_and_grads(copy.deepcopy(base), tokens)
    model = copy.deepcopy(base)
    named = {"layers": Block} if how != "checkpoint_wrapper" else {}
    installed(model, **named)
    loss = model(tokens).logsumexp(-1).mean()  # a forward in flight while it is saved
    loaded = _saved_and_loaded(model)
    assert [(i, n) for i, n, _ in attnstash.attention_layers(loaded, **named)] == \
        [(i, n) for i, n, _ in attnstash.attention_layers(model, **named)]
    assert set(_slot_bases(loaded)).isdisjoint(_slot_bases(model)) and len(set(_slot_bases(loaded))) == 3
    assert attnstash.layer_stash_stats(loaded) == {i: (0, 0, 0) for i in range(3)}
    for layer in loaded.modules():
        if "_attnstash" in layer.__dict__:
            assert layer.forward.__self__ is layer
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(loaded, tokens), reference)
    assert counters() == (keeps + 3, replays + 3)
    loss.backward()  # the original's own forward replays its own records
    assert counters() == (keeps + 3, replays + 6)
    attnstash.uninstall_attention_stash(loaded)
    assert not any("_attnstash" in m.__dict__ or "forward" in m.__dict__ for m in loaded.modules())
    assert_bitwise_equal(loss_and_grads(model, tokens), reference)  # the original keeps its install
    assert attnstash.stash_stats()["records"] == 0


def test_a_shallow_copy_of_a_stashed_layer_runs_its_own_forward(installed):
    # copy.copy: the copy shares the block's parameters, and is stashed with slots of its own.
    model = gpt(checkpointing="non-reentrant")
    installed(model, layers=Block)
    twin = copy.copy(model.blocks[1])
    assert twin.forward.__self__ is twin and twin.qkv is model.blocks[1].qkv
    assert _slot_bases(twin) != _slot_bases(model.blocks[1])
    x = torch.randn(2, 12, 32, requires_grad=True)
    keeps, replays = counters()
    out = torch.utils.checkpoint.checkpoint(twin, x, None, use_reentrant=False)
    assert attnstash.layer_stash_stats(twin) == {1: (1, attnstash.layer_stash_stats(twin)[1][1], 0)}
    assert attnstash.layer_stash_stats(model) == {i: (0, 0, 0) for i in range(3)}
    out.sum().backward()
    assert counters() == (keeps + 1, replays + 1)
    attnstash.uninstall_attention_stash(twin)
    assert "forward" not in twin.__dict__ and "_attnstash" in model.blocks[1].__dict__
