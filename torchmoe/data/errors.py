"""The data pipeline's errors: a data or tokenizer setting that cannot work, and the end of a corpus;
how a value read from a JSON file is shown in one."""

from __future__ import annotations

import json
from typing import Any

from torchmoe.config.errors import ConfigError

__all__ = ["CorpusEnd", "DataConfigError", "shown_json"]


class DataConfigError(ConfigError, ValueError):
    """A data or tokenizer setting that cannot work: missing files, fields or packages.

    The CLI reports it like any `ConfigError` (one message, exit status 2); it is also a
    `ValueError` for code that uses the data pipeline as a library.
    """


class CorpusEnd(Exception):
    """A stream built with ``repeat=False`` reached the end of its corpus (validation's one pass)."""


_JSON_KINDS = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (dict, "an object"),
               ((list, tuple), "an array"))


def shown_json(value: Any, width: int = 60) -> str:
    """A value read from JSON, in a message: as JSON (its first `width` characters), and its JSON
    kind: ``5 (a number)``, ``{"a": 1} (an object)``."""
    text = json.dumps(value, default=str)
    kind = next((name for types, name in _JSON_KINDS if isinstance(value, types)), "null" if value is None else
                f"a {type(value).__name__}")
    return f"{text[:width]}{'...' if len(text) > width else ''} ({kind})"
