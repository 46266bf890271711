"""Where a run's log messages go (`metrics.run_logs`): rank 0's console at metrics.log_level,
warnings from every rank, and each rank's log file with what the console leaves out."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from torchmoe.metrics import run_logs
from torchmoe.metrics.run_logs import LogFile, log_file_path, reset_logging, setup_logging


@pytest.fixture
def restored_loggers():
    """The loggers `setup_logging` and `LogFile` configure (and `torch_logging` sets up), put
    back as they were."""
    names = ("torchmoe", "torch", "torch.distributed", "torch.distributed.distributed_c10d", "torchft")
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    yield
    reset_logging()
    for name, (handlers, level, propagate) in saved.items():
        log = logging.getLogger(name)
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _torch_logging() -> _Records:
    """torch.distributed's loggers as torch's own logging leaves them in a worker: it and some of
    its modules' (distributed_c10d) with a handler of their own, each printing what reaches it,
    not propagating, at `torch`'s WARNING; the handler they share."""
    handler = _Records()
    for name in ("torch.distributed", "torch.distributed.distributed_c10d"):
        log = logging.getLogger(name)
        log.handlers[:], log.propagate, log.level = [handler], False, logging.NOTSET
    logging.getLogger("torch").setLevel(logging.WARNING)
    return handler


@pytest.mark.parametrize("log_level, shown", [
    ("warning", ["torchmoe warning"]),
    ("info", ["torchmoe info", "torchmoe warning"]),
    ("debug", ["torchmoe debug", "torchmoe info", "torchmoe warning", "torchft info"]),
])
def test_log_level_decides_what_reaches_rank_0s_console(capsys, restored_loggers, log_level: str,
                                                        shown: list[str]) -> None:
    """metrics.log_level: torchmoe's own messages from its level up; torch.distributed's and
    torchft's INFO only at "debug" (torch.distributed's through torch's own handler, once);
    their warnings always, by their own handlers or Python's last resort."""
    torch_handler = _torch_logging()
    libraries = [logging.getLogger(n) for n in ("torch.distributed", "torchft")]
    before = [(log.level, log.propagate, list(log.handlers)) for log in libraries]
    setup_logging(0, "debug")  # a second call replaces the first: nothing shown twice, nothing stuck
    setup_logging(0, log_level)
    for name in ("torchmoe.trainer", "torch.distributed.c10d", "torchft.manager"):
        lib = name.split(".")[0] if name != "torch.distributed.c10d" else "torch.distributed"
        for level in ("debug", "info"):
            getattr(logging.getLogger(name), level)(f"{lib} {level}")
    logging.getLogger("torchmoe.trainer").warning("torchmoe warning")
    err = capsys.readouterr().err
    got = [line.split(": ", 1)[1] for line in err.splitlines() if line.startswith("[rank0]")]
    assert sorted(got) == sorted(shown), err
    assert [r.getMessage() for r in torch_handler.records] == (["torch.distributed info"] if log_level == "debug"
                                                               else [])
    if log_level != "debug":  # the libraries' loggers as torch and torchft had them
        assert [(log.level, log.propagate, log.handlers) for log in libraries] == before
        assert not any(h.filters for log in libraries for h in log.handlers)


def test_log_level_debug_shows_torchfts_rust_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's Rust core: WARN unless metrics.log_level is "debug" (INFO); a RUST_LOG the user
    set wins."""
    pytest.importorskip("torchft")
    from torchmoe.distributed.fault_tolerance import import_torchft

    for level, want in (("info", "warn"), ("warning", "warn"), ("debug", "info")):
        monkeypatch.delenv("RUST_LOG", raising=False)
        import_torchft(level)
        assert os.environ["RUST_LOG"] == want
    monkeypatch.setenv("RUST_LOG", "torchft=debug")
    import_torchft("info")
    assert os.environ["RUST_LOG"] == "torchft=debug"


def test_setup_logging_prefixes_the_rank(capsys: pytest.CaptureFixture) -> None:
    setup_logging(3)
    try:
        log = logging.getLogger("torchmoe.metrics.test")
        log.info("hidden on rank 3")
        log.warning("router collapsed")
        err = capsys.readouterr().err
        assert "[rank3]" in err and "router collapsed" in err and "hidden" not in err
    finally:
        root = logging.getLogger("torchmoe")
        for h in list(root.handlers):
            root.removeHandler(h)
        root.propagate = True
        root.setLevel(logging.NOTSET)


def _lines(path: Path) -> list[str]:
    """The file's lines without their date and time."""
    return [line.split(" ", 2)[2] if line[:2] == "20" else line for line in path.read_text().splitlines()]


