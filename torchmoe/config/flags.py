"""A command's own flags, taken out of argv before the job file's `--section.key` overrides.

    found, rest = split_flags(argv, {"--prompt": str, "--seed": Integer(0, 2**64 - 1, "0")})

`--flag VALUE` and `--flag=VALUE` both work; a flag given twice keeps the last, as overrides do.
A number flag states its range (`Integer`, `Number`: `config.numbers`). A value that is missing,
not of the flag's kind or out of its range is a `ConfigError` naming the flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchmoe.config.errors import ConfigError
from torchmoe.config.numbers import parse_int, parse_number

__all__ = ["Integer", "Number", "split_flags"]


@dataclass(frozen=True)
class Integer:
    """An integer flag from `low` to `high`; `example`: a value the fix suggests (`fix`: another fix)."""

    low: int
    high: int
    example: str
    fix: str = ""


@dataclass(frozen=True)
class Number:
    """A finite number flag from `low` (excluded with `above_low`) to `high`."""

    low: float
    high: float
    example: str
    above_low: bool = False
    fix: str = ""


def split_flags(argv: Sequence[str], flags: dict[str, type[str] | Integer | Number]) -> tuple[dict[str, object],
                                                                                               list[str]]:
    """({flag: value} of the `flags` present, parsed by their kind; the other tokens, in order).

    Args:
        flags: each own flag (``--name``) and its kind: `str`, an `Integer` or a `Number` range.

    Raises:
        ConfigError: a flag without a value, or with one its kind does not parse or its range
            does not hold.
    """
    found: dict[str, object] = {}
    rest: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        flag, eq, value = token.partition("=")
        if flag not in flags:
            rest.append(token)
            continue
        kind = flags[flag]
        if not eq:
            value = next(tokens, None)  # type: ignore[assignment]
            # A flag followed by another flag lost its value (except a negative number).
            if value is None or (value.startswith("--") and kind is str):
                raise ConfigError(flag, "(no value)", "needs a value", f"pass {flag} VALUE")
        fix = (kind.fix or f"pass e.g. {flag} {kind.example}") if isinstance(kind, (Integer, Number)) else ""
        if isinstance(kind, Integer):
            found[flag] = parse_int(flag, value, low=kind.low, high=kind.high, fix=fix)
        elif isinstance(kind, Number):
            found[flag] = parse_number(flag, value, low=kind.low, high=kind.high, above_low=kind.above_low, fix=fix)
        else:
            found[flag] = value
    return found, rest
