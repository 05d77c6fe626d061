"""The Hugging Face training stack: transformers.Trainer with gradient checkpointing and
the stash installed, with and without a PEFT LoRA adapter, trains to the same losses and
weights as without the stash, and ends with the stash empty; so does AttentionStashCallback
with Trainer (mixed precision included) and with TRL's SFTTrainer, and it reports the
stash's figures in the training logs."""
import contextlib
import functools
import os
import tempfile

import pytest
import torch
import transformers

import attnstash
from attnstash.integrations.trainer import FIGURES, PREFIX, AttentionStashCallback
from tiny_models import VOCAB, checkpoint_wrapped, checkpointing_field, nothing_installed, tiny_model

peft = pytest.importorskip("peft")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows=12, seq=24):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(tmp_path, lora, stash, reentrant=True):
    model = tiny_model("qwen3_moe", seed=0)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    if stash:
        attnstash.install_attention_stash(model, 3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    keeps = attnstash.stash_stats()["keeps"]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    kept = attnstash.stash_stats()["keeps"] - keeps
    if stash:
        attnstash.uninstall_attention_stash(model)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, weights, kept


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_trainer_with_the_stash_trains_like_without(tmp_path, lora, reentrant):
    losses, weights, _ = train(tmp_path / "plain", lora, stash=False, reentrant=reentrant)
    stashed_losses, stashed_weights, kept = train(tmp_path / "stash", lora, stash=True, reentrant=reentrant)
    assert len(losses) == 4 and stashed_losses == losses
    assert weights.keys() == stashed_weights.keys()
    assert all(torch.equal(weights[n], stashed_weights[n]) for n in weights)
    assert kept == 3 * 4  # every stashed layer kept (and replayed) once per step
    assert attnstash.stash_stats()["records"] == 0 and attnstash.stash_stats()["bytes"] == 0


# ---- AttentionStashCallback ------------------------------------------------------------------
# The callback installs the stash at train begin, on the model the trainer trains (the PEFT
# model, SFTTrainer's own wrapping included), reports its figures in the training logs and
# uninstalls it at train end. The runs below use llama (faster than qwen3_moe on CPU).

KEYS = [PREFIX + name for name in FIGURES]
LAYERS = 3  # tiny_model's decoder layers, all stashed


class Recorder(transformers.TrainerCallback):
    """What a reporting integration sees: the logs each on_log receives. Passed in
    callbacks= before the stash's callback, so it runs first unless the callback moves itself."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


class Run:
    def __init__(self, trainer, model, recorder):
        self.trainer, self.model, self.recorder = trainer, model, recorder
        history = trainer.state.log_history
        self.losses = [entry["loss"] for entry in history if "loss" in entry]
        self.training_logs = [entry for entry in history if "loss" in entry]
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def fresh_accelerator_state():
    """Each run here sets up its mixed precision from its own arguments, and leaves none behind:
    transformers 4.57's TrainingArguments(bf16=True) sets os.environ["ACCELERATE_MIXED_PRECISION"]
    and never unsets it, and accelerate's AcceleratorState is process-wide, so any later Trainer
    in the process (bf16=False or not) would train under bf16 autocast. Build the
    TrainingArguments inside."""
    from accelerate.state import AcceleratorState
    saved = os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    AcceleratorState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state()
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        if saved is not None:
            os.environ["ACCELERATE_MIXED_PRECISION"] = saved


def lora_model(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def trainer_run(output_dir, *, lora=False, reentrant=True, callback=None, model=None, steps=4, **overrides):
    if model is None:
        model = tiny_model("llama", seed=0)
        if lora:
            model = lora_model(model)
    options = dict(output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0,
                   dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True,
                   gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    options.update(overrides)
    recorder = Recorder()
    with fresh_accelerator_state():
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**options),
                                       train_dataset=Tokens(), callbacks=[recorder] + ([callback] if callback else []))
        trainer.train()
    return Run(trainer, model, recorder)


@functools.lru_cache(maxsize=None)
def plain_run(lora, reentrant, bf16=False):
    """The same run without the stash (each configuration once per session)."""
    with tempfile.TemporaryDirectory() as output_dir:
        run = trainer_run(output_dir, lora=lora, reentrant=reentrant, bf16=bf16)
    return run.losses, run.weights


def assert_same_training(plain, run):
    losses, weights = plain
    assert len(losses) == 4 and run.losses == losses
    assert weights.keys() == run.weights.keys()
    assert all(torch.equal(weights[n], run.weights[n]) for n in weights)


def assert_reported(run, callback, keeps=LAYERS, declined=0, recomputed=0):
    """Every training log has the figures (per logging step), in state.log_history and in
    what the callback placed before it received; the callback ran first; nothing is left."""
    for entry in run.training_logs:
        figures = {key: entry[key] for key in KEYS}
        assert figures == {PREFIX + "bytes": 0, PREFIX + "peak_bytes": figures[PREFIX + "peak_bytes"],
                           PREFIX + "keeps": keeps, PREFIX + "replays": keeps, PREFIX + "declined": declined,
                           PREFIX + "recomputed": recomputed}
        assert all(type(value) is int for value in figures.values())
        assert (figures[PREFIX + "peak_bytes"] > 0) == (keeps > 0)
    seen = [logs for logs in run.recorder.logs if "loss" in logs]
    assert len(seen) == len(run.training_logs) == 4
    assert all({key: logs[key] for key in KEYS} == {key: entry[key] for key in KEYS}
               for logs, entry in zip(seen, run.training_logs))
    # evaluation-free runs: the final summary log has no figures
    assert all(not any(key in logs for key in KEYS) for logs in run.recorder.logs if "loss" not in logs)
    assert run.trainer.callback_handler.callbacks[0] is callback
    assert_uninstalled(run.model, callback)


def assert_uninstalled(model, callback):
    assert attnstash.layer_stash_stats(model) == {}
    assert nothing_installed()  # F.scaled_dot_product_attention and GradientCheckpointingLayer are as they were
    assert callback.uninstall() is False
    held = attnstash.stash_stats()
    assert held["records"] == 0 and held["bytes"] == 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_callback_trains_like_without_and_reports(tmp_path, lora, reentrant):
    callback = AttentionStashCallback()
    run = trainer_run(tmp_path, lora=lora, reentrant=reentrant, callback=callback)
    assert_same_training(plain_run(lora, reentrant), run)
    assert_reported(run, callback)
    if lora:
        assert isinstance(run.trainer.model, peft.PeftModel)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_callback_reports_the_attention_recomputed_outside_the_stash(tmp_path, reentrant, capsys):
    # One of the three checkpointed layers stashed: the other two run their attention again in
    # each backward, which the figures and the last line count.
    callback = AttentionStashCallback(num_layers=1)
    run = trainer_run(tmp_path, reentrant=reentrant, callback=callback)
    assert_same_training(plain_run(False, reentrant), run)
    assert_reported(run, callback, keeps=1, recomputed=2)
    assert ("attnstash: 1 layers stashed; 4 keeps, 4 replays, 0 declined, 8 attention calls recomputed outside the "
            "stash; peak ") in capsys.readouterr().err


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_callback_under_mixed_precision(tmp_path, reentrant):
    """Trainer(bf16=True, use_cpu=True) on an fp32 model: autocast to bf16 around each step."""
    callback = AttentionStashCallback()
    run = trainer_run(tmp_path, reentrant=reentrant, callback=callback, bf16=True)
    assert next(run.model.parameters()).dtype == torch.float32
    assert_same_training(plain_run(False, reentrant, bf16=True), run)
    assert run.losses != plain_run(False, reentrant)[0]  # bf16 autocast did run
    assert_reported(run, callback)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_callback_on_layers_checkpointed_by_checkpoint_wrapper(tmp_path, reentrant):
    # Checkpointed, though no layer's gradient_checkpointing is on: the callback installs, and
    # the run trains like the same run without it.
    plain = trainer_run(tmp_path / "plain", model=checkpoint_wrapped(tiny_model("llama", seed=0), reentrant),
                        gradient_checkpointing=False)
    callback = AttentionStashCallback()
    run = trainer_run(tmp_path / "stash", model=checkpoint_wrapped(tiny_model("llama", seed=0), reentrant),
                      callback=callback, gradient_checkpointing=False)
    assert_same_training((plain.losses, plain.weights), run)
    assert_reported(run, callback)


def test_callback_uninstall_after_a_step_that_raised_releases_and_uninstalls():
    # A forward whose backward never comes (the step raised), through layers whose non-reentrant
    # checkpoint calls the module: its graph would hold up a plain uninstall; the callback's
    # releases what it holds and uninstalls.
    model = checkpoint_wrapped(tiny_model("llama", seed=0), reentrant=False)
    callback = AttentionStashCallback()
    with fresh_accelerator_state():
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=model)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    assert attnstash.stash_stats()["records"] == LAYERS
    assert callback.uninstall() is True
    assert_uninstalled(model, callback)
    del loss


def test_callback_num_layers_and_budget(tmp_path):
    """max_bytes=0 declines every keep (the recomputes run attention: same training, counted as
    declined, not as recomputed outside the stash); the budget is the callback's for the run
    only, and num_layers picks the last layers (the first one's recompute is outside it)."""
    attnstash.stash_set_max_bytes("1GiB")
    try:
        callback = AttentionStashCallback(num_layers=2, max_bytes=0)
        run = trainer_run(tmp_path, reentrant=False, callback=callback)
        assert attnstash.stash_max_bytes() == 2**30
    finally:
        attnstash.stash_set_max_bytes(None)
    assert_same_training(plain_run(False, False), run)
    assert_reported(run, callback, keeps=0, declined=2, recomputed=1)


def test_callback_without_gradient_checkpointing_fails_at_train_begin(tmp_path):
    model = tiny_model("llama", seed=0)
    model.gradient_checkpointing_disable()
    callback = AttentionStashCallback(max_bytes="1MiB")
    field = checkpointing_field()
    with pytest.raises(ValueError, match=rf"needs gradient checkpointing.*TrainingArguments.{field}=False.*"
                                         rf"Set {field}=True"):
        trainer_run(tmp_path, model=model, callback=callback, gradient_checkpointing=False)
    assert attnstash.stash_max_bytes() is None  # nothing installed, the budget untouched
    assert_uninstalled(model, callback)


def test_callback_install_errors_reach_the_user_at_train_begin(tmp_path):
    eager = tiny_model("llama", seed=0, attn="eager")
    callback = AttentionStashCallback()
    with pytest.raises(ValueError, match=r"cannot install the stash on the trainer's model.*attn_implementation"):
        trainer_run(tmp_path, model=eager, callback=callback)
    assert_uninstalled(eager, callback)
    by_hand = tiny_model("llama", seed=0)
    attnstash.install_attention_stash(by_hand)
    try:
        with pytest.raises(ValueError, match="not both"):
            trainer_run(tmp_path, model=by_hand, callback=callback)
    finally:
        attnstash.uninstall_attention_stash(by_hand)
    assert_uninstalled(by_hand, callback)
    with pytest.raises(ValueError, match="byte count"):
        AttentionStashCallback(max_bytes="lots")
    with pytest.raises(ValueError, match="num_layers"):
        AttentionStashCallback(num_layers=2.0)


def test_callback_outside_a_callback_handler(caplog):
    """Called by something else than the Trainer's CallbackHandler, it cannot run first: it
    warns, and still puts the figures in the logs and in the matching log_history entry. A
    first training log with nothing kept warns too (the model trained is not the one given)."""
    model = tiny_model("llama", seed=0)
    callback = AttentionStashCallback()
    with fresh_accelerator_state():
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    with caplog.at_level("WARNING", logger="attnstash.integrations.trainer"):
        callback.on_train_begin(args, state, control, model=model)
    assert "could not find the trainer's callback list" in caplog.text
    assert callback.layers == [0, 1, 2]
    with caplog.at_level("WARNING", logger="attnstash.integrations.trainer"):
        callback.on_log(args, state, control, logs={"loss": 4.6}, model=model)  # nothing ran: warns
        assert "the stash kept nothing since training began" in caplog.text
        caplog.clear()
        ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        logs = {"loss": 4.5, "learning_rate": 0.01}
        state.log_history.append({**logs, "step": 1})
        callback.on_log(args, state, control, logs=logs, model=model)
    assert {**logs, "step": 1} == state.log_history[-1] and logs[PREFIX + "keeps"] == LAYERS
    assert caplog.text == ""
    other = {"eval_loss": 4.0}
    callback.on_log(args, state, control, logs=other, model=model)
    assert other == {"eval_loss": 4.0}
    callback.on_train_end(args, state, control, model=model)
    assert_uninstalled(model, callback)


class FailOnce(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step == self.step:
            self.step = None
            raise KeyboardInterrupt("stopped mid-training")


def test_callback_after_a_train_that_raised(tmp_path):
    """A train() that raises skips on_train_end: the stash stays installed (documented), the
    next train begin replaces it, and callback.uninstall() removes it and restores the budget."""
    model = tiny_model("llama", seed=0)
    callback = AttentionStashCallback(max_bytes="1MiB")
    try:
        with fresh_accelerator_state():
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                gradient_checkpointing=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                           callbacks=[FailOnce(2), callback])
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
            assert sorted(attnstash.layer_stash_stats(model)) == [0, 1, 2]
            assert attnstash.stash_max_bytes() == 2**20
            trainer.train()  # replaces the leftover stash, trains, uninstalls
            keeps = [entry[PREFIX + "keeps"] for entry in trainer.state.log_history if "loss" in entry]
            assert keeps == [LAYERS] * 3
            assert attnstash.stash_max_bytes() is None
            assert_uninstalled(model, callback)
            trainer.add_callback(FailOnce(1))
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
        assert attnstash.layer_stash_stats(model)
        assert callback.uninstall() is True
        assert attnstash.stash_max_bytes() is None
        assert_uninstalled(model, callback)
    finally:
        callback.uninstall()
        attnstash.stash_set_max_bytes(None)


# ---- TRL's SFTTrainer -------------------------------------------------------------------------

def sft_run(output_dir, lora, callback=None):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), unk_token="t0", pad_token="t0",
        eos_token="t1")
    data = datasets.Dataset.from_dict({"input_ids": Tokens().ids.tolist()})  # pre-tokenized: used as it is
    model = tiny_model("llama", seed=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if lora else None
    recorder = Recorder()
    with fresh_accelerator_state():
        # SFTConfig's defaults otherwise: gradient checkpointing on (transformers' default mode), bf16
        args = trl.SFTConfig(output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                 peft_config=config, callbacks=[recorder] + ([callback] if callback else []))
        trainer.train()
    return Run(trainer, trainer.model, recorder)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_callback_with_trl_sft_trainer(tmp_path, lora):
    plain = sft_run(tmp_path / "plain", lora)
    callback = AttentionStashCallback()
    run = sft_run(tmp_path / "stash", lora, callback)
    assert_same_training((plain.losses, plain.weights), run)
    assert_reported(run, callback)
    assert isinstance(run.model, peft.PeftModel) == lora  # SFTTrainer wrapped it after the callback was made