def test_a_ranks_log_file_keeps_what_its_console_leaves_out(capsys, restored_loggers, tmp_path: Path) -> None:
    """Rank 1 at "info": the console shows its warning only; its file holds its own INFO and the
    libraries' (what a user reads after a failure), dated, from `attach` on; DEBUG nowhere."""
    setup_logging(1, "info")
    torch_handler = _torch_logging()
    log_file = LogFile.attach(tmp_path, 1, "info")
    logging.getLogger("torchmoe.trainer").info("before the run goes ahead")
    assert not (tmp_path / "logs").exists()  # a run refused now leaves nothing
    log_file.open()
    for name in ("torchmoe.trainer", "torch.distributed.c10d", "torch.distributed.distributed_c10d",
                 "torchft.manager"):
        logging.getLogger(name).debug(f"{name} debug")
        logging.getLogger(name).info(f"{name} info")
    logging.getLogger("torchmoe.trainer").warning("router collapsed")
    log_file.note("done: step 3/3")
    log_file.close()
    logging.getLogger("torchmoe.trainer").warning("after the close")
    path = log_file_path(tmp_path, 1)
    assert path == tmp_path / "logs" / "rank1.log"
    assert _lines(path) == [
        f"rank 1 (pid {os.getpid()}) starts logging here",
        "INFO torchmoe.trainer: before the run goes ahead",
        "INFO torchmoe.trainer: torchmoe.trainer info",
        "INFO torch.distributed.c10d: torch.distributed.c10d info",
        "INFO torch.distributed.distributed_c10d: torch.distributed.distributed_c10d info",
        "INFO torchft.manager: torchft.manager info",
        "WARNING torchmoe.trainer: router collapsed",
        "INFO torchmoe: done: step 3/3",
    ]
    assert path.read_text().startswith("20") and " rank 1 (pid" in path.read_text().splitlines()[0]
    logging.getLogger("torch.distributed.c10d").warning("a library warning")
    err = capsys.readouterr().err
    assert [line.split(": ", 1)[1] for line in err.splitlines()] == ["router collapsed", "after the close"]
    # The libraries' INFO went to the file only: torch's handlers printed only its warnings, as
    # before the file, and are as they were.
    assert [r.getMessage() for r in torch_handler.records] == ["a library warning"]
    assert not torch_handler.filters and logging.getLogger("torch.distributed").level == logging.NOTSET
    # Detached: the loggers are as `setup_logging` left them (the libraries at their own level).
    assert all(not isinstance(h, LogFile) for n in ("torchmoe", "torch.distributed", "torchft")
               for h in logging.getLogger(n).handlers)
    assert logging.getLogger("torch.distributed").level == logging.NOTSET
    assert logging.getLogger("torchmoe").level == logging.WARNING


def test_a_resumed_run_appends_and_a_failed_rank_ends_with_its_error(restored_loggers, tmp_path: Path) -> None:
    setup_logging(0, "debug")
    for attempt in range(2):
        log_file = LogFile.attach(tmp_path, 0, "debug")
        log_file.open()
        logging.getLogger("torchmoe.checkpoint").debug(f"attempt {attempt}")
        try:
            raise RuntimeError("a peer failed")
        except RuntimeError as err:
            log_file.close(err if attempt else None)
    lines = _lines(log_file_path(tmp_path, 0))
    assert [line for line in lines if "starts logging here" in line or "attempt" in line] == [
        f"rank 0 (pid {os.getpid()}) starts logging here", "DEBUG torchmoe.checkpoint: attempt 0",
        f"rank 0 (pid {os.getpid()}) starts logging here", "DEBUG torchmoe.checkpoint: attempt 1"]
    error = lines.index("leaving with an error:")
    assert lines[error + 1] == "Traceback (most recent call last):" and any('raise RuntimeError("a peer failed")' in line for line in lines)
    assert lines[-1] == "RuntimeError: a peer failed" and lines.count("leaving with an error:") == 1


@pytest.mark.parametrize("link", ["logs", "logs/rank0.log"])
def test_the_log_file_is_never_written_through_a_link(restored_loggers, tmp_path: Path, link: str) -> None:
    """A link in place of the folder or the file (to another run's log): refused, nothing written
    there (preflight refuses it at start with one message: test_run_safety)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.log").write_text("another run's log\n")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True) if link != "logs" else run.mkdir()
    (run / link).symlink_to(elsewhere if link == "logs" else elsewhere / "rank0.log")
    log_file = LogFile.attach(run, 0)
    with pytest.raises(OSError) as err:
        log_file.open()
    log_file.close()
    assert err.value.errno == errno.ELOOP
    assert (elsewhere / "rank0.log").read_text() == "another run's log\n"


def test_lines_a_full_disk_refuses_are_dropped_and_counted(capsys, restored_loggers, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is not a record: lines the disk refuses are dropped (none held in memory), the
    console says so once, and the file says how many it lost once it takes lines again."""
    setup_logging(0, "info")
    log_file = LogFile.attach(tmp_path, 0)
    log_file.open()
    write = run_logs.append
    full = True

    def refusing(fd: int, data: bytes, path) -> None:
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(fd, data, path)

    monkeypatch.setattr(run_logs, "append", refusing)
    log = logging.getLogger("torchmoe.trainer")
    for step in range(3):
        log.info(f"lost {step}")
    full = False
    log.info("kept")
    log_file.close()
    lines = _lines(log_file_path(tmp_path, 0))
    assert lines[1:] == ["(3 lines were not written: No space left on device)", "INFO torchmoe.trainer: kept"]
    err = capsys.readouterr().err
    assert err.count("log lines are dropped until it takes them again") == 1 and "Traceback" not in err


def test_a_disk_too_full_to_create_the_file_creates_it_later(capsys, restored_loggers, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's own files took the last pages: the file is made with the first line that fits,
    counting those dropped before it; a symbolic link is refused at once all the same."""
    setup_logging(0, "info")
    real = run_logs.open_append
    full = True

    def refusing(path):
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path)

    monkeypatch.setattr(run_logs, "open_append", refusing)
    log_file = LogFile.attach(tmp_path, 0)
    log_file.open()  # the "starts logging here" line is the first dropped
    logging.getLogger("torchmoe.trainer").info("lost")
    full = False
    logging.getLogger("torchmoe.trainer").info("kept")
    log_file.close()
    assert _lines(log_file_path(tmp_path, 0)) == ["(2 lines were not written: No space left on device)",
                                                  "INFO torchmoe.trainer: kept"]
    assert capsys.readouterr().err.count("log lines are dropped") == 1
