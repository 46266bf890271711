"""The numbers a launcher sets in the environment (torchrun, srun, a shell), read once and checked.

    world = launch_int("WORLD_SIZE", 1)        # ConfigError naming it unless a whole number from 1 to MAX_RANKS
    local_rank = launch_int("LOCAL_RANK", 0)   # >= 0

A variable exported by hand (``WORLD_SIZE=abc``, ``LOCAL_RANK=-1``) is the user's to fix: one
message naming it, its value and what it must be, exit 2, instead of a `ValueError` traceback
from wherever it is first read.
"""

from __future__ import annotations

import json
import os
import time

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.numbers import MAX_RANKS, parse_int, shown_text

__all__ = ["launch_int", "tell_launcher"]

# Each variable's least value, and what it counts.
_VARIABLES = {
    "WORLD_SIZE": (1, "the number of ranks"),
    "LOCAL_WORLD_SIZE": (1, "the number of ranks on this node"),
    "RANK": (0, "this process's rank, from 0"),
    "LOCAL_RANK": (0, "this process's rank on its node, from 0"),
}


def launch_int(name: str, default: int) -> int:
    """The launcher's variable `name` (one of WORLD_SIZE, LOCAL_WORLD_SIZE, RANK, LOCAL_RANK) as
    an int; `default` when it is unset.

    Raises:
        ConfigError: it is set to anything but a whole number of at least its least value.
    """
    text = os.environ.get(name)
    if text is None:
        return default
    least, what = _VARIABLES[name]
    most = MAX_RANKS - (least == 0)  # a count of ranks, or a rank below it
    try:
        return parse_int(name, text, low=least, high=most, fix="")
    except ConfigError:
        raise ConfigError(name, shown_text(text), f"is not a whole number from {least} to {most} ({what}, set by "
                          f"the launcher)", f"unset {name} to run in one process, or launch with torchrun, which "
                          "sets it") from None


def tell_launcher(text: str) -> None:
    """Under torchrun, leave `text` (why this process exits: the message it printed, or would
    print were it the rank that reports) in its error file, ``TORCHELASTIC_ERROR_FILE``. torchrun's
    failure summary prints each failed rank's file and ends with the first one to fail, under
    "Root Cause": without it the summary says only "exitcode: 2", the message buried 40 lines up
    among every rank's output. Written in torch's own `ErrorHandler` format (torch 2.13's
    `ProcessFailure` reads it and prints ``extraInfo.py_callstack``, which here is the message,
    not a traceback); a later write replaces it. Outside torchrun, and where the file cannot be
    written (the message was printed anyway), nothing happens."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": text, "timestamp": str(int(time.time()))}
    try:
        write_file(path, json.dumps({"message": {"message": text, "extraInfo": extra}}))
    except OSError:
        pass
