"""The stash's budget from Python: byte counts as users write them, and which install's
budget is in force. What the budget does is stated once, in csrc/stash_registry.h (Budget).

    attnstash.stash_set_max_bytes("8GiB")    the process-wide budget, until changed
    install_attention_stash(model, max_bytes=...)   a budget for as long as that install lasts
"""
import re
import threading
from fractions import Fraction
from typing import Optional, Union

try:
    from .errors import ArgumentError
except ImportError:  # loaded on its own, at start-up (integrations/autostash.py)
    ArgumentError = ValueError

MAX_BYTES = 2**63 - 1
"""The largest budget the registry takes (an int64 count of bytes)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = ('an int from 0 to 2**63 - 1, or a string such as "8GiB", "512MB", "1.5GB" or "1024" '
             '(units B, KB, MB, GB, TB = powers of 10; KiB, MiB, GiB, TiB = powers of 2; a fraction of a byte '
             'is dropped)')


def parse_bytes(value: Union[int, str, None]) -> Optional[int]:
    """A byte count from an int or a string such as "8GiB", "512MB", "1.5 GB" or "1024"
    (MB/GB are powers of 10, MiB/GiB of 2, as other tools count them), computed exactly
    ("2.01MB" is 2,010,000); None stays None. Raises ArgumentError (a ValueError) for anything
    else: negative numbers, bools, other units, and counts above MAX_BYTES."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ArgumentError(f"attnstash: a byte count must be {_ACCEPTED}; got the bool {value!r}.")
    if isinstance(value, str):
        found = _SIZE.match(value)
        unit = found.group(2).lower() if found else None
        if not found or unit not in _UNITS:
            raise ArgumentError(f"attnstash: cannot read {value!r} as a byte count: use {_ACCEPTED}.")
        count = int(Fraction(found.group(1)) * _UNITS[unit])  # exact: "2.01MB" is 2,010,000
    else:
        try:
            count = int(value.__index__())
        except (AttributeError, TypeError):
            raise ArgumentError(f"attnstash: a byte count must be {_ACCEPTED}; got {type(value).__name__} "
                                f"{value!r}.") from None
    if not 0 <= count <= MAX_BYTES:
        raise ArgumentError(f"attnstash: a byte count must be {_ACCEPTED}; got {value!r}"
                            + (f" = {count:,} bytes." if isinstance(value, str) and count <= MAX_BYTES else "."))
    return count


def stash_set_max_bytes(max_bytes: Union[int, str, None]) -> None:
    """Set the process-wide budget (None: no budget; 0: every keep declined), what
    parse_bytes accepts. What it does: csrc/stash_registry.h, Budget. It stays when installs
    that set a budget of their own end (install_attention_stash(max_bytes=...))."""
    count = parse_bytes(max_bytes)
    with _lock:
        _installs.clear()  # the installs alive now no longer give back what they replaced
        _set(count)


def stash_max_bytes() -> Optional[int]:
    """The budget in force, in bytes, or None if there is none."""
    from . import ops
    value = ops.stash_stats()["max_bytes"]
    return None if value < 0 else value


def _set(count):
    from . import ops
    ops.set_max_bytes(-1 if count is None else count)


# ---- budgets of installs ------------------------------------------------------------------
# An install with max_bytes sets the budget for as long as it lasts, and its end gives back the
# budget that was in force before it. Installs that overlap nest: the latest one's budget is
# in force; an install that ends while a later one lasts hands what it replaced to that one,
# so that the last of them to end restores the budget from before the first. A budget set with
# stash_set_max_bytes meanwhile stays.

_lock = threading.Lock()
_installs = []  # [[token, the budget in force before this install]], oldest first


def push(token, max_bytes: Optional[int]) -> None:
    """Install `token` sets the budget `max_bytes` (already parsed) for as long as it lasts."""
    with _lock:
        _installs.append([token, stash_max_bytes()])
        _set(max_bytes)


def pop(token) -> None:
    """Install `token` ended: give back what it replaced (nothing if it set no budget)."""
    with _lock:
        for i, (mine, before) in enumerate(_installs):
            if mine is token:
                del _installs[i]
                if i < len(_installs):
                    _installs[i][1] = before  # a later install lasts: it gives `before` back
                else:
                    _set(before)
                return
