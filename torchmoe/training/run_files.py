"""The files a run writes beside its checkpoints once it is known to go ahead."""

from __future__ import annotations

from pathlib import Path

from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_file import write_config_toml
from torchmoe.distributed.one_reader import one_reads
from torchmoe.metrics.metrics_records import check_history
from torchmoe.metrics.run_logs import LogFile
from torchmoe.run_folders.run_info import write_run_info


def write_run_files(cfg: JobConfig, dump_folder: Path, *, rank: int, world_size: int, log_file: LogFile | None,
                    resumed: bool) -> None:
    """Write config.toml and run_info.json (rank 0) and open every rank's log file, once nothing
    can refuse the run any more: a refused run leaves the folder as it found it. A run that
    resumed no checkpoint must not cut another run's metrics (`metrics.check_history`); rank
    0 decides for every rank.

    Raises:
        ConfigError: on every rank, from `check_history`.
    """
    one_reads(lambda: None if resumed else check_history(dump_folder, cfg))
    if rank == 0:
        write_config_toml(cfg, dump_folder / "config.toml")
        write_run_info(dump_folder, world_size=world_size)
    if log_file is not None:  # after the files a resume needs, on a disk nearly full
        log_file.open()
