"""Reading metrics.jsonl (the format: `metrics.py`): its records in file order, the lines that
are not records (torn by a kill, or edited) said by every reader, and whether a run may continue
a dump folder's history (`check_history`).

    records, skipped = read_record_lines(Path(dump_folder) / METRICS_FILE)
    if skipped:
        print(not_records(path, skipped))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import free_folder_name
from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_file import differing_keys, load_toml_config

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line as its record; None for a line that is not one (torn by a kill)."""
    try:
        record = json_loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_record_lines(path: Path) -> tuple[list[tuple[int, str, dict[str, Any]]], list[int]]:
    """Each record of the metrics.jsonl at `path` as (line number, line, record), in file order,
    and the numbers of the lines that are not records (torn by a kill, or edited); neither when
    the file does not exist. Every reader says what it skipped (`not_records`)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], []
    records, skipped = [], []
    for number, line in enumerate(lines, start=1):
        record = parse_record(line)
        if record is None:
            skipped.append(number)
        else:
            records.append((number, line, record))
    return records, skipped


def not_records(path: Path, skipped: list[int]) -> str:
    """"PATH: N lines are not records (lines a, b, ...)": the lines a reader of `path` skipped."""
    shown = ", ".join(map(str, skipped[:10])) + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
    lines = "line is not a record (line" if len(skipped) == 1 else "lines are not records (lines"
    return f"{path}: {len(skipped)} {lines} {shown}; torn by a kill, or edited)"


def check_history(dump_folder: Path, cfg: JobConfig) -> None:
    """A run that resumes no checkpoint (it starts at step 1) continues the metrics.jsonl of its
    dump folder, dropping its records, only where they are its own: a restart of the same run
    before its first checkpoint, with the same config.toml, that had not finished. A finished
    run's history, and any other run's, is never cut unless `job.overwrite` asks for it.

    Raises:
        ConfigError: metrics.jsonl holds records of a run with another (or no) config.toml, or of
            this config's run that reached its last step, and `job.overwrite` is false.
    """
    # Lines that are not records are said when the run cuts them (`_drop_records_from`).
    steps = [record["step"] for _, _, record in read_record_lines(dump_folder / METRICS_FILE)[0]]
    if not steps:
        return
    try:
        differ = [k for k in differing_keys(load_toml_config(dump_folder / "config.toml"), cfg) if k != "job.overwrite"]
    except ConfigError as err:  # missing or unreadable: not this run's
        differ = [f"config.toml: {err.problem}"]
    history = f"steps {min(steps)}-{max(steps)}"
    if cfg.job.overwrite:
        logger.warning("job.overwrite is true: the history in %s (%s) is replaced by this run's", dump_folder / METRICS_FILE,
                       history)
        return
    fix = (f"give this run its own folder (--job.dump_folder {free_folder_name(cfg.job.dump_folder)}), or pass "
           "--job.overwrite true to replace that history")
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise ConfigError("job.dump_folder", cfg.job.dump_folder,
                          f"holds the metrics.jsonl of another run ({history}; its config differs in {shown}), "
                          "which this run, starting at step 1 without a checkpoint to resume, would cut", fix)
    if max(steps) >= cfg.training.steps:
        raise ConfigError("job.dump_folder", cfg.job.dump_folder,
                          f"holds a finished run of this config (metrics.jsonl: {history} of {cfg.training.steps}), "
                          "whose history this run, starting again at step 1 without a checkpoint to resume "
                          "(checkpoint.enable), would replace", fix)
