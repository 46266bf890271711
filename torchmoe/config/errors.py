"""`ConfigError`: the one exception type for a user's configuration mistake.

The CLI turns it into a single message on stderr and exit status 2 (DESIGN §3); anything else
escaping `torchmoe train` is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Control characters, and those that print as nothing (zero-width, direction marks, a BOM).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")
_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def show_value(value: Any) -> str:
    """Render a config value the way it would be written in TOML (`true`, `"abc"`, `[..]`, `{..}`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        # Control and invisible characters as TOML writes them: a NUL, a zero-width space or an
        # escape sequence shown raw would be invisible, or act on the terminal.
        return '"' + _CONTROL.sub(lambda m: _ESCAPES.get(m[0], f"\\u{ord(m[0]):04X}"), escaped) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {show_value(v)}" for k, v in value.items()) + "}"
    return str(value)


class ConfigError(Exception):
    """A user error in the job configuration.

    Args:
        key: what is wrong, as the user spells it: ``section.key``, a flag such as ``--config``,
            or a section name.
        value: the offending value (rendered TOML-style in the message).
        problem: what is wrong with it, e.g. the arithmetic that does not add up.
        fix: what to do about it.
    """

    def __init__(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key} = {show_value(value)}: {problem}\n  fix: {fix}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its four parts, not from the message (Exception's default): an error one
        # rank found crosses a `broadcast_object_list` to the others, which raise it too.
        return type(self), (self.key, self.value, self.problem, self.fix)
