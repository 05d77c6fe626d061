"""The set-ups real training runs use every day, with the stash on Hugging Face models:
mixed precision (autocast with fp32 weights), forwards dropped without a backward, no-grad
forwards, interrupted steps, several threads on one model. Each gives the loss and
gradients of the normal recompute bitwise, or a clear error, and leaves nothing held.
Run under both transformers versions (make test)."""
import gc
import random
import threading
import weakref

import pytest
import torch

import attnstash
from attnstash import ops
from tiny_models import assert_bitwise_equal, batch, clone, loss_and_grads, tiny_model

MODES = {"reentrant": True, "non-reentrant": False}


def checkpointed(arch="llama", mode="reentrant", **kwargs):
    model = tiny_model(arch, **kwargs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
    return model


def counts():
    s = attnstash.stash_stats()
    return s["keeps"], s["replays"]


def assert_nothing_held():
    s = attnstash.stash_stats()
    assert s["records"] == 0 and s["bytes"] == 0, s
    assert ops.frame_depth() == 0, "a forward left its frame on this thread"




# ---- mixed precision ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_an_fp32_model_under_autocast_trains_bitwise_like_without_the_stash(mode, dtype, padded, installed):
    # Hugging Face's rotary embedding leaves query and key in fp32 while value comes out of
    # the projection in the autocast dtype: the ops must cast them all, as F.sdpa does.
    base = checkpointed("llama", mode)
    ids = batch()
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0

    def step(model):
        with torch.autocast("cpu", dtype=dtype):
            return loss_and_grads(model, ids, attention_mask=mask)

    reference = step(clone(base))
    assert_bitwise_equal(reference, step(clone(base)))  # the baseline is reproducible
    model = clone(base)
    installed(model)
    keeps, replays = counts()
    assert_bitwise_equal(step(model), reference)
    assert counts() == (keeps + 3, replays + 3)  # every layer kept and replayed: no silent fallback
    assert_nothing_held()


def test_the_kept_output_under_autocast_is_in_the_autocast_dtype(installed):
    # Were q, k and v kept in fp32, the loss would differ from autocast's (checked above);
    # here the held bytes show it directly: bf16 output + fp32 log-sum-exp.
    model = checkpointed("llama")
    installed(model, 1)
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    heads, head_dim = 4, 16
    assert attnstash.layer_stash_stats(model)[2] == (1, 2 * heads * 24 * head_dim * 2 + 2 * heads * 24 * 4, 0)
    loss.backward()
    assert_nothing_held()


# ---- forwards that never get a backward -----------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_forward_is_released_as_soon_as_its_graph_is(mode, installed):
    model = checkpointed("llama", mode)
    installed(model)
    released = attnstash.stash_stats()["released_unused"]
    ids = batch()
    out = model(input_ids=ids, labels=ids)
    assert attnstash.stash_stats()["records"] == 3
    del out
    gc.collect()
    assert attnstash.ops.held_ids() == []  # released with the graph (held_ids releases nothing itself)
    stats = attnstash.stash_stats()
    assert stats["records"] == 0 and stats["bytes"] == 0  # no later forward was needed
    assert stats["released_unused"] == released + 3
    # and training goes on
    assert_bitwise_equal(loss_and_grads(model, ids), loss_and_grads(attnstash_free_copy(model), ids))
    assert_nothing_held()


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_forward_is_released_with_its_graph_while_the_user_holds_its_input(mode, installed):
    """The graph's node owns what its first forward kept: dropping the graph releases it at
    once, even where the anchor lives on (inputs_embeds the user holds is layer 0's input), so
    that releasing the records of freed anchors cannot be what frees them."""
    model = checkpointed("llama", mode)
    installed(model)
    ids = batch()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, labels=ids)
    assert attnstash.stash_stats()["records"] == 3
    del out
    gc.collect()
    stats = attnstash.stash_stats()
    assert stats["records"] == 0 and stats["bytes"] == 0

    def step(m):  # the same input trains on, bitwise the run without the stash
        x = embeds.detach().requires_grad_()
        loss = m(inputs_embeds=x, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}  # not the embedding's
        return loss.detach(), {"inputs_embeds": x.grad, **grads}

    assert_bitwise_equal(step(model), step(attnstash_free_copy(model)))
    assert_nothing_held()


def attnstash_free_copy(model):
    """A deep copy of a stashed model without the stash."""
    copy = clone(model)
    attnstash.uninstall_attention_stash(copy)
    return copy


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_forward_frees_every_layer_input(mode, installed):
    # The kept records must not hold the graph (and through it every layer's input).
    model = checkpointed("llama", mode)
    installed(model)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])) if not
                                             torch._C._current_graph_task_id() != -1 else None)
             for layer in model.model.layers]
    try:
        ids = batch()
        out = model(input_ids=ids, labels=ids)
        assert all(r() is not None for r in inputs) and len(inputs) == 3
        del out
        gc.collect()
        assert all(r() is None for r in inputs), "a dropped forward's layer inputs are still held"
    finally:
        for h in hooks:
            h.remove()
    assert_nothing_held()


