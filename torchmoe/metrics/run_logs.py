"""Where a run's log messages go: the console, and each rank's log file.

    setup_logging(rank, log_level)                        # the console, first thing in a process
    log_file = LogFile.attach(dump_folder, rank, log_level)  # what is logged from here on ...
    log_file.open()                                       # ... goes to the file once the run goes ahead
    log_file.close(error)                                 # the error a failed rank leaves with, if any

The console shows rank 0's torchmoe messages at `metrics.log_level` and warnings and errors from
every rank (torch.distributed's and torchft's INFO too at "debug"). The log file of rank r,
``job.dump_folder/logs/rank<r>.log`` (`metrics.enable_log_files`), keeps what the console leaves
out: that rank's torchmoe messages, and torch.distributed's and torchft's INFO (every quorum,
recovery and process-group change), at INFO (DEBUG at "debug"), each line dated; a resumed run
appends below a line saying it started again, and a rank that fails ends its file with the error
and traceback. torchft's Rust core logs to stderr only (RUST_LOG; `import_torchft`).

The file follows the dump folder's rules: opened without following a symbolic link, each line
appended whole or not at all (`file_writes.append`). A line the file system refuses (a full disk)
is dropped, not held, as the log is not a record: the console says so once, and the file says how
many lines it lost once it takes lines again. Training goes on either way.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

from torchmoe.config.files.file_writes import append, open_append
from torchmoe.config.validate import LOG_LEVELS

__all__ = ["LOG_FILE_NAME", "LOG_FOLDER", "LogFile", "log_file_path", "reset_logging", "setup_logging"]

logger = logging.getLogger(__name__)

LOG_FOLDER = "logs"  # under job.dump_folder
LOG_FILE_NAME = re.compile(r"rank\d+\.log")

# metrics.log_level: the level of torchmoe's loggers on rank 0's console. At "debug" the
# libraries' loggers below also reach the console at INFO; otherwise only their warnings and
# errors do (through their own handlers, or ours: `_configure_libraries`), as nobody reading a
# run's console can act on their INFO. Their INFO goes to the log files whatever the level.
_LEVELS = {name: getattr(logging, name.upper()) for name in LOG_LEVELS}
_LIBRARY_LOGGERS = ("torch.distributed", "torchft")
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a disk that refuses the file now, not for good


def log_file_path(dump_folder: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` of a run in `dump_folder` keeps its log."""
    return Path(dump_folder) / LOG_FOLDER / f"rank{rank}.log"


class _CurrentStderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever `sys.stderr` is at emit time, so that rich's
    live progress bar (which swaps sys.stderr) keeps log lines above the bar."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        """StreamHandler.__init__ assigns a stream; ignored, as the stream is always sys.stderr."""


# What the last `setup_logging` said (the rank and metrics.log_level), and the log files
# attached: the libraries' loggers depend on all three (`_configure_libraries`).
_CONSOLE = {"rank": 0, "log_level": "info"}
_ATTACHED: list[LogFile] = []


def setup_logging(rank: int, log_level: str = "info") -> None:
    """Send the `torchmoe` loggers to stderr as `[rank<r>] HH:MM:SS LEVEL name: message`, and at
    `log_level` "debug" those of torch.distributed and torchft too (at INFO).

    Rank 0 logs at `log_level` (metrics.log_level); other ranks only warnings and errors, so that
    a problem on any rank is seen, but routine messages are not repeated world-size times.
    Idempotent; an attached `LogFile` keeps getting what it got.
    """
    _CONSOLE.update(rank=rank, log_level=log_level)
    level = _LEVELS[log_level]
    log = logging.getLogger("torchmoe")
    _detach_console(log)
    log.addHandler(_console(rank, level if rank == 0 else max(level, logging.WARNING)))
    log.propagate = False
    _set_level(log)
    _configure_libraries()


def reset_logging() -> None:
    """Undo `setup_logging` and close every attached `LogFile`: the loggers as the libraries left
    them (for a process that runs several jobs, such as a test session)."""
    for handler in list(_ATTACHED):
        handler.close()
    _CONSOLE.update(rank=0, log_level="info")
    _configure_libraries()
    log = logging.getLogger("torchmoe")
    _detach_console(log)
    log.propagate = True
    _set_level(log)


def _console(rank: int, level: int) -> logging.Handler:
    handler = _CurrentStderrHandler()
    handler.setLevel(level)
    handler.setFormatter(
        logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    return handler


def _detach_console(log: logging.Logger) -> None:
    """Remove `setup_logging`'s handlers from `log`."""
    for handler in [h for h in log.handlers if isinstance(h, _CurrentStderrHandler)]:
        log.removeHandler(handler)


