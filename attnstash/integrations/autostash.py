"""The stash from the environment, with no code to write:

    ATTNSTASH_LAYERS=all           every attention layer ("all"), or a number: the last N
    ATTNSTASH_MAX_BYTES=8GiB       the budget (what attnstash.parse_bytes reads), optional
    ATTNSTASH_OFFLOAD=1            attnstash's own offload of what it keeps (install_attention_stash's
                                   offload=True), optional: 1 or 0

In every Python process started with ATTNSTASH_LAYERS set, the stash is installed on each model
at the moment its checkpointing is enabled: transformers' gradient_checkpointing_enable (and
activation_checkpointing_enable), diffusers' enable_gradient_checkpointing, and torch's
apply_activation_checkpointing (which accelerate's FSDP activation checkpointing calls); after
PEFT wrapping where that comes first, under either checkpointing mode. Every transformers.Trainer
(TRL's trainers included) reports the attnstash/* figures in its logs, as AttentionStashCallback
does, and prints a one-line summary when training ends. Child processes (accelerate launch,
torchrun, the DeepSpeed launcher) inherit the variables.

How: attnstash-autostash.pth, which pip installs next to the package (as coverage.py's
COVERAGE_PROCESS_START works), runs one line at every interpreter start-up: nothing unless
ATTNSTASH_LAYERS is set; then this file, loaded on its own (not the attnstash package: no torch
is imported at start-up), reads the variables (a bad value ends the process at once, saying
what it accepts) and adds an import hook that patches those entry points when their libraries
are imported. Unset the variable to turn it off (or remove the .pth file).
"""
import importlib.abc
import importlib.util
import os
import sys

LAYERS, MAX_BYTES, OFFLOAD = "ATTNSTASH_LAYERS", "ATTNSTASH_MAX_BYTES", "ATTNSTASH_OFFLOAD"
enabled = 0  # how often checkpointing was turned on for a model in this process (install() ran)


def settings(environ=os.environ):
    """(num_layers or None for all, max_bytes or None, offload) from the environment; ValueError
    naming the variable, its value and what it accepts."""
    layers = environ.get(LAYERS, "").strip()
    if layers.lower() == "all":
        num_layers = None
    elif layers.isdigit() and int(layers) >= 1:
        num_layers = int(layers)
    else:
        raise ValueError(f"attnstash: {LAYERS}={environ.get(LAYERS)!r} is not a number of layers: use \"all\" (every "
                         "attention layer) or a positive int (the last N attention layers); unset it to turn the "
                         "stash off.")
    max_bytes = environ.get(MAX_BYTES)
    if max_bytes is not None:
        try:
            _budget().parse_bytes(max_bytes)
        except ValueError as e:
            raise ValueError(f"attnstash: {MAX_BYTES}={max_bytes!r}: {str(e).removeprefix('attnstash: ')} Unset it "
                             "for no budget.") from None
    offload = environ.get(OFFLOAD, "0").strip()
    if offload not in ("0", "1"):
        raise ValueError(f"attnstash: {OFFLOAD}={environ.get(OFFLOAD)!r}: use 1 (move what the stash keeps to host "
                         "memory until its recompute) or 0 (keep it on the device); unset means 0.")
    return num_layers, max_bytes, offload == "1"


def _budget():
    """attnstash/budget.py, whose parse_bytes is pure Python: loaded on its own at start-up, as this
    file is, so that no torch is imported then."""
    if "attnstash.budget" in sys.modules:
        return sys.modules["attnstash.budget"]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "budget.py")
    spec = importlib.util.spec_from_file_location("_attnstash_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install(model):
    """The stash on `model` (once: a model whose layers have it already is left alone), as the
    environment asks; a model it cannot serve fails as install_attention_stash does."""
    global enabled
    enabled += 1
    import attnstash
    num_layers, max_bytes, offload = settings()
    if attnstash.layer_stash_stats(model):
        return
    try:
        attnstash.install_attention_stash(model, num_layers, max_bytes=max_bytes, offload=offload)
    except attnstash.InstallError as e:
        raise attnstash.InstallError(f"attnstash ({LAYERS}={os.environ.get(LAYERS)}): "
                                     f"{str(e).removeprefix('attnstash: ')}") from e


def _after(owner, name, then):
    """owner.name, wrapped to call then(args, kwargs) with its arguments after it."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_attnstash_after", False):
        return

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        then(args, kwargs)
        return out

    wrapper._attnstash_after = True
    wrapper.__wrapped__ = original
    wrapper.__name__, wrapper.__doc__ = original.__name__, original.__doc__
    setattr(owner, name, wrapper)


def _install_on_self(args, kwargs):
    install(args[0] if args else kwargs["model"])


def _install_if_enabled(args, kwargs):  # _set_gradient_checkpointing(self, enable=True, ...)
    if (args[1] if len(args) > 1 else kwargs.get("enable", True)):
        install(args[0])


def _transformers(module):
    # Every way transformers, TRL, axolotl and LLaMA-Factory enable checkpointing ends in
    # _set_gradient_checkpointing (every release of transformers_adapter.SUPPORTED); the public
    # names too, should a release rename it.
    _after(module.PreTrainedModel, "_set_gradient_checkpointing", _install_if_enabled)
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        _after(module.PreTrainedModel, name, _install_on_self)


def _trainer(module):
    def add_reporting(args, kwargs):
        from attnstash.integrations.trainer import AttentionStashCallback
        trainer = args[0]
        if not any(isinstance(cb, AttentionStashCallback) for cb in trainer.callback_handler.callbacks):
            callback = AttentionStashCallback(install=False)
            callback.autostash = sys.modules[__name__]  # what it tells when the trainer's model has no stash
            trainer.add_callback(callback)
    _after(module.Trainer, "__init__", add_reporting)


def _diffusers(module):
    _after(module.ModelMixin, "enable_gradient_checkpointing", _install_on_self)


def _checkpoint_wrapper(module):
    _after(module, "apply_activation_checkpointing", _install_on_self)


HOOKS = {"transformers.modeling_utils": _transformers, "transformers.trainer": _trainer,
         "diffusers.models.modeling_utils": _diffusers,
         "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": _checkpoint_wrapper}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of HOOKS, it lets the other finders find it and runs
    the module's patch once the module has run."""

    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            HOOKS[name](module)

        spec.loader.exec_module = exec_module
        return spec


def activate():
    """What attnstash-autostash.pth calls when ATTNSTASH_LAYERS is set."""
    try:
        settings()
    except ValueError as e:
        print(e, file=sys.stderr, flush=True)
        os._exit(2)  # at start-up, before anything ran: nothing to clean up
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name, patch in HOOKS.items():
        if name in sys.modules:
            patch(sys.modules[name])
