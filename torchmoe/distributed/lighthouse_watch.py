"""A replica group's watch on its lighthouse: a lighthouse that is gone ends the group within
seconds, with one message; one back at its address in time goes unnoticed.

    watch = LighthouseWatch(url, timeout_s=10.0)   # rank 0 of each group, in the main thread
    with watch.waiting():                          # around every wait on the other groups
        manager.start_quorum()
    watch.close()

torchft's manager server (on each group's rank 0) retries an unreachable lighthouse until the
quorum's timeout (comm.init_timeout_seconds, 300 s by default), then raises a `TimeoutError` on
its own thread: a killed lighthouse hung every group for minutes and ended them with a traceback.

Here rank 0 of each group opens a TCP connection to the lighthouse's port every `PROBE_S` (the
manager already sends it a heartbeat every 100 ms: one more connection a second is noise). When
the training thread waits on the groups (`waiting`: a quorum, a collective across groups, a
commit) and the lighthouse has not answered for `timeout_s` (fault_tolerance.lighthouse_timeout_ms),
that wait raises a `ConfigError` naming TORCHFT_LIGHTHOUSE, as any error of the run: exit 2, one
message, the group's other ranks stopped by the failure protocol. A lighthouse lost during the
forward, a checkpoint or validation stops nothing until a step waits on it, and one restarted at
its address within `timeout_s` is reached by the next quorum.

The error reaches the training thread by a signal (`SIGNAL`), the one thing that wakes a thread
blocked in a wait (torchft's quorum future); its handler raises only inside `waiting`. The
interpreter's exit would then wait for torchft's quorum thread, still retrying the lighthouse
until the quorum's timeout: the process leaves with status 2 `exit_after_s` after the error
(measured with groups of one rank: 20 s from the lighthouse's end to the exit with the failure
protocol's 15 s, 7 s with 2 s).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

from torchmoe.config.errors import ConfigError

PROBE_S = 1.0  # how often rank 0 of a group connects to the lighthouse's port
SIGNAL = signal.SIGUSR2  # what wakes the training thread's wait with the error
# After the error, how long the process may take to exit before it is ended with status 2: with
# several ranks the failure protocol's waits (acks, then the report) take up to 10 s of it; alone
# it needs only to print the error and release its folders.
EXIT_AFTER_S = {"alone": 2.0, "with_peers": 15.0}


class LighthouseWatch:
    """Probes the lighthouse at `url` (http://HOST:PORT, checked by `check_lighthouse` at the
    start) from a daemon thread; `waiting` raises once it has not answered for `timeout_s`.
    Construct it in the main thread (where the signal's handler is installed; elsewhere the
    wait is not woken and only a later `waiting` raises). `env`: the variable `url` came from,
    named by the error. `exit_after_s`: end the process this long after the error (`EXIT_AFTER_S`;
    None where the process is not the run's, as in a test)."""

    def __init__(self, url: str, *, env: str, timeout_s: float, exit_after_s: float | None,
                 probe_s: float = PROBE_S) -> None:
        parts = urllib.parse.urlsplit(url)
        self.url, self.env, self._address = url, env, (parts.hostname, parts.port)
        self.timeout_s, self.probe_s, self.exit_after_s = timeout_s, probe_s, exit_after_s
        self._waiting = 0  # depth of `waiting` blocks in the training thread
        self._lost: ConfigError | None = None
        self._stopped = threading.Event()
        self._main = threading.main_thread().ident
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(SIGNAL, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="torchmoe-lighthouse-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on the other groups: raises the `ConfigError` once the lighthouse is lost
        (at entry, when it was lost by then)."""
        self._waiting += 1
        try:
            if self._lost is not None:
                raise self._lost
            yield
        finally:
            self._waiting -= 1

    def close(self) -> None:
        """Stop probing; the signal's previous handler comes back."""
        self._stopped.set()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(SIGNAL, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame) -> None:
        if self._lost is not None and self._waiting:
            raise self._lost
        # Not this watch's (another process's SIGUSR2, or the wait ended meanwhile: the next
        # `waiting` raises): ignored.

    def _probe(self) -> str | None:
        """None when a TCP connection to the lighthouse opens within the probe period; else why not."""
        try:
            socket.create_connection(self._address, timeout=self.probe_s).close()
        except OSError as err:
            return err.strerror or type(err).__name__
        return None

    def _watch(self) -> None:
        answered = time.monotonic()
        while not self._stopped.wait(self.probe_s):
            reason = self._probe()
            now = time.monotonic()
            if reason is None:
                answered = now
                continue
            if now - answered < self.timeout_s or not self._waiting or self._stopped.is_set():
                continue
            self._lost = ConfigError(
                self.env, self.url, f"stopped answering during the run (nothing for {now - answered:.0f} s: "
                f"{reason}); the replica groups cannot form a quorum without it",
                "start it again at that address (torchmoe lighthouse --bind HOST:PORT), then launch the groups again: "
                "each resumes from its newest checkpoint (fault_tolerance.lighthouse_timeout_ms: how long it may be "
                "away before the groups stop)")
            signal.pthread_kill(self._main, SIGNAL)
            if self.exit_after_s is not None:
                backstop = threading.Timer(self.exit_after_s, _leave)
                backstop.daemon = True
                backstop.start()
            return


def _leave() -> None:
    """The process is still here `exit_after_s` after its error: its exit waits on torchft's
    quorum thread, which retries the lighthouse until the quorum's timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)
