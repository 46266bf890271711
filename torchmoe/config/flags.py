"""A command's own flags, taken out of argv before the job file's `--section.key` overrides.

    found, rest = split_flags(argv, {"--prompt": str, "--seed": int})

`--flag VALUE` and `--flag=VALUE` both work; a flag given twice keeps the last, as overrides do.
A value that is missing or not of the flag's type is a `ConfigError` naming the flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torchmoe.config.errors import ConfigError

__all__ = ["split_flags"]

_KINDS = {int: "an integer", float: "a number", str: "a value"}


def split_flags(argv: Sequence[str], flags: dict[str, Callable[[str], object]]) -> tuple[dict[str, object], list[str]]:
    """({flag: value} of the `flags` present, parsed with their type; the other tokens, in order).

    Args:
        flags: each own flag (``--name``) and its type (`int`, `float` or `str`).

    Raises:
        ConfigError: a flag without a value, or with one its type does not parse.
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
        try:
            found[flag] = kind(value)
        except ValueError:
            raise ConfigError(flag, value, f"expected {_KINDS.get(kind, 'a value')}",
                              f"pass {flag} with {_KINDS.get(kind, 'a value')}") from None
    return found, rest
