"""The word that unsets an optional key from the command line, and which keys take it.

    --model.flavor none          # the job file's flavor dropped: a Hugging Face folder decides the model
    --training.global_batch_size none   # -1, as if the job file left it out

A TOML file unsets a key by leaving it out, or a path by ``""``; a flag cannot leave out what the
job file sets, and ``""`` from a flag is what an unset shell variable gives (refused for a path:
`config.files.paths.nonempty_path`). `loader.load_job_config` gives the key its unset value and counts
it as not set (`set_keys`, the checks of `dependent_keys`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torchmoe.config.job_config import JobConfig

__all__ = ["UNSET_WORD", "is_optional", "optional_keys"]

UNSET_WORD = "none"
"""A flag value that unsets an optional key (`optional_keys`), as if the job file and the flags
left it out: ``--model.hf_assets_path none`` is a TOML's ``hf_assets_path = ""``, ``--model.flavor
none`` lets a Hugging Face folder decide the model whatever flavor the job file names. A key whose
own values include the word (``activation_checkpoint.mode``) is no optional key: there it is the value."""

# Unset, a Hugging Face folder decides these (and without one their defaults apply).
_FOLDER_DECIDES = ("model.name", "model.flavor")


@functools.cache
def _optional_keys() -> dict[str, Any]:
    defaults = JobConfig()
    keys = {f"{section.name}.{f.name}": getattr(getattr(defaults, section.name), f.name)
            for section in dataclasses.fields(JobConfig) for f in dataclasses.fields(getattr(defaults, section.name))}
    return {k: v for k, v in keys.items() if (not isinstance(v, bool) and v in ("", -1, [])) or k in _FOLDER_DECIDES}


def is_optional(key: str) -> bool:
    """Whether a flag may unset ``section.key`` with `UNSET_WORD`."""
    return key in _optional_keys()


def optional_keys() -> dict[str, Any]:
    """The keys a flag may unset with `UNSET_WORD` -> the value they then take: those whose default
    means "not set" (``""``, ``-1``, an empty list: the default, or what another key says, is
    used), and model.name and model.flavor (a Hugging Face folder then decides the model)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in _optional_keys().items()}