def _set_level(log: logging.Logger) -> None:
    """`log`'s level: the lowest of our handlers' on it (each filters for itself), NOTSET without
    any. Others' handlers (pytest's capture) do not count: they take what they are given."""
    ours = [h.level for h in log.handlers if isinstance(h, (_CurrentStderrHandler, LogFile))]
    log.setLevel(min(ours, default=logging.NOTSET))


# ---- torch.distributed's and torchft's loggers ------------------------------------------------

# The library loggers taken over (`_configure_libraries`): their level and propagation before.
_TAKEN_OVER: dict[str, tuple[int, bool]] = {}


class _AtLeast(logging.Filter):
    """Passes records of `level` and above: a library's own handler prints what it did before."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def _configure_libraries() -> None:
    """torch.distributed's and torchft's loggers: left as the libraries have them unless their
    INFO is wanted, on rank 0's console at "debug" or in a log file. Then each is taken over,
    with every logger below it that does not propagate (torch's own logging gives some of
    torch.distributed's modules a handler of their own): its level lowered, not propagating (an
    ancestor's handler would print the INFO), each handler already on it filtered to what it
    printed before (or to INFO on rank 0 at "debug"), the log files added; the library's
    warnings reach the console through ours where no handler of its own prints them."""
    for name in list(_TAKEN_OVER):
        _release(logging.getLogger(name))
    rank, debug = _CONSOLE["rank"], _CONSOLE["log_level"] == "debug" and _CONSOLE["rank"] == 0
    if not (debug or _ATTACHED):
        return
    levels = [h.level for h in _ATTACHED] + ([logging.INFO] if debug else [])
    for name in _LIBRARY_LOGGERS:
        # What each printed before, read before any level below `name` is lowered.
        loggers = [(log, logging.INFO if debug else log.getEffectiveLevel()) for log in _unpropagated(name)]
        for log, shown in loggers:
            _TAKEN_OVER[log.name] = (log.level, log.propagate)
            for handler in log.handlers:
                handler.addFilter(_AtLeast(shown))
            if log.name == name and not log.handlers:  # its records went up to an ancestor's
                log.addHandler(_console(rank, logging.INFO if debug else logging.WARNING))
            for handler in _ATTACHED:
                log.addHandler(handler)
            log.propagate = False
            log.setLevel(min(levels))


def _unpropagated(name: str) -> list[logging.Logger]:
    """The logger `name` and each existing logger below it that does not propagate."""
    below = [log for key, log in sorted(logging.root.manager.loggerDict.items())
             if key.startswith(f"{name}.") and isinstance(log, logging.Logger) and not log.propagate]
    return [logging.getLogger(name), *below]


def _release(log: logging.Logger) -> None:
    """A taken-over library logger back as it was."""
    level, propagate = _TAKEN_OVER.pop(log.name)
    for handler in [h for h in log.handlers if isinstance(h, (_CurrentStderrHandler, LogFile))]:
        log.removeHandler(handler)
    for handler in log.handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, _AtLeast)]
    log.setLevel(level)
    log.propagate = propagate


class LogFile(logging.Handler):
    """One rank's log file (see the module docstring): `attach` it, then `open` it once the run
    goes ahead; what is logged between the two is kept in memory (at most `PENDING_LINES` lines)
    and written first, so that a run refused before it writes anything leaves no file."""

    PENDING_LINES = 10_000

    def __init__(self, path: Path, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.path = path
        self.fd: int | None = None
        self.pending: list[str] | None = []  # None once `open` was called
        self.closed = False
        self.dropped = 0  # lines refused since the last one written
        self.fault: OSError | None = None
        self._warning = False  # saying on the console that lines are dropped (not to this file)

    @classmethod
    def attach(cls, dump_folder: str | os.PathLike, rank: int, log_level: str = "info") -> LogFile:
        """Rank `rank`'s log file in `dump_folder`, attached to torchmoe's, torch.distributed's and
        torchft's loggers, not open yet."""
        handler = cls(log_file_path(dump_folder, rank), logging.DEBUG if log_level == "debug" else logging.INFO)
        handler.pending.append(f"{_now()} rank {rank} (pid {os.getpid()}) starts logging here")
        logging.getLogger("torchmoe").addHandler(handler)
        _set_level(logging.getLogger("torchmoe"))
        _ATTACHED.append(handler)
        _configure_libraries()
        return handler

    def open(self) -> None:
        """Create the file with its folder, or append to it, and write what was logged since
        `attach`. A disk too full to create them is a full disk's dropped lines (the creation is
        tried again with each line).

        Raises:
            OSError: what the OS says; ELOOP when the logs folder or the file is a symbolic link
                (a run never writes through one).
        """
        pending, self.pending = self.pending, None
        try:
            self._create()
        except OSError as err:
            if err.errno not in _FULL:
                raise
        for line in pending:
            self._write_line(line)

    def _create(self) -> None:
        folder = self.path.parent
        if folder.is_symlink():
            raise OSError(errno.ELOOP, "is a symbolic link (a run never writes through one)", str(folder))
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = open_append(self.path)

    def emit(self, record: logging.LogRecord) -> None:
        if self._warning or self.closed:
            return
        try:
            line = self.format(record)
        except Exception:  # a bad format string in some library's call: logging's own report
            self.handleError(record)
            return
        if self.pending is None:
            self._write_line(line)
        elif len(self.pending) < self.PENDING_LINES:
            self.pending.append(line)

    def note(self, text: str) -> None:
        """`text` (the run's opening and closing, which go to the console without a logger) as a
        dated line of this file only."""
        self.emit(logging.LogRecord("torchmoe", logging.INFO, "", 0, "%s", (text,), None))

    def _write_line(self, line: str) -> None:
        if self.pending is not None or self.closed:
            return
        data = (line + "\n").encode("utf-8", "backslashreplace")
        if self.dropped:
            data = f"{_now()} ({self.dropped} lines were not written: {self.fault.strerror})\n".encode() + data
        try:
            if self.fd is None:  # a full disk refused to create it
                self._create()
            append(self.fd, data, self.path)
        except OSError as err:
            if self.fault is None:
                self._warning = True
                try:
                    logger.warning("%s: %s: log lines are dropped until it takes them again; training goes on",
                                   self.path, err.strerror)
                finally:
                    self._warning = False
            self.fault = err
            self.dropped += 1
            return
        self.fault, self.dropped = None, 0

    def close(self, error: BaseException | None = None) -> None:
        """Detach from the loggers and close the file (if it was opened), after `error` (why
        this rank leaves, with its traceback) if given. Idempotent."""
        log = logging.getLogger("torchmoe")
        if self in log.handlers:
            log.removeHandler(self)
            _set_level(log)
        if self in _ATTACHED:
            _ATTACHED.remove(self)
            _configure_libraries()
        if error is not None:
            text = "".join(traceback.format_exception(error)).rstrip()
            self._write_line(f"{_now()} leaving with an error:\n{text}")
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.closed = True
        super().close()


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
