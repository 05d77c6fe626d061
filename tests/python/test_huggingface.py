"""install_attention_stash on tiny Hugging Face models, with reentrant checkpointing (the
models tiny_models builds) and non-reentrant checkpointing: the same loss and gradients
as the normal recompute, nothing held after, and a clear error for every set-up in which
a kept output could not be replayed or nothing would be kept."""
import copy
import gc

import numpy as np
import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnstash
from attnstash.install import transformers_adapter
from tiny_models import ARCHS, assert_bitwise_equal, batch, clone, loss_and_grads, nothing_installed, tiny_model

HF5 = int(transformers.__version__.split(".")[0]) >= 5
SUPPORTED_TEXT = "{0[0]}.{0[1]} to {1[0]}.{1[1]}".format(*transformers_adapter.SUPPORTED)


def counters():
    s = attnstash.stash_stats()
    return s["keeps"], s["replays"]


def assert_stash_gives_the_normal_recompute(base, step, installed, stashed=3):
    """step(model) -> (loss, grads) on a copy of `base` with the stash on its last `stashed`
    layers is bitwise step's result without it; each stashed layer keeps and replays once;
    nothing is held after."""
    reference = step(clone(base))
    model = clone(base)
    installed(model, stashed)
    keeps, replays = counters()
    assert_bitwise_equal(step(model), reference)
    assert counters() == (keeps + stashed, replays + stashed)
    assert attnstash.stash_stats()["entries"] == 0 and attnstash.stash_stats()["bytes"] == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stashed", [1, 2, 3])
def test_loss_and_every_gradient_equal_the_normal_recompute(arch, stashed, installed):
    base = tiny_model(arch)
    ids = batch()
    reference = loss_and_grads(clone(base), ids)
    assert_bitwise_equal(reference, loss_and_grads(clone(base), ids))  # the baseline is bitwise reproducible

    model = clone(base)
    assert installed(model, stashed) == list(range(3 - stashed, 3))
    keeps, replays = counters()
    got = loss_and_grads(model, ids)
    assert_bitwise_equal(got, reference)
    keeps2, replays2 = counters()
    assert keeps2 - keeps == replays2 - replays == stashed
    assert attnstash.stash_stats()["entries"] == 0 and attnstash.stash_stats()["bytes"] == 0


def test_the_stash_holds_one_output_per_stashed_layer_until_backward(installed):
    model = tiny_model("qwen3_moe")
    installed(model, 2)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    per_layer = attnstash.layer_stash_stats(model)
    # output [2, 4 heads, 24, 16] fp32 + LSE [2, 4, 24] fp32
    one = 2 * 4 * 24 * 16 * 4 + 2 * 4 * 24 * 4
    assert per_layer == {1: (1, one, 0), 2: (1, one, 0)}  # (entries, bytes, declined)
    loss.backward()
    assert attnstash.layer_stash_stats(model) == {1: (0, 0, 0), 2: (0, 0, 0)}


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_give_the_normal_recompute_bitwise(arch, side, installed):
    base = tiny_model(arch)
    ids = batch(batch_size=3)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 4, 9)):  # a different length per row
        if pad:
            mask[row, :pad] = 0 if side == "left" else 1
            if side == "right":
                mask[row, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_bitwise_equal(step(clone(base)), step(clone(base)))  # the baseline is bitwise reproducible
    assert_stash_gives_the_normal_recompute(base, step, installed)


def test_two_forwards_then_backwards_in_reverse_order_take_their_own_outputs(installed):
    base = tiny_model("mixtral")
    ids_a, ids_b = batch(seed=1), batch(seed=2)
    ref_model = clone(base)
    ref_model(input_ids=ids_a, labels=ids_a).loss.backward()
    ref_model(input_ids=ids_b, labels=ids_b).loss.backward()
    reference = {n: p.grad for n, p in ref_model.named_parameters()}

    model = clone(base)
    installed(model, 3)
    loss_a = model(input_ids=ids_a, labels=ids_a).loss
    loss_b = model(input_ids=ids_b, labels=ids_b).loss
    assert attnstash.stash_stats()["entries"] == 6
    loss_b.backward()
    loss_a.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, reference[n], rtol=0, atol=1e-6), n  # sums in another order
    # Bitwise against the same order without the stash.
    ref2 = clone(base)
    la, lb = ref2(input_ids=ids_a, labels=ids_a).loss, ref2(input_ids=ids_b, labels=ids_b).loss
    lb.backward()
    la.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref2.parameters()))


