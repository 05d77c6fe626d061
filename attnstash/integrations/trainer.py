"""AttentionStashCallback: the attention stash for transformers.Trainer and TRL's trainers.

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[attnstash.AttentionStashCallback()])
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(...), train_dataset=data, peft_config=lora,
                             callbacks=[attnstash.AttentionStashCallback()])

The callback installs the stash (attnstash.install_attention_stash) on the model the
trainer trains when training begins, reports the stash's figures in the trainer's logs, and
uninstalls it when training ends. See AttentionStashCallback for the details.
"""
import logging
import os
import sys
import weakref

from transformers import TrainerCallback

from ..errors import InstallError

from .. import budget, install, ops
from ..install import compiled, torch_adapter
from ..install.layers import layer_count

logger = logging.getLogger(__name__)

PREFIX = "attnstash/"
"""The prefix of the keys the callback adds to the trainer's logs."""

FIGURES = ("bytes", "peak_bytes", "keeps", "replays", "declined", "recomputed")
"""The figures each training log gets, as PREFIX + name (AttentionStashCallback says what each is)."""

_IN_THE_LINE = ("keeps", "replays", "declined")  # summary() gives each; recomputed only where it is not 0
_COUNTERS = _IN_THE_LINE + ("recomputed",)  # reported as the increase since the previous log
_HANDLER_FRAMES = 6  # how far up the stack on_train_begin looks for the CallbackHandler that calls it

# model -> the callback whose stash it has: a stash a train() left installed (it raised before
# on_train_end, or auto_find_batch_size retried it) is replaced at the next train begin.
_installed_by = weakref.WeakKeyDictionary()


