"""A full disk anywhere is one message with the OS's reason and exit 2, and leaves nothing half-written:
checkpoint saves (sync and async), the Hugging Face export, the metrics append, the run's files at
start, and `torchmoe convert` both ways, each on a small tmpfs of its own.

    python -m pytest -q -m integration tests/integration/test_disk_full.py

Mounting a tmpfs needs root: without it every test here is skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, HF_EXPORT, empty_tiny_model
from torchmoe.checkpoints.checkpoint_state import load_model_only
from torchmoe.commands import cli
from torchmoe.config import load_job_config
from torchmoe.config.files.paths import FULL_FIX
from torchmoe.config.job_file import config_toml
from torchmoe.metrics.metrics_records import parse_record

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "0"]
FULL = "No space left on device"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """`mount(size)`: a fresh tmpfs of `size` (as mount's `size=`), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a disk these tests can fill) needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def _fill(disk: Path, leave: int) -> None:
    """Take all of `disk` but `leave` bytes."""
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))


def _start_pages(dump: Path, *flags: str) -> int:
    """The pages a run's start writes in `dump`: the lock's and run_info.json's one each, and
    config.toml's (the resolved job, longer than a page as sections are added)."""
    cfg = load_job_config([*TINY, "--job.dump_folder", str(dump), *flags])
    return 2 - (-len(config_toml(cfg).encode()) // os.sysconf("SC_PAGESIZE"))


def _train(capsys: pytest.CaptureFixture[str], dump: Path, *flags: str) -> tuple[int, str]:
    """`torchmoe train TINY FLAGS` in this process; (exit status, stderr)."""
    status = cli.main(["train", *TINY, "--job.dump_folder", str(dump), *flags])
    return status, capsys.readouterr().err


def _one_error(status: int, err: str, *expected: str) -> str:
    """The user error's message (exit 2, one error, no traceback) holding each of `expected`."""
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    message = err[err.index("error:"):]
    for text in expected:
        assert text in message, message
    return message


def _steps(dump: Path) -> list[int]:
    """The steps of metrics.jsonl, which must hold whole records only."""
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    records = [parse_record(line) for line in lines]
    assert None not in records, lines  # no torn record
    return [r["step"] for r in records]


def _leftovers(folder: Path) -> list[str]:
    """Temporary files and folders of writers anywhere under `folder`."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name or p.name == ".rank-shards")


def test_a_checkpoint_save_on_a_full_disk_is_reported_and_training_goes_on(capsys, small_disk) -> None:
    """40 MB: step-1 (30 MB) fits, step-2 does not (mid-run: training goes on), nor the last."""
    dump = small_disk("40m") / "run"
    status, err = _train(capsys, dump, "--training.steps", "3", "--checkpoint.enable", "true",
                         "--checkpoint.interval", "1")
    checkpoints = dump / "checkpoint"
    _one_error(status, err, f'checkpoint.folder = "{checkpoints}": checkpoint step-3 could not be saved ({FULL})',
               f"the newest checkpoint on disk is {checkpoints / 'step-1'}", "fix: free space")
    assert f"checkpoint step-2 could not be saved ({FULL}); training goes on" in err  # not "damaged or truncated"
    assert _steps(dump) == [1, 2, 3]
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-1"] and not _leftovers(dump)
    load_model_only(checkpoints / "step-1", [empty_tiny_model()])  # intact


def test_an_async_save_filling_the_disk_before_a_metrics_write(capsys, small_disk) -> None:
    """20 MB: each background save fills the disk while the next steps log their records."""
    dump = small_disk("20m") / "run"
    status, err = _train(capsys, dump, "--training.steps", "3", "--checkpoint.enable", "true",
                         "--checkpoint.interval", "1", "--checkpoint.async_mode", "async")
    _one_error(status, err, "checkpoint step-3 could not be saved", FULL, "no checkpoint is on disk")
    assert not list((dump / "checkpoint").glob("step-*")) and not _leftovers(dump)
    assert _steps(dump) == [1, 2, 3]  # a record held back is written once the failed save's space is free


def test_the_hugging_face_export_on_a_full_disk_leaves_nothing(capsys, small_disk) -> None:
    """36 MB: the last checkpoint (30 MB) fits, its Hugging Face export (10 MB) does not."""
    dump = small_disk("36m") / "run"
    status, err = _train(capsys, dump, "--training.steps", "2", "--checkpoint.enable", "true",
                         "--checkpoint.last_save_in_hf", "true", *HF_EXPORT)
    checkpoints = dump / "checkpoint"
    _one_error(status, err, f'checkpoint.folder = "{checkpoints}": checkpoint step-2-hf could not be saved ({FULL}',
               f"the newest checkpoint on disk is {checkpoints / 'step-2'}")
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-2"] and not _leftovers(dump)


def test_the_hugging_face_export_without_checkpoints(capsys, small_disk) -> None:
    dump = small_disk("4m") / "run"
    status, err = _train(capsys, dump, "--training.steps", "1", "--checkpoint.last_save_in_hf", "true", *HF_EXPORT)
    _one_error(status, err, f"checkpoint step-1-hf could not be saved ({FULL}", "no checkpoint is on disk")
    assert not list((dump / "checkpoint").glob("step-*")) and not _leftovers(dump)
    assert _steps(dump) == [1]


def test_metrics_the_disk_refuses_are_held_and_named_at_the_end(capsys, small_disk, tmp_path) -> None:
    """The dump folder's disk takes the run's start (lock, config.toml and run_info.json: a page
    each) but no record and no log line; the checkpoints are elsewhere: training goes on and
    saves, the log's lines are dropped (said once), and the run ends with exit 2 naming the
    records that could not be written."""
    disk = small_disk("1m")
    dump = disk / "run"
    flags = ("--training.steps", "3", "--checkpoint.enable", "true", "--checkpoint.folder", str(tmp_path / "ckpt"))
    _fill(disk, _start_pages(dump, *flags) * os.sysconf("SC_PAGESIZE"))
    status, err = _train(capsys, dump, *flags)
    _one_error(status, err, f'job.dump_folder = "{dump}": {dump / "metrics.jsonl"}: {FULL}: the records of steps '
               "1-3 could not be written (training and its checkpoints went on)", f"fix: {FULL_FIX}")
    assert f"metrics.jsonl: {FULL}: the record of step 1 and those after it are held in memory" in err
    assert err.count(f"rank0.log: {FULL}: log lines are dropped until it takes them again; training goes on") == 1
    assert (dump / "metrics.jsonl").read_bytes() == b"" and not _leftovers(dump)  # nothing half-written
    load_model_only(tmp_path / "ckpt" / "step-3", [empty_tiny_model()])


def test_a_full_disk_at_start_is_one_message(capsys, small_disk) -> None:
    disk = small_disk("1m")
    _fill(disk, 0)
    status, err = _train(capsys, disk / "run", "--training.steps", "1")
    _one_error(status, err, f'job.dump_folder = "{disk / "run"}": ', FULL, f"fix: {FULL_FIX}")
    assert "step 1" not in err and not _leftovers(disk)


@pytest.mark.parametrize("direction", ["hf-to-dcp", "dcp-to-hf"])
@pytest.mark.parametrize("out", ["new", "empty"])
def test_convert_onto_a_full_disk_leaves_no_partial_output(capsys, small_disk, hf_dir, tmp_path, direction,
                                                           out) -> None:
    """4 MB for 10 MB of weights: one message naming OUT_DIR; a folder it created is gone, an empty
    one it was given is left empty."""
    source = hf_dir
    if direction == "dcp-to-hf":
        source = tmp_path / "dcp"
        assert cli.main(["convert", "hf-to-dcp", str(hf_dir), str(source)]) == 0
    disk = small_disk("4m")
    target = disk / "out" if out == "new" else disk
    flavor = ["--flavor", "tiny"] if direction == "dcp-to-hf" else []
    capsys.readouterr()
    status = cli.main(["convert", direction, str(source), str(target), *flavor])
    _one_error(status, capsys.readouterr().err, f'OUT_DIR = "{target}": {FULL}', "nothing of the conversion is "
               f"left there\n  fix: {FULL_FIX}")
    assert os.listdir(disk) == []


def test_a_profiler_trace_the_disk_refuses_is_skipped_with_one_warning(capsys, small_disk, tmp_path) -> None:
    """Traces are diagnostics: the one of step 2 meets a full disk, is skipped (no partial file)
    and training ends normally."""
    traces = small_disk("1m")
    _fill(traces, os.sysconf("SC_PAGESIZE"))  # the folder's lock, and no trace
    status, err = _train(capsys, tmp_path / "run", "--training.steps", "2", "--profiling.enable_profiling", "true",
                         "--profiling.profile_freq", "2", "--profiling.save_traces_folder", str(traces))
    assert status == 0 and "Traceback" not in err, err
    # Kineto ignores the failed write: no trace is how it shows, with the space left.
    assert "the profiler trace of step 2 was not written (the profiler wrote none and does not say why; 0 KiB are " \
           f"free there: {traces / 'iteration_2' / 'rank0_trace.json'}): skipped; training goes on" in err, err
    assert sorted(p.name for p in traces.rglob("*")) == [".torchmoe.lock", "filler", "iteration_2"]
    assert _steps(tmp_path / "run") == [1, 2]
