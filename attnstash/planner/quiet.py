"""Other libraries' warnings, log lines and progress bars, silenced while the planner builds (and
runs) a model it made from a config, and for the whole of `python -m attnstash.planner`, so that
what is printed is the plan alone; every setting is as it was afterwards.

Silenced: Python warnings (warnings.catch_warnings restores the caller's filters), the loggers of
transformers and diffusers (their verbosity and progress bars), and, for the command, every
logger (logging.disable). transformers' `logger.warning_once` / `info_once` remember what they
have said; inside they say nothing and remember nothing, so that a message the planner's model
provoked is still said once when the caller's own code provokes it.
"""
import contextlib
import logging
import sys
import warnings

LIBRARIES = ("transformers", "diffusers")  # their loggers and progress bars, where they are imported
_ONCE = ("warning_once", "info_once")      # what transformers adds to logging.Logger


@contextlib.contextmanager
def others_silenced(every_logger=False):
    """Other libraries' warnings and log lines silenced inside (errors still logged), and their
    progress bars off. every_logger: every logger of every library, below ERROR (the command).
    The libraries whose loggers are set are those imported on entering: import first."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        for name in LIBRARIES:
            library_logging = sys.modules.get(f"{name}.utils.logging")
            if library_logging is not None:
                stack.enter_context(_library_silenced(name, library_logging))
        stack.enter_context(_once_unspent())
        if every_logger:
            stack.enter_context(_every_logger_silenced())
        yield


@contextlib.contextmanager
def _library_silenced(name, library_logging):
    """The library's root logger at ERROR and its progress bars off, then as they were (the
    logger's own level, NOTSET included, and the flag its tqdm wrapper reads: the libraries'
    disable_/enable_progress_bar would also switch huggingface_hub's bars, which the caller set
    apart)."""
    logger = logging.getLogger(name)
    level = logger.level
    bars = getattr(library_logging, "_tqdm_active", None)  # both libraries' tqdm wrappers read this flag
    try:
        logger.setLevel(max(logging.ERROR, logger.getEffectiveLevel()))
        if bars is not None:
            library_logging._tqdm_active = False
        yield
    finally:
        logger.setLevel(level)
        if bars is not None:
            library_logging._tqdm_active = bars


def _say_nothing(self, *args, **kwargs):
    return None


@contextlib.contextmanager
def _once_unspent():
    saved = {name: vars(logging.Logger)[name] for name in _ONCE if name in vars(logging.Logger)}
    try:
        for name in saved:
            setattr(logging.Logger, name, _say_nothing)
        yield
    finally:
        for name, method in saved.items():
            setattr(logging.Logger, name, method)


@contextlib.contextmanager
def _every_logger_silenced():
    before = logging.root.manager.disable
    try:
        logging.disable(max(before, logging.WARNING))
        yield
    finally:
        logging.disable(before)
