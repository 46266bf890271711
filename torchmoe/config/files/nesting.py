"""JSON and TOML parsed into what a reader can use: too deep, too long or non-finite is malformed.

    value = json_loads(text)   # json.JSONDecodeError for text nested too deeply, as for any damage
    table = toml_loads(text)   # tomllib.TOMLDecodeError likewise

Python's parsers recurse once per level of ``[`` or ``{``: a file of 100,000 brackets (crafted,
or a generator's bug) ends in a `RecursionError`, which every reader would report as a bug with
a traceback. An integer of more than 4,300 digits ends in Python's digit-limit `ValueError`
(``Exceeds the limit (4300 digits) for integer string conversion``) likewise. And Python's JSON
parser accepts what JSON has no place for: ``NaN``, ``Infinity`` and a number beyond a float's
range (``1e400``, read as inf), which no writer of a file torchmoe reads puts there. Here each
is the parser's own error for malformed input, which every reader already turns into its one
message naming the file. (TOML has ``inf`` and ``nan`` of its own: each setting's check refuses
them where it needs a finite number.)
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["json_loads", "toml_loads"]

_TOO_DEEP = "nested too deeply (more levels of [ or { than the parser can follow)"
_TOO_LONG = f"a number of more than {sys.get_int_max_str_digits():,} digits, which no setting holds"
_MAX_BITS = int(sys.get_int_max_str_digits() * math.log2(10))  # the largest int str() shows
_DIGITS = re.compile(r"[0-9a-fA-F_]{%d,}" % (sys.get_int_max_str_digits() + 1))


class _NotFinite(ValueError):
    """A JSON number that is no finite float: `literal` as the file spells it."""

    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400: beyond a float's range
        raise _NotFinite(literal)
    return value


def _no_constant(literal: str) -> float:
    raise _NotFinite(literal)  # NaN, Infinity, -Infinity: Python's extension of JSON


def json_loads(text: str | bytes, *, finite: bool = True) -> Any:
    """`json.loads(text)`, whose numbers are of at most Python's digit limit, and finite unless
    `finite` is False (for a reader that checks every number it uses by name, as
    `models.hf_config_spec` does config.json's, which transformers writes with Python's json:
    NaN and Infinity included).

    Raises:
        json.JSONDecodeError: `text` is not JSON, is nested too deeply, or holds a number longer
            than the digit limit, or (`finite`) NaN, infinite or beyond a float's range.
    """
    hooks = {"parse_float": _finite, "parse_constant": _no_constant} if finite else {}
    try:
        return json.loads(text, **hooks)
    except (RecursionError, ValueError) as err:
        if isinstance(err, json.JSONDecodeError):
            raise
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        if isinstance(err, RecursionError):
            raise json.JSONDecodeError(_TOO_DEEP, doc, _deep_start(doc)) from None
        if isinstance(err, _NotFinite):
            raise json.JSONDecodeError(f"{err.literal[:24]} is no finite number (JSON numbers are finite, and "
                                       "within a float's range)", doc, max(doc.find(err.literal), 0)) from None
        raise json.JSONDecodeError(_TOO_LONG, doc, _long_start(doc)) from None


def toml_loads(text: str) -> dict[str, Any]:
    """`tomllib.loads(text)`, whose integers are of at most Python's digit limit.

    Raises:
        tomllib.TOMLDecodeError: `text` is not TOML, is nested too deeply, or holds an integer
            longer than the digit limit.
    """
    try:
        table = tomllib.loads(text)
    except RecursionError:
        line = text.count("\n", 0, _deep_start(text)) + 1
        raise tomllib.TOMLDecodeError(f"{_TOO_DEEP} (at line {line})") from None
    except ValueError as err:
        if isinstance(err, tomllib.TOMLDecodeError):
            raise
        line = text.count("\n", 0, _long_start(text)) + 1
        raise tomllib.TOMLDecodeError(f"{_TOO_LONG} (at line {line})") from None
    # A hexadecimal, octal or binary integer parses at any length, but no message could show it.
    if any(type(v) is int and v.bit_length() > _MAX_BITS for v in _values(table)):
        line = text.count("\n", 0, _long_start(text)) + 1
        raise tomllib.TOMLDecodeError(f"{_TOO_LONG} (at line {line})")
    return table


def _values(table: dict[str, Any]) -> Iterator[Any]:
    """Every value in `table`, tables and arrays opened (iteratively: as deep as the parser went)."""
    stack: list[Any] = [table]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        else:
            yield value


def _long_start(text: str) -> int:
    """Where the first run of digits longer than the digit limit starts (else 0)."""
    found = _DIGITS.search(text)
    return found.start() if found else 0


def _deep_start(text: str) -> int:
    """Where the deep nesting starts, for the message: the first run of 64 opening brackets of
    one kind (a guess: else 0)."""
    found = [at for at in (text.find("[" * 64), text.find("{" * 64)) if at >= 0]
    return min(found, default=0)