@pytest.mark.parametrize("mode", MODES)
def test_a_no_grad_forward_on_inputs_the_user_holds_keeps_nothing(mode, installed):
    # Train mode, checkpointing on, inputs_embeds that require grad, under no_grad: no
    # backward can reach it, so nothing may be kept; the next training step on the same
    # tensor then works and equals the one without the stash.
    base = checkpointed("llama", mode)
    model = clone(base)
    installed(model)
    ids = batch()
    embeds = base.get_input_embeddings()(ids).detach().requires_grad_()
    keeps = attnstash.stash_stats()["keeps"]
    with torch.no_grad():
        model(inputs_embeds=embeds, labels=ids)
    assert attnstash.stash_stats()["keeps"] == keeps and attnstash.stash_stats()["records"] == 0

    def step(m):
        m.zero_grad(set_to_none=True)
        e = embeds.detach().requires_grad_()
        loss = m(inputs_embeds=e, labels=ids).loss
        loss.backward()
        return loss.detach(), {"embeds": e.grad, **{n: p.grad for n, p in m.named_parameters() if p.grad is not None}}

    assert_bitwise_equal(step(model), step(clone(base)))
    assert_nothing_held()


# ---- interrupted steps ----------------------------------------------------------------------

class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (a BaseException, not an Exception)."""


@pytest.mark.parametrize("mode", MODES)
def test_interrupted_steps_leave_nothing_held(mode):
    # Interrupt at a random module call of a random step, in the forward or in the backward
    # (recompute); once the step and its graph are gone, nothing may be held, with no later
    # forward needed; training then goes on bitwise like without the stash, and the model
    # is garbage once dropped (nothing left behind holds it).
    model = checkpointed("llama", mode)
    attnstash.install_attention_stash(model)
    rng = random.Random(0)
    # Leaf modules of the decoder layers run once in the forward and once in the recompute:
    # the interrupt comes in the first (after=0) or in the second (after=1).
    names = [n for n, m in model.model.layers.named_modules() if not list(m.children())]
    ids = batch()
    interrupted = 0
    for trial in range(30):
        target, after = model.model.layers.get_submodule(rng.choice(names)), rng.randint(0, 1)
        calls = [0]

        def hook(module, args):
            calls[0] += 1
            if calls[0] > after:
                raise Interrupt()

        handle = target.register_forward_pre_hook(hook)
        target = None
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        except Interrupt:
            interrupted += 1
        finally:
            handle.remove()
        loss = None
        gc.collect()
        s = attnstash.stash_stats()
        assert s["records"] == 0 and s["bytes"] == 0, f"trial {trial}: {s}"
        assert_nothing_held()
        model.zero_grad(set_to_none=True)
    assert interrupted == 30
    assert_bitwise_equal(loss_and_grads(model, ids), loss_and_grads(attnstash_free_copy(model), ids))
    attnstash.uninstall_attention_stash(model)
    model.zero_grad(set_to_none=True)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "something still holds the model"


def test_a_keyboard_interrupt_in_a_layer_releases_its_kept_output_at_once(installed):
    model = checkpointed("llama")
    installed(model)
    raised = []

    def interrupt(module, args):
        raised.append(1)
        raise KeyboardInterrupt

    handle = model.model.layers[1].mlp.register_forward_pre_hook(interrupt)
    ids = batch()
    try:
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    gc.collect()
    assert raised and attnstash.stash_stats()["records"] == 0
    assert_nothing_held()


@pytest.mark.parametrize("kind", ["transformers", "plain PyTorch"])
def test_an_interrupted_reentrant_forward_releases_its_kept_output_while_its_traceback_lives(kind, installed):
    # The frame owns what a reentrant first forward keeps until it closes (torch_ops/frames.h):
    # interrupted after its attention, the forward's records go as the error leaves it, while the
    # traceback still holds the layer input and (transformers) the token it was kept under.
    import offload_cases
    case = offload_cases.build(kind, "reentrant")
    installed(case.model, **case.install)
    layer = case.layers[1]
    mlp = layer.mlp

    def interrupt(module, args):
        if torch._C._current_graph_task_id() == -1:
            raise KeyboardInterrupt

    handle = mlp.register_forward_pre_hook(interrupt)
    try:
        case.forward(case.model)
    except KeyboardInterrupt as error:
        held = attnstash.stash_stats()["records"]
        traceback = error.__traceback__
    finally:
        handle.remove()
    assert traceback is not None and held == 1  # layer 0's, which the interrupted layer 1's graph holds
    del traceback
    gc.collect()
    assert attnstash.stash_stats()["records"] == 0
    assert_nothing_held()


# ---- several threads, one model ---------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_two_threads_training_one_model_get_the_single_threaded_gradients(mode, installed):
    # Two threads, one model, each its own batches, forwards and recomputes interleaved.
    # Non-reentrant: each thread takes autograd.grad, fully concurrently. Reentrant
    # checkpointing refuses autograd.grad, so each thread runs backward() under a lock (its
    # forward still runs while the other thread is in its backward, recompute included)
    # and reads the gradients it accumulated.
    base = checkpointed("llama", mode)
    batches = [batch(seed=s) for s in range(12)]
    params = list(base.parameters())
    backward_lock = threading.Lock()

    def grads(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        if mode == "non-reentrant":
            return [loss.detach()] + list(torch.autograd.grad(loss, list(model.parameters())))
        with backward_lock:
            model.zero_grad(set_to_none=True)
            loss.backward()
            out = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        return out

    reference = [grads(base, ids) for ids in batches]
    assert len(reference[0]) == len(params) + 1
    model = clone(base)
    installed(model)
    keeps, replays = counts()
    results, errors = {}, []

    def worker(indices):
        try:
            for i in indices:
                results[i] = grads(model, batches[i])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(k, 12, 2),)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(12):
        assert all(torch.equal(a, b) for a, b in zip(results[i], reference[i])), f"batch {i} differs"
    assert counts() == (keeps + 36, replays + 36)
    assert_nothing_held()


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_replicas_run_their_own_modules_and_train_like_the_model(mode, installed):
    # torch.nn.DataParallel replicates a module for each device at every forward
    # (torch.nn.parallel.replicate: a copy of each module's __dict__, Module._replicate_for_data_parallel,
    # with its parameters' broadcast copies set on it), runs the replicas' forwards in threads, and
    # the backward reaches the model's parameters through those copies. Replication needs CUDA;
    # this does the same on CPU, with clones for the broadcast copies. Each replica's stashed
    # layers must run the replica's own modules (a replica bound to the original would run the
    # original's modules: on a GPU, on another device), share the stash, and train bitwise.
    base = checkpointed("llama", mode)
    model = clone(base)
    installed(model)
    batches = [batch(seed=s) for s in (3, 4)]
    replicas = [replicate(model) for _ in batches]
    for replica in replicas:
        stashed = [m for m in replica.modules() if "_attnstash" in m.__dict__]
        assert len(stashed) == 3 and all(m.forward.__self__ is m for m in stashed)
    losses, errors = [None, None], []

    def run(k):
        try:
            losses[k] = replicas[k](input_ids=batches[k], labels=batches[k]).loss
        except BaseException as e:
            errors.append(e)

    keeps, replays = counts()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):  # each replica's backward apart, both forwards in flight until then
        copies = [getattr(r, name) for r, m in zip(replicas[k].modules(), model.modules())
                  for name, parameter in m._parameters.items() if parameter is not None]
        reached = set()
        for t in copies:
            t.register_hook(lambda grad, t=t: reached.add(id(t)))
        model.zero_grad(set_to_none=True)
        losses[k].backward()
        assert len(reached) == len(copies) == len(list(model.parameters()))  # through the replica's own copies
        base.zero_grad(set_to_none=True)
        assert_bitwise_equal((losses[k].detach(), {n: p.grad for n, p in model.named_parameters()}),
                             loss_and_grads(base, batches[k]))
    assert counts() == (keeps + 6, replays + 6)
    # DataParallel itself on a machine without GPUs runs the module as it is.
    dp = torch.nn.DataParallel(model)
    ids = batches[0]
    keeps = attnstash.stash_stats()["keeps"]
    dp(input_ids=ids, labels=ids).loss.backward()
    if not torch.cuda.is_available():
        assert attnstash.stash_stats()["keeps"] == keeps + 3
    assert_nothing_held()


def replicate(module):
    """What torch.nn.parallel.replicate does to each module, without a GPU: its copy
    (Module._replicate_for_data_parallel, which starts with no parameters) with a copy of each
    parameter set on it that is not a leaf and passes its gradient to the parameter (the
    broadcast copies replicate() sets), the children replicated alike."""
    memo = {}

    def copy(m):
        if m in memo:
            return memo[m]
        r = m._replicate_for_data_parallel()
        for name, parameter in m._parameters.items():
            if parameter is None:
                r._parameters[name] = None
            else:
                setattr(r, name, parameter.clone())
        memo[m] = r
        for name, child in m._modules.items():
            r._modules[name] = copy(child) if child is not None else None
        return r

    return copy(module)


# ---- the training flag changed between a forward and its backward ----------------------------

@pytest.mark.parametrize("mode", MODES)
def test_model_eval_between_a_forward_and_its_backward(mode, installed):
    # The recompute follows its first forward, whatever the training flag says by then.
    def step(model):
        model.zero_grad(set_to_none=True)
        ids = batch()
        loss = model(input_ids=ids, labels=ids).loss
        model.eval()
        loss.backward()
        model.train()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    base = checkpointed("llama", mode)
    reference = step(clone(base))
    model = clone(base)
    installed(model)
    keeps, replays = counts()
    assert_bitwise_equal(step(model), reference)
    assert counts() == (keeps + 3, replays + 3)
    assert_nothing_held()
