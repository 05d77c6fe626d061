"""torch.compile-traced training loops with the installer (attnstash/install/compiled.py): every
way people compile checkpointed models keeps its compiled graphs with the stash, runs one
attention forward per attention call per step instead of two, trains to the same losses and
gradients as the same compiled configuration without the stash (bitwise), and leaves nothing
held. Counted: the graphs dynamo hands the backend and their call nodes (compile_cases.Counting),
and the fused attention forwards of a step (torch.profiler)."""
import warnings

import pytest
import torch
import torch._dynamo

import attnstash
import tiny_torch_models as plain
from attnstash.install import compiled
from compile_cases import bitwise_equal, compiled_run, traceable_checkpoints, with_and_without_stash

MODES = ["non-reentrant", "reentrant"]


def whole_model(fullgraph=False):
    def compile_it(model, backend):
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    return compile_it


def each_wrapped_block(how, fullgraph=False):
    """torchtitan's order: checkpoint_wrapper on each block (done before the install), then each
    wrapped block compiled: torch.compile(block) in its place, or block.compile()."""
    def compile_it(model, backend):
        for i, block in enumerate(model.blocks):
            if how == "torch.compile":
                model.blocks[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
            else:
                block.compile(backend=backend, fullgraph=fullgraph)
        return model
    return compile_it


def nanogpt_runs(mode, use_stash, compile_it, backend="aot_eager", wrapped=False, steps=2):
    """Training steps of the nanoGPT-style model (3 blocks, its forward checkpoints each; or its
    blocks wrapped by checkpoint_wrapper), compiled by compile_it: (runs, attention forwards of
    the last step, the counting backend)."""
    def build():
        model = plain.gpt(checkpointing=mode)
        if wrapped:
            plain.wrapped(model, mode)
        ids = plain.ids()
        return model, lambda run: plain.loss_and_grads(run, ids)
    return compiled_run(use_stash, build, compile_it, backend, steps, layers=None if wrapped else plain.Block)


def hugging_face(mode, padded=False, layers=None, **batch):
    """A build for compiled_run: a tiny Llama (the same weights each time; `layers` of them where
    given), its checkpointing on in `mode`, its training step on a fixed batch (tiny_models.batch
    with `batch`; a padding mask on its second row where `padded`)."""
    from tiny_models import batch as make_batch, clone, loss_and_grads, tiny_model
    base = tiny_model("llama", **({} if layers is None else {"layers": layers}))
    ids = make_batch(**batch)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0

    def build():
        model = clone(base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        return model, lambda run: loss_and_grads(run, ids, **({} if mask is None else {"attention_mask": mask}))
    return build


def diffusers_flux():
    """A build for compiled_run: a tiny diffusers Flux transformer, its blocks checkpointed by the
    model (non-reentrant, its default)."""
    tiny = pytest.importorskip("tiny_diffusers")

    def build():
        model, inputs = tiny.build("FluxTransformer2DModel")
        model.enable_gradient_checkpointing()
        return model, lambda run: tiny.loss_and_grads(run, inputs)
    return build


def assert_compiled_and_saving(without, with_stash, calls):
    (runs_a, forwards_a, counted_a), (runs_b, forwards_b, counted_b) = without, with_stash
    assert counted_a.graphs >= 1 and counted_b.graphs >= counted_a.graphs, (counted_a.graphs, counted_b.graphs)
    assert counted_b.nodes >= counted_a.nodes, (counted_a.nodes, counted_b.nodes)
    assert forwards_a == 2 * calls and forwards_b == calls, (forwards_a, forwards_b)
    assert bitwise_equal(runs_a, runs_b)
    assert attnstash.stash_stats()["records"] == 0


WAYS = {
    "torch.compile(model)": (whole_model(), False),
    "torch.compile(model, fullgraph=True)": (whole_model(fullgraph=True), False),
    "wrapped, torch.compile(block)": (each_wrapped_block("torch.compile"), True),
    "wrapped, block.compile()": (each_wrapped_block("block.compile"), True),
    "wrapped, torch.compile(block, fullgraph=True)": (each_wrapped_block("torch.compile", fullgraph=True), True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", list(WAYS))
def test_a_compiled_checkpointed_model_keeps_its_graphs_and_runs_attention_once(way, mode):
    compile_it, wrapped = WAYS[way]
    saved = compiled.saved_calls()
    without = nanogpt_runs(mode, False, compile_it, wrapped=wrapped)
    with_stash = nanogpt_runs(mode, True, compile_it, wrapped=wrapped)
    assert_compiled_and_saving(without, with_stash, calls=3)
    assert compiled.saved_calls() > saved  # the compiled graphs save the stashed layers' attention


# PyTorch 2.14's partitioner cannot place the attention output that SAC saves when the model adds
# it to a Python 0 (the block model's sum over its calls), with attnstash or without (README, Limits).
TORCH_214_SAC_SUM = pytest.mark.xfail(torch.__version__.startswith("2.14."), strict=False,
                                      raises=torch._dynamo.exc.BackendCompilerFailed,
                                      reason="PyTorch 2.14 partitioner: SAC-saved attention output added to 0")


@TORCH_214_SAC_SUM
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", ["torch.compile(model)", "wrapped, torch.compile(block)"])
def test_with_inductor_too(way, mode):
    compile_it, wrapped = WAYS[way]
    without = nanogpt_runs(mode, False, compile_it, backend="inductor", wrapped=wrapped)
    with_stash = nanogpt_runs(mode, True, compile_it, backend="inductor", wrapped=wrapped)
    assert_compiled_and_saving(without, with_stash, calls=3)


def test_the_layers_of_a_model_share_their_compiled_code():
    # Each wrapped block compiled on its own: without the stash dynamo compiles one graph for
    # the three (same code, the parameters as inputs); the stash must not make that one a block
    # (a recompile per layer, and eager past dynamo's recompile limit).
    compile_it, wrapped = WAYS["wrapped, torch.compile(block)"]
    (_, _, counted_a), (_, _, counted_b) = (nanogpt_runs("non-reentrant", s, compile_it, wrapped=True)
                                            for s in (False, True))
    assert counted_a.graphs == counted_b.graphs == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_hugging_face_model_keeps_its_graph_and_runs_attention_once(mode):
    # What Trainer(torch_compile=True) does: compile the whole model. Padded batch, both layers
    # stashed: loss and gradients bitwise the compiled run without.
    results = with_and_without_stash(hugging_face(mode, layers=2, batch_size=2, seq=32, padded=True),
                                     lambda model, counting: torch.compile(model, backend=counting))
    assert_compiled_and_saving(*results, calls=2)


def test_a_compiled_diffusers_transformer_keeps_its_graph_and_runs_attention_once():
    # diffusers' transformer.compile() (ModelMixin: torch.compile of the module call), its
    # blocks checkpointed by the model (non-reentrant, its default).
    def compile_it(model, counting):
        model.compile(backend=counting)
        return model

    results = with_and_without_stash(diffusers_flux(), compile_it)
    (_, forwards, _), _ = results
    assert forwards % 2 == 0 and forwards
    assert_compiled_and_saving(*results, calls=forwards // 2)


def test_a_budget_cannot_act_inside_a_compiled_graph_and_says_so():
    torch._dynamo.reset()
    model = plain.gpt(checkpointing="non-reentrant")
    attnstash.install_attention_stash(model, layers=plain.Block, max_bytes="1MiB")
    try:
        with pytest.raises(Exception, match="a budget cannot demote or decline inside a compiled graph.*"
                                            "num_layers set to what attnstash.plan"):
            plain.loss_and_grads(torch.compile(model, backend="aot_eager"), plain.ids())
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_max_bytes() is None and attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_trainer_torch_compile_with_the_callback_trains_like_without_and_says_what_compile_saved(mode, tmp_path,
                                                                                                  capfd):
    # Trainer(torch_compile=True): the same logged losses and bitwise weights as the compiled run
    # without the stash; no "kept nothing" warning (stash_stats counts nothing: the graphs save).
    pytest.importorskip("peft")
    from test_trainer import trainer_run
    options = dict(reentrant=mode == "reentrant", torch_compile=True, torch_compile_backend="aot_eager")
    with traceable_checkpoints():
        torch._dynamo.reset()
        plain_run = trainer_run(tmp_path / "plain", **options)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (other libraries')
            run = trainer_run(tmp_path / "stash", callback=attnstash.AttentionStashCallback(), **options)
    err = capfd.readouterr().err
    assert run.losses == plain_run.losses and len(run.losses) == 4
    assert all(torch.equal(plain_run.weights[n], run.weights[n]) for n in plain_run.weights)
    assert "kept nothing" not in err
    assert "attnstash: 3 layers stashed; 0 keeps, 0 replays, 0 declined; peak 0 bytes held; torch.compile traced" \
           in err, err
    assert attnstash.stash_stats()["records"] == 0


class _Switch:
    value = 0


SWITCH = _Switch()


def with_a_side_effect(forward):
    """A forward that sets an attribute of a global object first, as the `kernels` package's
    wrappers do around attention modules' forwards (transformers 5.25 requires that package):
    dynamo cannot trace a checkpoint around it under its defaults."""
    def forward_with_a_side_effect(*args, **kwargs):
        SWITCH.value += 1
        return forward(*args, **kwargs)
    return forward_with_a_side_effect


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_dynamo_cannot_trace_runs_eagerly_and_the_stash_keeps_there_and_says_so(mode):
    # The whole model compiled, each layer's checkpoint untraceable (a side effect inside it, under
    # dynamo's defaults): torch.utils.checkpoint runs each eagerly, with or without the stash. The
    # stash keeps and replays there (one attention forward per call instead of two, bitwise) and
    # warns once; before, it ran attention more often than without the stash and kept nothing.
    base = hugging_face(mode)

    def build():
        model, step = base()
        for layer in model.model.layers:
            layer.self_attn.forward = with_a_side_effect(layer.self_attn.forward)
        return model, step

    without = compiled_run(False, build, whole_model(), traceable=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with_stash = compiled_run(True, build, whole_model(), traceable=False)
    (runs_a, forwards_a, counted_a), (runs_b, forwards_b, counted_b) = without, with_stash
    assert (forwards_a, forwards_b) == (6, 3) and bitwise_equal(runs_a, runs_b)
    assert counted_b.graphs == counted_a.graphs >= 1
    fell_back = [w for w in said if issubclass(w.category, attnstash.StashWarning)]
    assert len(fell_back) == 1 and "torch.compile traced the activation checkpoint of layer 0" in \
        str(fell_back[0].message) and "skip_fwd_side_effects_in_bwd_under_checkpoint" in str(fell_back[0].message)
    assert attnstash.stash_stats()["records"] == 0 and compiled.open_frames() == 0


@pytest.mark.parametrize("mode", MODES)
def test_under_autocast_bf16_with_fp32_weights_too(mode):
    # Mixed precision: the attention op the policy saves is the one autocast casts for; bitwise.
    class Autocast(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, mask=None):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(tokens, mask).float()

    def autocast_step(model, backend):
        return torch.compile(Autocast(model), backend=backend)

    without = nanogpt_runs(mode, False, autocast_step)
    with_stash = nanogpt_runs(mode, True, autocast_step)
    assert_compiled_and_saving(without, with_stash, calls=3)


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_hugging_face_model_under_inductor_equal_losses_gradients_to_the_last_bits(mode):
    # Under inductor the saved attention can change what inductor recomputes and fuses, so the
    # gradients may differ in the last bits (README, Limits): the losses stay bitwise equal, the
    # attention forwards halve, and no gradient differs by more than 1e-6 of its largest value.
    results = with_and_without_stash(hugging_face(mode), lambda model, counting: torch.compile(model, backend=counting),
                                     backend="inductor")
    (runs_a, forwards_a, _), (runs_b, forwards_b, _) = results
    assert (forwards_a, forwards_b) == (6, 3)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(runs_a, runs_b):
        assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
        for name in grads_a:
            scale = grads_a[name].abs().max().clamp_min(1e-30)
            assert ((grads_a[name] - grads_b[name]).abs().max() / scale).item() <= 1e-6, name
    assert attnstash.stash_stats()["records"] == 0