class AttentionStashCallback(TrainerCallback):
    """The attention stash for transformers.Trainer, and so for TRL's SFTTrainer and the other
    Trainer subclasses: pass it in `callbacks=[AttentionStashCallback()]`.

    At train begin (on_train_begin) it installs the stash on the model the trainer trains (the
    callback's `model`, which is the PEFT model when the trainer wraps one: SFTTrainer's
    peft_config included), after the trainer has enabled gradient checkpointing (both
    transformers 4.57 and 5.x enable it in train() before on_train_begin), reentrant or not.
    At train end (on_train_end) it uninstalls it (and its budget ends with it).

    Args:
        num_layers: how many attention layers to stash, counted from the last; None: all of
            them (as install_attention_stash).
        max_bytes: the stash's budget for the run: an int or a string such as "8GiB"
            (attnstash.parse_bytes); keeps over it are declined and counted. None leaves the
            budget as it is. It is install_attention_stash's max_bytes: it lasts as long as
            the install.
        install: False to only report on the model's stash, installed some other way (what
            ATTNSTASH_LAYERS adds to every Trainer: attnstash/integrations/autostash.py).
        offload: install_attention_stash's offload: what the stash keeps waits in host memory
            until its recompute.

    At train end it prints one line to stderr: the layers stashed, and the keeps, replays,
    declined keeps, attention calls recomputed outside the stash (where there were any) and peak
    bytes of the run (summary()).

    What it logs. Every training log (a log the trainer makes at a logging step: one with
    "loss"; evaluation logs and the end-of-training summary are left alone) gets, as ints:

        attnstash/bytes        bytes the stash holds at the log (0 once every kept output was
                               replayed; more means records wait for a backward)
        attnstash/peak_bytes   the most bytes held at once since the previous training log
                               (since train begin for the first); the callback resets the
                               stash's peak (attnstash.stash_reset_peak) at train begin and at
                               each training log
        attnstash/keeps        forwards that kept their attention output, since the previous log
        attnstash/replays      recomputes that took a kept output back, since the previous log
        attnstash/declined     keeps the budget declined (those recomputes ran attention), since
                               the previous log
        attnstash/recomputed   attention calls the backward ran again outside the stash (layers
                               not stashed: num_layers, or checkpointed where the installer does
                               not reach), since the previous log; 0 where every checkpointed
                               attention layer is stashed

    The figures are the process-wide stash's (attnstash.stash_stats): other models trained in
    the same process at the same time add to them. If the first training log of a run finds
    nothing kept or declined, the callback warns: the trainer trains another model than the
    one it gives its callbacks (Trainer(model_init=...) does, the callback then stashes the
    model from the trainer's __init__), or the stashed layers did not run. The callback that
    ATTNSTASH_LAYERS adds (install=False) says instead, at train begin and in its summary, why
    the trainer's model has no stash: checkpointing was never turned on in the process, or
    only for other models.

    Where they go. Trainer.log appends a copy of the logs to state.log_history, then calls
    every callback's on_log with the logs dict, in the order of the trainer's callback list,
    which starts with the reporting integrations (report_to: TensorBoard, W&B, MLflow, ...) and
    ends with the callbacks passed in `callbacks=`. So that every callback sees the figures,
    at train begin the callback moves itself to the front of that list (it finds the
    trainer's CallbackHandler, the caller of its on_train_begin); its on_log then adds the
    figures to the logs dict before any other callback reads it, and to the entry Trainer.log
    just appended to state.log_history. Should it not find the handler (a trainer that calls
    callbacks some other way), it warns once: state.log_history and the callbacks after it
    still get the figures, callbacks before it do not.

    Raises (from trainer.train(), at train begin; nothing is left installed):
        attnstash.InstallError (a ValueError): the model trains without gradient checkpointing
            (TrainingArguments.activation_checkpointing=False, gradient_checkpointing before
            transformers 5.23, and no layer checkpointed, by itself or by torch's
            checkpoint_wrapper as FSDP's activation checkpointing wraps it: set it True, which
            SFTConfig does by default, or turn checkpointing on on the model), or some stashed layers are not
            checkpointed; the model cannot take the stash (install_attention_stash's error: not
            attn_implementation="sdpa", no attention layers, a bad num_layers); the model
            already has a stash installed by hand (use one or the other).
        At construction: ValueError for a max_bytes parse_bytes refuses, InstallError for a
            num_layers that is not an int.

    A train() that raises (an exception in a step, Ctrl-C) ends without on_train_end, so the
    stash stays installed on the model (kept outputs are released with their graphs all the
    same). The next train begin of any AttentionStashCallback on that model replaces it (so a
    second trainer.train(), and Trainer's auto_find_batch_size retry, just work);
    callback.uninstall() removes it and restores the budget at once.
    """

    def __init__(self, num_layers=None, max_bytes=None, *, install=True, offload=False):
        budget.parse_bytes(max_bytes)  # a bad budget or layer count fails here, not at train begin
        if not isinstance(offload, bool):
            raise ValueError(f"attnstash: AttentionStashCallback(offload=...) must be True or False, got {offload!r}.")
        self.num_layers = layer_count(num_layers)
        self.max_bytes, self.offload = max_bytes, offload
        self.installs = install   # False: only report (the stash comes from elsewhere: ATTNSTASH_LAYERS)
        self.layers = None        # the decoder layers stashed in the current run (install_attention_stash's result)
        self._model = None        # weakref to the model with the stash, while installed
        self._last = None         # the counters at the previous training log
        self._first = None        # whether on_train_begin found the handler and moved itself first
        self._warned = False
        self._logged = False      # whether the current run made a training log
        self._run = None          # {counter: value at train begin, "peak_bytes": the run's peak so far}
        self._unstashed = None    # why the trainer's model has no stash (install=False), said at train begin
        self.autostash = None     # ATTNSTASH_LAYERS's module, when that added this callback (install=False)

    def __repr__(self):
        return (f"AttentionStashCallback(num_layers={self.num_layers!r}, max_bytes={self.max_bytes!r}"
                + ("" if self.installs else ", install=False") + (", offload=True" if self.offload else "") + ")")

    # ---- the trainer's events ----------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise InstallError("attnstash: AttentionStashCallback got no model at train begin; it needs the model the "
                             "trainer trains (transformers.Trainer passes it to its callbacks).")
        self._first = self._run_first()
        if not self.installs:  # report what the model's stash does
            self.layers = sorted(install.layer_stash_stats(model))
            self._model = weakref.ref(model)
            self._unstashed = None if self.layers else self._why_unstashed(args, model)
            if self._unstashed:
                logger.warning("attnstash: %s", self._unstashed)
            self._start_counting()
            return
        leftover = _installed_by.get(model)
        if leftover is not None:  # a train() that raised, or an auto_find_batch_size retry
            logger.info("attnstash: removing the stash an earlier train() left installed on %s (it ended without "
                        "on_train_end)", type(model).__name__)
            leftover.uninstall()
        if install.layer_stash_stats(model):
            raise InstallError(
                f"attnstash: the trainer's model ({type(model).__name__}) already has the attention stash, installed "
                "with install_attention_stash: use AttentionStashCallback or install_attention_stash, not both. Remove "
                "the callback, or call attnstash.uninstall_attention_stash(model) before training.")
        try:
            layers = install.install_attention_stash(model, self.num_layers, max_bytes=self.max_bytes,
                                                     offload=self.offload)
        except InstallError as e:
            raise InstallError(f"attnstash: AttentionStashCallback cannot install the stash on the trainer's model "
                               f"({type(model).__name__}): {str(e).removeprefix('attnstash: ')}") from e
        try:
            self._check_checkpointing(args, model, layers)
        except BaseException:
            install.uninstall_attention_stash(model)
            raise
        self.layers = layers
        self._model = weakref.ref(model)
        _installed_by[model] = self
        self._start_counting()

    def _start_counting(self):
        stats = ops.stash_stats()
        self._last = {name: stats[name] for name in _COUNTERS}
        self._run = {**self._last, "peak_bytes": 0, "compiled": compiled.saved_calls()}
        self._logged = False
        ops.stash_reset_peak()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._model is None or not isinstance(logs, dict) or "loss" not in logs:
            return
        entry = state.log_history[-1] if state.log_history else None
        # The entry Trainer.log appended for these logs: a copy of them, so the same loss object.
        appended = isinstance(entry, dict) and entry.get("loss", None) is logs["loss"]
        figures = self.figures()
        traced = compiled.saved_calls() > self._run["compiled"]  # torch.compile saves instead (install/compiled.py)
        if not (self._logged or self._unstashed or traced or figures[PREFIX + "keeps"] or figures[PREFIX + "declined"]):
            logger.warning(
                "attnstash: the stash kept nothing since training began: "
                + ("the trainer trains another model than the one it gave AttentionStashCallback "
                   "(Trainer(model_init=...) gives callbacks the model from its __init__), or " if self.installs else "")
                + "the stashed layers did not run.")
        self._logged = True
        logs.update(figures)
        if appended:
            entry.update(figures)
        elif not self._warned:
            self._warned = True
            logger.warning("attnstash: AttentionStashCallback did not find the trainer's state.log_history entry for "
                           "this log; the attnstash/ figures are in the logs the callbacks see only.")

    def on_train_end(self, args, state, control, **kwargs):
        summary = self.summary()
        if summary:
            print(summary, file=sys.stderr, flush=True)
        if self.installs:
            self.uninstall()
        else:
            self._model = None

    def summary(self):
        """One line on the run since train begin: layers stashed, keeps, replays, declined,
        attention calls recomputed outside the stash (where any were), peak bytes (None before a
        train begin). on_train_end prints it."""
        if self._run is None:
            return None
        stats = ops.stash_stats()
        peak = max(self._run["peak_bytes"], stats["peak_bytes"])
        counts = ", ".join(f"{stats[name] - self._run[name]} {name}" for name in _IN_THE_LINE)
        recomputed = stats["recomputed"] - self._run["recomputed"]
        if recomputed:
            counts += f", {recomputed:,} attention calls recomputed outside the stash"
        rank = os.environ.get("RANK")
        why = f"; {self._unstashed}" if self._unstashed else ""
        traced = compiled.saved_calls() - self._run["compiled"]
        if traced:
            why += f"; torch.compile traced {traced} attention calls of stashed layers, whose graphs save them"
        return (f"attnstash{'' if rank is None else f' (rank {rank})'}: {len(self.layers or ())} layers stashed; "
                f"{counts}; peak {peak:,} bytes held{why}")

    def _why_unstashed(self, args, model):
        """Why the model of a reporting callback has no stash, from ATTNSTASH_LAYERS's count of
        the times checkpointing was turned on (None when no such count is known): warned at train
        begin, and in the summary."""
        autostash = self.autostash
        if autostash is None:
            return None
        setting = f"{autostash.LAYERS}={os.environ.get(autostash.LAYERS)}"
        field, enable = _checkpointing_names(args, model)
        if not autostash.enabled:
            return (f"{setting}, but checkpointing was never turned on for any model in this process, so "
                    f"nothing was stashed: the trainer trains {type(model).__name__} without activation checkpointing "
                    f"(TrainingArguments.{field}={getattr(args, field, None)}). The stash saves the recompute of "
                    f"checkpointed layers: turn checkpointing on ({field}=True, trl's --gradient_checkpointing, or "
                    f"{enable}), or unset {autostash.LAYERS}.")
        return (f"{setting}, but the trainer's model ({type(model).__name__}) has no stash: checkpointing was "
                f"turned on {autostash.enabled} time(s) in this process, each time for another model (the stash goes "
                "on the model whose checkpointing is turned on; Trainer(model_init=...) trains a model it builds "
                f"later), and not for this one (TrainingArguments.{field}={getattr(args, field, None)}).")

    # ---- the rest ------------------------------------------------------------------------------

    def figures(self):
        """{PREFIX + name: int} for FIGURES, the counters as increases since the previous call
        (or train begin); resets the stash's peak. on_log calls it at each training log."""
        stats = ops.stash_stats()
        last = self._last or {name: 0 for name in _COUNTERS}
        figures = {PREFIX + "bytes": stats["bytes"], PREFIX + "peak_bytes": stats["peak_bytes"]}
        if self._run is not None:
            self._run["peak_bytes"] = max(self._run["peak_bytes"], stats["peak_bytes"])
        for name in _COUNTERS:
            figures[PREFIX + name] = stats[name] - last[name]
        self._last = {name: stats[name] for name in _COUNTERS}
        ops.stash_reset_peak()
        return figures

    def uninstall(self):
        """Uninstall the stash this callback installed, if it still is (its budget ends with it).
        Returns whether there was one. on_train_end calls it; call it yourself after a train()
        that raised, to remove the stash at once. What the stash still holds for the model is
        released first: the last step of a train() that raised never backs up (and a layer that
        checkpoint_wrapper wraps would hold up the uninstall: uninstall_attention_stash)."""
        model = self._model() if self._model is not None else None
        self._model, self.layers = None, None
        if model is not None:
            if _installed_by.get(model) is self:
                del _installed_by[model]
            if install.layer_stash_stats(model):
                install.uninstall_attention_stash(model, release=True)
        return model is not None

    def _run_first(self):
        """Move this callback to the front of the trainer's callback list (see the class
        docstring, "Where they go"); whether it could. Called from on_train_begin, while the
        CallbackHandler iterates over that list: popping this callback from index i and
        inserting it at 0 leaves every later callback at its index, so the iteration goes on
        with the same next callback and no callback runs twice or is skipped."""
        try:
            from transformers.trainer_callback import CallbackHandler
        except ImportError:
            CallbackHandler = None
        frame = sys._getframe(1)
        try:
            for _ in range(_HANDLER_FRAMES):
                if frame is None or CallbackHandler is None:
                    break
                handler = frame.f_locals.get("self")
                if isinstance(handler, CallbackHandler) and isinstance(getattr(handler, "callbacks", None), list):
                    callbacks = handler.callbacks
                    index = next((i for i, cb in enumerate(callbacks) if cb is self), None)
                    if index is not None:
                        if index:
                            callbacks.insert(0, callbacks.pop(index))
                        return True
                frame = frame.f_back
        finally:
            del frame
        logger.warning("attnstash: AttentionStashCallback could not find the trainer's callback list to run first: "
                       "callbacks listed before it (reporting integrations among them) will not see the attnstash/ "
                       "figures in their on_log; state.log_history gets them.")
        return False

    @staticmethod
    def _check_checkpointing(args, model, layers):
        found = install.find_layers(model)
        wrapped = torch_adapter.wrapped_modules(model)  # (FSDP's activation checkpointing)

        def checkpointed(module):
            return getattr(module, "gradient_checkpointing", False) or id(module) in wrapped

        unchecked = [i for i in layers if not checkpointed(found[i].module)]
        if not unchecked:
            return
        if len(unchecked) == len(layers) and not any(checkpointed(f.module) for f in found):
            field, enable = _checkpointing_names(args, model)
            raise InstallError(
                "attnstash: AttentionStashCallback needs gradient checkpointing, and the trainer trains "
                f"{type(model).__name__} without it (TrainingArguments.{field}={getattr(args, field, None)}, and no "
                "layer of the model is checkpointed): the stash keeps attention outputs for the checkpoint's "
                f"recompute, so without one it could only cost memory. Set {field}=True in the TrainingArguments "
                f"(SFTConfig's default), reentrant or not ({field}_kwargs={{'use_reentrant': False}}), or call "
                f"{enable} before training; or remove the callback.")
        raise InstallError(
            f"attnstash: AttentionStashCallback: layers {unchecked} of {type(model).__name__} would be stashed but "
            "are not checkpointed (gradient checkpointing of every n-th layer?): a stashed layer must be "
            "checkpointed. Checkpoint every layer, or pass a num_layers that covers only checkpointed layers.")


def _checkpointing_names(args, model):
    """(the TrainingArguments field that turns checkpointing on, the model's call that does) as
    the installed transformers names them: activation_checkpointing from 5.23, before it
    gradient_checkpointing."""
    new = hasattr(args, "activation_checkpointing")
    return (("activation_checkpointing" if new else "gradient_checkpointing"),
            ("model.activation_checkpointing_enable()" if hasattr(model, "activation_checkpointing_enable")
             else "model.gradient_checkpointing_enable()"))
