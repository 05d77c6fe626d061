"""install_attention_stash on tiny Hugging Face models, with reentrant checkpointing (the models
tiny_models builds), non-reentrant and offloaded checkpointing: the same loss and gradients as
the normal recompute, bit for bit (any number of stashed layers, padded batches, several forwards
before their backwards, gradient accumulation, attention found in decoders of any naming, one
input through two forwards, LoRA dropout with the random state restored), one output held per
stashed layer until the backward, nothing kept by no-grad forwards, eval or generate, and
nothing held after."""
import gc

import pytest
import torch
import transformers

import attnstash
from tiny_models import ARCHS, assert_bitwise_equal, batch, clone, counters, loss_and_grads, tiny_model


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
    assert attnstash.stash_stats()["records"] == 0 and attnstash.stash_stats()["bytes"] == 0


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
    assert attnstash.stash_stats()["records"] == 0 and attnstash.stash_stats()["bytes"] == 0


def test_the_stash_holds_one_output_per_stashed_layer_until_backward(installed):
    model = tiny_model("qwen3_moe")
    installed(model, 2)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    per_layer = attnstash.layer_stash_stats(model)
    # output [2, 4 heads, 24, 16] fp32 + LSE [2, 4, 24] fp32
    one = 2 * 4 * 24 * 16 * 4 + 2 * 4 * 24 * 4
    assert per_layer == {1: (1, one, 0), 2: (1, one, 0)}  # (records, bytes, declined)
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
    assert attnstash.stash_stats()["records"] == 6
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
    assert attnstash.stash_stats()["records"] == 0


def test_a_no_grad_forward_retains_nothing(installed):
    # A training-mode forward under no_grad runs the checkpoint, but no backward can reach it:
    # nothing is kept, not even for an input the user holds that requires grad (inputs_embeds).
    model = tiny_model("llama")
    reference = clone(model)
    installed(model, 3)
    ids = batch()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    keeps = counters()[0]
    with torch.no_grad():
        out = model(input_ids=ids).logits
        ref = reference(input_ids=ids).logits
        out_embeds = model(inputs_embeds=embeds).logits
        ref_embeds = reference(inputs_embeds=embeds).logits
    assert torch.equal(out, ref) and torch.equal(out_embeds, ref_embeds)
    assert counters()[0] == keeps
    assert attnstash.stash_stats()["records"] == 0  # embeds, layer 0's input, is still alive
    del out, out_embeds
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0


def test_a_reentrant_checkpoint_whose_inputs_need_no_grad_keeps_nothing(installed):
    # Frozen embeddings without the hook transformers adds for them (enable_input_require_grads),
    # or a frozen part of a model (BLT's patcher): no input of any layer's reentrant checkpoint
    # requires grad, so none gets a node and none is recomputed. Nothing is kept for a recompute
    # that never comes.
    base = tiny_model("llama")
    if hasattr(base, "_require_grads_hook"):  # (gradient_checkpointing_enable adds it from transformers 5.0)
        base.disable_input_require_grads()
    base.get_input_embeddings().weight.requires_grad_(False)
    ids = batch()
    reference = loss_and_grads(clone(base), ids)
    model = clone(base)
    installed(model, 3)
    keeps, replays = counters()
    unused = attnstash.stash_stats()["released_unused"]
    assert_bitwise_equal(loss_and_grads(model, ids), reference)
    assert counters() == (keeps, replays)
    assert attnstash.stash_stats()["released_unused"] == unused
    assert attnstash.stash_stats()["records"] == 0


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
    assert attnstash.stash_stats()["keeps"] == keeps and attnstash.stash_stats()["records"] == 0


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