def test_gradient_accumulation_over_micro_batches_and_optimizer_steps(installed):
    base = tiny_model("qwen2")

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            for micro in range(3):
                ids = batch(seed=10 * step + micro)
                loss = model(input_ids=ids, labels=ids).loss / 3
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses, [p.detach().clone() for p in model.parameters()]

    ref_losses, ref_params = train(clone(base))
    model = clone(base)
    installed(model, 3)
    keeps, replays = counters()
    losses, params = train(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert counters() == (keeps + 27, replays + 27)
    assert attnstash.stash_stats()["entries"] == 0


def test_a_no_grad_forward_retains_nothing(installed):
    model = tiny_model("llama")
    reference = clone(model)
    installed(model, 3)
    ids = batch()
    with torch.no_grad():
        out = model(input_ids=ids).logits
        ref = reference(input_ids=ids).logits
    assert torch.equal(out, ref)
    del out
    gc.collect()
    assert attnstash.stash_stats()["entries"] == 0


def test_eval_and_generate_keep_nothing_and_match_the_original(installed):
    model = tiny_model("qwen3_moe")
    reference = clone(model)
    installed(model, 3)
    for m in (model, reference):
        m.eval()
    ids = batch()
    keeps = attnstash.stash_stats()["keeps"]
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    with torch.no_grad():
        gen = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
        ref = reference.generate(ids[:, :8], max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(gen, ref)
    assert attnstash.stash_stats()["keeps"] == keeps and attnstash.stash_stats()["entries"] == 0


# ---- fails instead of falling back ---------------------------------------------------------

def test_a_model_without_sdpa_is_refused():
    model = tiny_model("llama", attn="eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'.*sdpa"):
        attnstash.install_attention_stash(model, 1)


def test_a_model_without_layers_to_stash_is_refused_with_what_was_looked_for():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(attnstash.InstallError, match="found no layers to stash in Sequential: looked for transformers "
                                                     "GradientCheckpointingLayers.*diffusers.*checkpoint_wrapper.*"
                                                     "layers="):
        attnstash.install_attention_stash(model, 1)
    assert nothing_installed()


@pytest.mark.parametrize("bad", [True, 1.0, "2", 0, -1, 4])
def test_num_layers_must_be_an_int_between_1_and_the_layer_count(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="num_layers"):
        attnstash.install_attention_stash(model, bad)
    assert not any(hasattr(m, "_attnstash") for m in model.modules())


def test_a_second_install_on_a_stashed_layer_is_refused(installed):
    model = tiny_model("llama")
    installed(model, 2)
    with pytest.raises(ValueError, match="already has the stash"):
        attnstash.install_attention_stash(model, 3)
    assert attnstash.layer_stash_stats(model).keys() == {1, 2}


def test_a_transformers_without_the_layer_class_is_named(monkeypatch):
    import transformers.modeling_layers
    model = tiny_model("llama")
    monkeypatch.delattr(transformers.modeling_layers, "GradientCheckpointingLayer")
    with pytest.raises(attnstash.UnsupportedVersionError,
                       match=f"transformers {transformers.__version__} has no "
                             f"transformers.modeling_layers.GradientCheckpointingLayer.*{SUPPORTED_TEXT}"):
        attnstash.install_attention_stash(model, 1)


def versions_around_the_supported_range():
    (lo, hi) = transformers_adapter.SUPPORTED
    return [f"{lo[0]}.{lo[1] - 1}.2", f"{hi[0]}.{hi[1] + 1}.0", f"{hi[0] + 1}.0.0"]


@pytest.mark.parametrize("version", versions_around_the_supported_range())
def test_a_transformers_outside_the_supported_range_is_refused(version, monkeypatch, installed):
    model = tiny_model("llama")
    monkeypatch.setattr(transformers_adapter, "installed_version", lambda: version)
    with pytest.raises(attnstash.UnsupportedVersionError,
                       match=f"transformers {version} is not supported: .* {SUPPORTED_TEXT}.*"
                             "ATTNSTASH_ALLOW_UNTESTED_TRANSFORMERS=1"):
        attnstash.install_attention_stash(model, 1)
    assert nothing_installed()
    monkeypatch.setenv("ATTNSTASH_ALLOW_UNTESTED_TRANSFORMERS", "1")
    assert installed(model, 1) == [2]


def run_error(model, **kwargs):
    ids = batch()
    with pytest.raises(RuntimeError) as info:
        model(input_ids=ids, labels=ids, **kwargs).loss.backward()
    return str(info.value)


def test_training_without_checkpointing_fails(installed):
    model = tiny_model("llama")
    model.gradient_checkpointing_disable()
    installed(model, 1)
    msg = run_error(model)
    assert "layer 2 (model.layers.2, LlamaDecoderLayer)" in msg and "checkpointing is off for it" in msg
    assert "gradient_checkpointing is False" in msg and "gradient_checkpointing_enable()" in msg


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("offload", [False, True], ids=["non-reentrant", "non-reentrant+offload"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_non_reentrant_checkpointing_gives_the_normal_recompute_bitwise(arch, offload, padded, installed):
    # offload: what gradient_checkpointing_enable(offload=True) wraps the checkpoint in
    # (transformers 5 asks for pinned memory, which needs an accelerator, so by hand here).
    base = tiny_model(arch)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = batch()
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0

    def step(model):
        if not offload:
            return loss_and_grads(model, ids, attention_mask=mask)
        with torch.autograd.graph.save_on_cpu():
            return loss_and_grads(model, ids, attention_mask=mask)

    assert_stash_gives_the_normal_recompute(base, step, installed)


def test_reentrant_offloaded_checkpointing_fails(installed):
    # save_on_cpu would hand the reentrant recompute a copy of the layer input.
    model = tiny_model("llama")
    installed(model, 1)
    with torch.autograd.graph.save_on_cpu():
        msg = run_error(model)
    assert "layer 2 (model.layers.2" in msg and "offload" in msg and "use_reentrant=False" in msg
    assert attnstash.stash_stats()["entries"] == 0


def test_attention_dropout_fails(installed):
    model = tiny_model("qwen2", attention_dropout=0.1)
    installed(model, 1)
    msg = run_error(model)
    assert "layer 2 (model.layers.2" in msg and "dropout_p=0.1" in msg


def test_an_unsupported_sdpa_backend_is_named(installed):
    model = tiny_model("llama")
    installed(model, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        msg = run_error(model)
    assert "layer 2 (model.layers.2" in msg and "math backend" in msg


def test_a_recompute_with_nothing_kept_names_the_layer(installed):
    model = tiny_model("mistral")
    installed(model, 2)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    attnstash.stash_clear()
    with pytest.raises(attnstash.ReplayError,
                       match=r"layer 2 \(model.layers.2, MistralDecoderLayer\).*no attention output is kept"):
        loss.backward()


# ---- uninstall and several models ----------------------------------------------------------

def module_state(model):
    """What an install may touch on each module: its attributes and hooks."""
    return [(sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_uninstall_restores_the_original_behaviour():
    model = tiny_model("llama")
    before = module_state(model)
    attnstash.install_attention_stash(model, 3)
    assert not nothing_installed()
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    attnstash.uninstall_attention_stash(model)
    assert nothing_installed()
    assert module_state(model) == before
    model.gradient_checkpointing_disable()
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()  # would fail if anything were left
    assert attnstash.stash_stats()["entries"] == 0
    with pytest.raises(ValueError, match="no attention stash installed"):
        attnstash.uninstall_attention_stash(model)


def test_two_models_installed_at_once_do_not_interfere(installed):
    base_a, base_b = tiny_model("llama", seed=0), tiny_model("qwen3_moe", seed=1)
    ids = batch()
    ref_a, ref_b = loss_and_grads(clone(base_a), ids), loss_and_grads(clone(base_b), ids)
    a, b = clone(base_a), clone(base_b)
    installed(a, 3)
    installed(b, 1)
    loss_a = a(input_ids=ids, labels=ids).loss
    loss_b = b(input_ids=ids, labels=ids).loss
    assert attnstash.layer_stash_stats(a).keys() == {0, 1, 2} and attnstash.layer_stash_stats(b).keys() == {2}
    loss_a.backward()
    assert attnstash.layer_stash_stats(b)[2][0] == 1  # a's backward left b's output alone
    loss_b.backward()
    assert_bitwise_equal((loss_a.detach(), {n: p.grad for n, p in a.named_parameters()}), ref_a)
    assert_bitwise_equal((loss_b.detach(), {n: p.grad for n, p in b.named_parameters()}), ref_b)
    attnstash.uninstall_attention_stash(a)
    keeps = attnstash.stash_stats()["keeps"]
    b.zero_grad()
    assert_bitwise_equal(loss_and_grads(b, ids), ref_b)
    assert attnstash.stash_stats()["keeps"] == keeps + 1  # b still stashes its last layer


# ---- every decoder a user brings ------------------------------------------------------------

def test_install_is_all_or_nothing(monkeypatch):
    # A failure part-way (here: the third layer's forward cannot be wrapped) leaves no
    # attribute, wrapper or patch behind, and a later install works.
    from attnstash.install import core
    model = tiny_model("llama")
    before = module_state(model)
    wrap = core.LayerForward.__init__

    def refuse_the_third(self, layer):
        if layer is model.model.layers[2]:
            raise RuntimeError("refused")
        wrap(self, layer)

    monkeypatch.setattr(core.LayerForward, "__init__", refuse_the_third)
    with pytest.raises(RuntimeError, match="refused"):
        attnstash.install_attention_stash(model, max_bytes=100)
    monkeypatch.undo()
    assert module_state(model) == before and nothing_installed()
    assert attnstash.stash_max_bytes() is None
    assert attnstash.install_attention_stash(model) == [0, 1, 2]
    attnstash.uninstall_attention_stash(model)


@pytest.mark.parametrize("num_layers", [np.int64(2), torch.tensor(2), 2])
def test_num_layers_takes_what_operator_index_takes(num_layers, installed):
    assert installed(tiny_model("llama"), num_layers) == [1, 2]


def test_a_model_switched_to_eager_after_install_fails_at_its_first_training_forward(installed):
    model = tiny_model("llama")
    installed(model, 2)
    model.set_attn_implementation("eager")
    msg = run_error(model)
    assert "layer 1 (model.layers.1" in msg and "called no F.scaled_dot_product_attention" in msg
    assert 'attn_implementation="sdpa"' in msg
    assert attnstash.stash_stats()["entries"] == 0


@pytest.mark.parametrize("arch,attention", [("gpt2", "attn"), ("gpt_neox", "attention")])
def test_attention_found_by_what_it_is_not_by_its_name(arch, attention, installed):
    config = transformers.AutoConfig.for_model(arch, vocab_size=97, n_embd=64, hidden_size=64, n_layer=3,
                                               num_hidden_layers=3, n_head=4, num_attention_heads=4,
                                               intermediate_size=96, n_positions=128,
                                               max_position_embeddings=128, use_cache=False,
                                               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                               attention_dropout=0.0, hidden_dropout=0.0,
                                               tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    base.train()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    found = attnstash.attention_layers(base)
    assert [i for i, _, _ in found] == [0, 1, 2]
    ids = batch()
    reference = loss_and_grads(clone(base), ids)
    model = clone(base)
    assert installed(model, None) == [0, 1, 2]
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, ids), reference)
    assert counters() == (keeps + 3, replays + 3)


def test_a_deep_copy_carries_an_install_of_its_own(installed):
    base = tiny_model("llama")
    ids = batch()
    reference = loss_and_grads(clone(base), ids)
    model = clone(base)
    installed(model, 2)
    twin = copy.deepcopy(model)
    assert attnstash.layer_stash_stats(twin).keys() == {1, 2}
    with pytest.raises(ValueError, match="already has the stash"):
        attnstash.install_attention_stash(twin, 1)
    # Each trains with its own records: the copy's forward is held while the original trains.
    loss_twin = twin(input_ids=ids, labels=ids).loss
    assert attnstash.layer_stash_stats(twin) != attnstash.layer_stash_stats(model)
    keeps, replays = counters()
    assert_bitwise_equal(loss_and_grads(model, ids), reference)
    assert counters() == (keeps + 2, replays + 2)
    assert attnstash.layer_stash_stats(twin)[2][0] == 1  # the original's backward left the copy's record
    loss_twin.backward()
    assert torch.equal(loss_twin.detach(), reference[0])
    attnstash.uninstall_attention_stash(twin)
    assert not any(hasattr(m, "_attnstash") for m in twin.modules())
    assert attnstash.install_attention_stash(twin, 1) == [2]  # once uninstalled, it can be installed
    attnstash.uninstall_attention_stash(twin)
    assert attnstash.layer_stash_stats(model).keys() == {1, 2}  # the original keeps its install


def test_one_input_through_two_forwards_before_their_backwards(installed):
    # The same inputs_embeds twice before either backward: the two forwards of the first
    # layer cannot be told apart at their recomputes, but they are bitwise the same, so
    # they share one record; both backwards give the normal recompute's gradients.
    base = tiny_model("llama")
    ids = batch()
    embeds = base.get_input_embeddings()(ids).detach().requires_grad_()

    def two_forwards(model):
        model.zero_grad(set_to_none=True)
        e = embeds.detach().clone().requires_grad_()
        first = model(inputs_embeds=e, labels=ids).loss
        second = model(inputs_embeds=e, labels=ids).loss
        second.backward()
        first.backward()
        return first.detach() + second.detach(), {"embeds": e.grad, **{n: p.grad for n, p in
                                                                      model.named_parameters() if p.grad is not None}}

    reference = two_forwards(clone(base))
    model = clone(base)
    installed(model)
    keeps, replays = counters()
    assert_bitwise_equal(two_forwards(model), reference)
    assert counters() == (keeps + 6, replays + 6)


def test_one_input_through_two_different_forwards_is_refused_with_the_reason(installed):
    # Other position ids: the first layer's attention differs between the two forwards,
    # which a recompute could not tell apart.
    model = tiny_model("llama")
    installed(model)
    ids = batch()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    first = model(inputs_embeds=embeds, labels=ids).loss
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + 5
    with pytest.raises(RuntimeError) as info:
        model(inputs_embeds=embeds, labels=ids, position_ids=positions)
    msg = str(info.value)
    assert "layer 0 (model.layers.0" in msg and "different result" in msg and "inputs_embeds.clone()" in msg
    first.backward()  # the first forward is unharmed
    assert attnstash.stash_stats()["entries"] == 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_a_recompute_that_would_not_reproduce_its_random_numbers_is_refused(mode, installed):
    # Dropout before the projections (LoRA dropout here) with preserve_rng_state=False: the
    # recompute's query, key and value would differ from the first forward's.
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5))
    model.train()
    kwargs = {"use_reentrant": mode == "reentrant", "preserve_rng_state": False}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "reentrant":
        model.enable_input_require_grads()
    installed(model)
    msg = run_error(model)
    assert "draws random numbers before its attention" in msg and "preserve_rng_state=True" in msg
    assert attnstash.stash_stats()["entries"] == 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_lora_dropout_with_the_random_state_restored_trains_bitwise(mode, installed):
    peft = pytest.importorskip("peft")

    def make():
        model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                       lora_dropout=0.5))
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        if mode == "reentrant":
            model.enable_input_require_grads()
        return model

    ids = batch()

    def step(model):
        torch.manual_seed(7)
        return loss_and_grads(model, ids)

    reference = step(make())
    model = make()
    installed(model)
    assert_bitwise_equal(step(model), reference)


def test_a_transformers_that_no_longer_calls_the_checkpoint_function_is_named(monkeypatch, installed):
    # As if a release checkpointed its layers another way: the stand-in sits under a name
    # transformers does not call. The error says what was not reached, with the release, and
    # does not claim that checkpointing is off.
    monkeypatch.setattr(transformers_adapter, "NAME", "_a_name_transformers_does_not_call")
    model = tiny_model("llama")
    installed(model, 1)
    msg = run_error(model)
    assert f"transformers {transformers.__version__}" in msg and "_gradient_checkpointing_func" in msg
    assert "with gradient_checkpointing on, but without calling its checkpoint function" in msg
    assert "off" not in msg
    assert attnstash.stash_stats()["entries"] == 0
