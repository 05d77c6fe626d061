"""A stashed layer compiled on its own inside an activation checkpoint that runs eagerly:
`block.compile()` or `torch.compile(block)` called by `checkpoint(block, x)` in the model's
forward, and diffusers' compile_repeated_blocks (attnstash/install/compiled.py,
_eager_checkpoint_forward). The layer's attention is traced as attnstash::_sdpa_compiled,
which keeps in the checkpoint's first forward and takes it back in its recompute as the graph
runs: the same graphs and call nodes as without the stash, one attention forward per call per
step instead of two, losses and gradients bitwise the same compiled run without the stash,
and nothing held after."""
import gc

import pytest
import torch
import torch._dynamo

import attnstash
import tiny_torch_models as plain
from compile_cases import bitwise_equal, with_and_without_stash
from test_compile_installed import diffusers_flux, hugging_face, nanogpt_runs

MODES = ["non-reentrant", "reentrant"]


def each_block(how, fullgraph=False):
    """Each block compiled where the model's own eager checkpoint calls it."""
    def compile_it(model, backend):
        for i, block in enumerate(model.blocks):
            if how == "block.compile()":
                block.compile(backend=backend, fullgraph=fullgraph)
            else:
                model.blocks[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
        return model
    return compile_it


def assert_same_graphs_and_saving(without, with_stash, calls):
    """The same graphs and call nodes with the stash as without, but for the two markers of each
    graph's compiled frame (which AOT autograd does not record: benchmarks.compiled.Counting)."""
    (runs_a, forwards_a, counted_a), (runs_b, forwards_b, counted_b) = without, with_stash
    assert counted_a.graphs >= 1 and (counted_b.graphs, counted_b.nodes) == (counted_a.graphs, counted_a.nodes)
    assert counted_a.markers == 0 and counted_b.markers == 2 * counted_b.graphs
    assert forwards_a == 2 * calls and forwards_b == calls, (forwards_a, forwards_b)
    assert bitwise_equal(runs_a, runs_b)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("how", ["block.compile()", "torch.compile(block)", "block.compile(fullgraph=True)"])
def test_each_block_compiled_inside_the_models_checkpoint_keeps_its_graphs_and_runs_attention_once(how, backend,
                                                                                                  mode):
    if backend == "inductor" and how != "block.compile()":
        pytest.skip("inductor: one way is enough (the traced graph is the same for each)")
    compile_it = each_block(how.split("(")[0] + "()", fullgraph="fullgraph" in how)
    before = attnstash.stash_stats()
    without = nanogpt_runs(mode, False, compile_it, backend=backend)
    with_stash = nanogpt_runs(mode, True, compile_it, backend=backend)
    assert_same_graphs_and_saving(without, with_stash, calls=3)
    after = attnstash.stash_stats()
    # The registry keeps and replays here (the compiled graph calls the ops): 3 blocks, 2 steps.
    assert after["keeps"] - before["keeps"] == after["replays"] - before["replays"] == 6


def test_a_compiled_diffusers_transformer_with_compile_repeated_blocks():
    # diffusers' compile_repeated_blocks: each repeated block class compiled once, inside the
    # model's own (eager, non-reentrant) checkpoint of each block.
    def compile_it(model, counting):
        if not hasattr(model, "compile_repeated_blocks"):
            pytest.skip("this diffusers release has no compile_repeated_blocks")
        model.compile_repeated_blocks(backend=counting)
        return model

    results = with_and_without_stash(diffusers_flux(), compile_it)
    (_, forwards, _), _ = results
    assert forwards % 2 == 0 and forwards
    assert_same_graphs_and_saving(*results, calls=forwards // 2)


@pytest.mark.parametrize("mode", MODES)
def test_under_autocast_bf16_with_fp32_weights(mode):
    class Autocast(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, mask=None):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(tokens, mask).float()

    def compile_blocks(model, backend):
        return Autocast(each_block("block.compile()")(model, backend))

    without = nanogpt_runs(mode, False, compile_blocks)
    with_stash = nanogpt_runs(mode, True, compile_blocks)
    assert_same_graphs_and_saving(without, with_stash, calls=3)


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_declines_inside_the_compiled_graph_as_in_eager(mode):
    # The registry keeps here, so its budget acts: a declined call's recompute runs attention.
    torch._dynamo.reset()
    model = plain.gpt(checkpointing=mode)
    reference = plain.gpt(checkpointing=mode)
    reference.load_state_dict(model.state_dict())
    each_block("block.compile()")(reference, "aot_eager")
    attnstash.install_attention_stash(model, layers=plain.Block, max_bytes=3500)  # room for one of three
    try:
        each_block("block.compile()")(model, "aot_eager")
        before = attnstash.stash_stats()
        ids = plain.ids()
        runs = [plain.loss_and_grads(m, ids) for m in (reference, model)]
        after = attnstash.stash_stats()
    finally:
        attnstash.uninstall_attention_stash(model)
    assert after["keeps"] - before["keeps"] == 1 and after["declined"] - before["declined"] == 2
    assert after["peak_bytes"] <= 3500
    assert bitwise_equal(runs[:1], runs[1:])
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_forward_is_released_once_its_inputs_are(mode):
    # No graph node owns these records (the compiled graph's node is torch's): they go with the
    # layer inputs they were kept for, which the dropped graph held.
    torch._dynamo.reset()
    model = plain.gpt(checkpointing=mode)
    attnstash.install_attention_stash(model, layers=plain.Block)
    try:
        each_block("block.compile()")(model, "aot_eager")
        loss = model(plain.ids()).float().pow(2).mean()
        assert attnstash.stash_stats()["records"] == 3
        del loss
        gc.collect()
        assert attnstash.stash_stats()["records"] == 0
        plain.loss_and_grads(model, plain.ids())  # and training goes on
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_no_grad_forward_in_training_mode_keeps_nothing_and_attends_as_without(mode):
    # Validation without model.eval(): grad off, inputs that require no grad. Not a reentrant
    # checkpoint's first forward, so the compiled blocks attend with torch's own op.
    outputs = []
    for use_stash in (False, True):
        torch._dynamo.reset()
        model = plain.gpt(checkpointing=mode)
        if use_stash:
            attnstash.install_attention_stash(model, layers=plain.Block)
        try:
            targets = []

            def recording(gm, example_inputs):
                targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
                return gm.forward

            each_block("block.compile()")(model, recording)
            before = attnstash.stash_stats()
            with torch.no_grad():
                outputs.append((model(plain.ids()), sorted(targets)))
            assert attnstash.stash_stats()["keeps"] == before["keeps"]
        finally:
            if use_stash:
                attnstash.uninstall_attention_stash(model)
    (a, targets_a), (b, targets_b) = outputs
    assert torch.equal(a, b) and targets_a == targets_b and not any("attnstash" in t for t in targets_b)


@pytest.mark.parametrize("mode", MODES)
def test_each_transformers_layer_compiled_on_its_own(mode):
    # Regional compilation (layer.compile() on each decoder layer). Before transformers 5.23 the
    # layer's checkpoint function runs eagerly around its compiled call (its frame routes none of
    # the calls, the graph calls the ops: compiled.calls_the_ops); from 5.23 the checkpoint is
    # inside the compiled forward (the selective policy, whose nested checkpoint adds call nodes).
    # Either way: the same graphs, half the attention forwards, bitwise.
    def compile_each_layer(model, counting):
        for layer in model.model.layers:
            layer.compile(backend=counting)
        return model

    results = with_and_without_stash(hugging_face(mode), compile_each_layer)
    (runs_a, forwards_a, counted_a), (runs_b, forwards_b, counted_b) = results
    assert counted_a.graphs >= 1 and counted_b.graphs == counted_a.graphs and counted_b.nodes >= counted_a.nodes
    assert (forwards_a, forwards_b) == (6, 3) and bitwise_equal(runs_a, runs_b)
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_break_inside_a_compiled_stashed_layer_is_refused_and_leaves_no_frame(mode):
    # What the layer keeps cannot be traced across a break: the stash says so, never falls back.
    class Breaking(plain.Block):
        def forward(self, x, mask=None):
            torch._dynamo.graph_break()
            return super().forward(x, mask)

    torch._dynamo.reset()
    model = plain.gpt(checkpointing=mode, block_class=Breaking)
    attnstash.install_attention_stash(model, layers=Breaking)
    try:
        each_block("block.compile()")(model, "aot_eager")
        with pytest.raises(attnstash.CheckpointingError, match="torch.compile breaks its graph inside it"):
            plain.loss_and_grads(model, plain.ids())
    finally:
        attnstash.uninstall_attention_stash(model)
    from attnstash.install import compiled
    assert compiled.open_frames() == 0 and attnstash.stash_stats()["records"] == 0


_FAIL = [False]


@torch.compiler.allow_in_graph
def _fails_when_told(x):
    """A node of the graph that raises where the graph runs, not where it is traced."""
    if _FAIL[0]:
        raise ValueError("raised after attention")
    return x


def test_a_graph_run_as_traced_that_raises_leaves_no_frame_to_take_later_calls():
    # The "eager" backend runs dynamo's graph itself, its frame's markers included: a run that
    # raises between them leaves its frame behind, which takes no call made after it.
    class Raising(plain.Block):
        def forward(self, x, mask=None):
            return _fails_when_told(super().forward(x, mask))

    torch._dynamo.reset()
    model = plain.gpt(checkpointing="reentrant", block_class=Raising)
    attnstash.install_attention_stash(model, layers=Raising)
    try:
        each_block("block.compile()")(model, "eager")
        plain.loss_and_grads(model, plain.ids())  # traced and run once
        _FAIL[0] = True
        with pytest.raises(ValueError, match="raised after attention"):
            plain.loss_and_grads(model, plain.ids())
    finally:
        _FAIL[0] = False
        attnstash.uninstall_attention_stash(model)
    gc.collect()
    keeps = attnstash.stash_stats()["keeps"]
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    from attnstash.install import compiled
    assert attnstash.stash_stats()["keeps"] == keeps and compiled.open_frames() == 0
    assert attnstash.stash_stats()["records"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_layer_that_calls_no_attention_is_refused_as_in_eager(mode):
    # Its graph calls no op, so no eager frame may take it for one that does (calls_the_ops).
    class NoAttention(plain.Block):
        def forward(self, x, mask=None):
            return x + self.mlp(self.norm2(x))

    torch._dynamo.reset()
    model = plain.gpt(checkpointing=mode, block_class=NoAttention)
    attnstash.install_attention_stash(model, layers=NoAttention)
    try:
        each_block("block.compile()")(model, "aot_eager")
        with pytest.raises(attnstash.CheckpointingError, match="called no F.scaled_dot_product_attention"):
            plain.loss_and_grads(model, plain.ids())
    finally:
        attnstash.uninstall_attention_stash(model)
    assert attnstash.stash_stats()["records"] == 0
