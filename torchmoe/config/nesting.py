"""JSON and TOML parsed without a `RecursionError`: nesting too deep is malformed input.

    value = json_loads(text)   # json.JSONDecodeError for text nested too deeply, as for any damage
    table = toml_loads(text)   # tomllib.TOMLDecodeError likewise

Python's parsers recurse once per level of ``[`` or ``{``: a file of 100,000 brackets (crafted,
or a generator's bug) ends in a `RecursionError`, which every reader would report as a bug with
a traceback. Here it is the parser's own error for malformed input, which each reader already
turns into its message naming the file.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["json_loads", "toml_loads"]

_TOO_DEEP = "nested too deeply (more levels of [ or { than the parser can follow)"


def json_loads(text: str | bytes) -> Any:
    """`json.loads(text)`.

    Raises:
        json.JSONDecodeError: `text` is not JSON, or is nested too deeply.
    """
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError(_TOO_DEEP, doc, _deep_start(doc)) from None


def toml_loads(text: str) -> dict[str, Any]:
    """`tomllib.loads(text)`.

    Raises:
        tomllib.TOMLDecodeError: `text` is not TOML, or is nested too deeply.
    """
    try:
        return tomllib.loads(text)
    except RecursionError:
        line = text.count("\n", 0, _deep_start(text)) + 1
        raise tomllib.TOMLDecodeError(f"{_TOO_DEEP} (at line {line})") from None


def _deep_start(text: str) -> int:
    """Where the deep nesting starts, for the message: the first run of 64 opening brackets of
    one kind (a guess: else 0)."""
    found = [at for at in (text.find("[" * 64), text.find("{" * 64)) if at >= 0]
    return min(found, default=0)
