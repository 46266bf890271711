"""`<job.dump_folder>/run_info.json`: the facts of a run that its config does not hold.

    write_run_info(dump_folder, world_size=8)   # rank 0, at start
    read_run_info(dump_folder)                  # {"world_size": 8}, or None

config.toml cannot tell the world size (`data_parallel_shard_degree = -1` fills whatever world
the run was launched into); `torchmoe report` needs it to show the mesh and the planner's
per-rank memory of the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchmoe.config.files.file_writes import write_file
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.text import utf8_text
from torchmoe.config.numbers import MAX_RANKS

__all__ = ["RUN_INFO_FILE", "read_run_info", "write_run_info"]

RUN_INFO_FILE = "run_info.json"


def write_run_info(dump_folder: Path, *, world_size: int) -> Path:
    """Write `run_info.json` (a resumed run rewrites it: a restart may change the world size)."""
    path = dump_folder / RUN_INFO_FILE
    write_file(path, json.dumps({"world_size": world_size}) + "\n")
    return path


def read_run_info(dump_folder: Path) -> dict[str, Any] | None:
    """The facts written by `write_run_info`; None without the file (a run from before it, or
    a dry run's folder).

    Raises:
        OSError: the file is there but cannot be read (a folder, no permission).
        ValueError: it is not what `write_run_info` writes (one line: not UTF-8, not JSON, not an
            object, or no world_size from 1 to MAX_RANKS), e.g. edited or cut short.
    """
    try:
        data = (dump_folder / RUN_INFO_FILE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        info = json_loads(utf8_text(data, nul=False))
    except json.JSONDecodeError as err:
        raise ValueError(f"is not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    size = info.get("world_size") if isinstance(info, dict) else None
    if type(size) is not int or not 1 <= size <= MAX_RANKS:  # type: bool is an int
        raise ValueError(f"holds {json.dumps(info)[:80]}, not an object with a world_size from 1 to {MAX_RANKS}")
    return info
