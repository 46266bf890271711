"""The data pipeline's errors: a data or tokenizer setting that cannot work, and the end of a corpus."""

from __future__ import annotations

from torchmoe.config.errors import ConfigError

__all__ = ["CorpusEnd", "DataConfigError"]


class DataConfigError(ConfigError, ValueError):
    """A data or tokenizer setting that cannot work: missing files, fields or packages.

    The CLI reports it like any `ConfigError` (one message, exit status 2); it is also a
    `ValueError` for code that uses the data pipeline as a library.
    """


class CorpusEnd(Exception):
    """A stream built with ``repeat=False`` reached the end of its corpus (validation's one pass)."""
