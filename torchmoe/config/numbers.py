"""Numbers a user types (command-line flags, the launcher's variables): whole or finite, in range.

    gpus = parse_int("--gpus", "512", low=1, high=MAX_RANKS, fix="pass e.g. --gpus 512")
    top_p = parse_number("--top-p", "0.9", low=0.0, high=1.0, above_low=True, fix="pass e.g. 0.9")

Python parses more than a setting can hold: `int` takes any number of digits up to its limit
(4,300; beyond it a `ValueError` traceback), and `float` takes "nan", "inf" and "1e400" (inf). A
value here is plain digits (or a float literal) within a range the message states, else one
`ConfigError` naming the flag, what it must be and the fix; a value too long to show whole is
shown cut, with its length.
"""

from __future__ import annotations

import math
import re

from torchmoe.config.errors import ConfigError

__all__ = ["INT64_MAX", "INT64_MIN", "MAX_RANKS", "parse_int", "parse_number", "shown_text"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""What an integer setting may hold: counts, steps and seeds end up in tensors and C++."""
MAX_RANKS = 2**20
"""The most ranks (GPUs) a job, a plan or a dry run may count: ten times the largest clusters
built, and far inside the 32-bit ranks of c10d. A planner asked for 10^20 searched for ever."""

_INT = re.compile(r"[+-]?[0-9]+")
_SHOWN = 40  # characters of a typed value shown whole


def shown_text(text: str) -> str:
    """`text` as a message shows it: whole, or its start and its length when it is long."""
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN // 2]}... ({len(text):,} characters)"


def parse_int(key: str, text: str, *, low: int, high: int, fix: str) -> int:
    """`text` (the value of `key`) as an integer from `low` to `high`.

    Raises:
        ConfigError: it is not decimal digits (a sign allowed), or lies outside the range.
    """
    if not _INT.fullmatch(text):
        raise ConfigError(key, shown_text(text), "expected an integer", fix)
    # Compared by length first: int() of thousands of digits is Python's digit-limit ValueError.
    digits = text.lstrip("+-").lstrip("0")
    longest = max(len(str(abs(low))), len(str(abs(high))))
    value = int(text) if len(digits) <= longest else None
    if value is None or not low <= value <= high:
        raise ConfigError(key, shown_text(text), f"must be an integer from {low} to {high}", fix)
    return value


def parse_number(key: str, text: str, *, low: float, high: float, fix: str, above_low: bool = False) -> float:
    """`text` (the value of `key`) as a finite number from `low` (excluded with `above_low`) to
    `high`.

    Raises:
        ConfigError: it is not a number, is NaN or infinite (or overflows to inf: 1e400), or
            lies outside the range.
    """
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(key, shown_text(text), "expected a number", fix) from None
    if not math.isfinite(value):
        raise ConfigError(key, shown_text(text), "must be a finite number", fix)
    if not (low < value if above_low else low <= value) or value > high:
        interval = f"{'(' if above_low else '['}{low:g}, {high:g}]"
        raise ConfigError(key, shown_text(text), f"must lie in {interval}", fix)
    return value
