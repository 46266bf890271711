"""A replica group's watch on its lighthouse (`distributed/lighthouse_watch.py`), against a TCP
listener that stands in for the lighthouse: a wait on the groups raises one `ConfigError` once it
is gone for the timeout; a listener back in time, or lost while nothing waits, stops nothing.
(The groups stopping when a real lighthouse is killed: tests/distributed/test_fault_tolerance.py.)"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from torchmoe.config.errors import ConfigError
from torchmoe.distributed.lighthouse_watch import LighthouseWatch

PROBE_S = 0.05
TIMEOUT_S = 0.4


def _listen(port: int = 0) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    return server


@pytest.fixture
def lighthouse() -> Iterator[socket.socket]:
    server = _listen()
    yield server
    server.close()


def _watch(server: socket.socket) -> LighthouseWatch:
    return LighthouseWatch(f"http://127.0.0.1:{server.getsockname()[1]}", env="TORCHFT_LIGHTHOUSE",
                           timeout_s=TIMEOUT_S, exit_after_s=None, probe_s=PROBE_S)


def test_a_blocked_wait_raises_once_the_lighthouse_is_gone_for_the_timeout(lighthouse: socket.socket) -> None:
    """The wait (an event nobody sets, as torchft's quorum future when the lighthouse is gone)
    is woken by the watch's signal and raises, after the timeout and within a few probes of it."""
    watch = _watch(lighthouse)
    url = f"http://127.0.0.1:{lighthouse.getsockname()[1]}"
    try:
        time.sleep(3 * PROBE_S)
        lighthouse.close()
        gone = time.monotonic()
        with pytest.raises(ConfigError) as err:
            with watch.waiting():
                threading.Event().wait(30)
        waited = time.monotonic() - gone
    finally:
        watch.close()
    # Counted from the last probe that connected (up to a probe before the close).
    assert TIMEOUT_S - PROBE_S <= waited < TIMEOUT_S + 5.0, waited  # (the wait: 30 s)
    assert re.match(re.escape(f'TORCHFT_LIGHTHOUSE = "{url}": stopped answering during the run (nothing for ')
                    + r"\d+ s: Connection refused\); the replica groups cannot form a quorum without it\n  fix: "
                    "start it again at that address", str(err.value)), str(err.value)
    assert "fault_tolerance.lighthouse_timeout_ms" in str(err.value)


def test_a_lighthouse_back_within_the_timeout_stops_nothing(lighthouse: socket.socket) -> None:
    """Gone for half the timeout, then listening again at its port (a restart): the wait ends
    on its own."""
    watch = _watch(lighthouse)
    port = lighthouse.getsockname()[1]
    try:
        lighthouse.close()
        restarted: list[socket.socket] = []
        threading.Timer(TIMEOUT_S / 2, lambda: restarted.append(_listen(port))).start()
        done = threading.Event()
        threading.Timer(3 * TIMEOUT_S, done.set).start()
        with watch.waiting():
            done.wait(30)
        assert done.is_set()
        restarted[0].close()
    finally:
        watch.close()


def test_a_lighthouse_lost_while_nothing_waits_raises_at_the_next_wait_only_if_still_gone(
        lighthouse: socket.socket) -> None:
    """Lost during the forward (no wait): nothing is interrupted there. Still gone when the step
    waits on the groups: that wait raises within a probe; back by then: it does not."""
    watch = _watch(lighthouse)
    try:
        lighthouse.close()
        time.sleep(2 * TIMEOUT_S)  # the "forward": not interrupted
        began = time.monotonic()
        with pytest.raises(ConfigError, match="stopped answering during the run"):
            with watch.waiting():
                threading.Event().wait(30)
        assert time.monotonic() - began < 5.0  # (the wait: 30 s)
        with pytest.raises(ConfigError):  # every later wait too: the run stops
            with watch.waiting():
                pass
    finally:
        watch.close()


def test_close_gives_the_signal_back() -> None:
    import signal

    from torchmoe.distributed.lighthouse_watch import SIGNAL

    before = signal.getsignal(SIGNAL)
    server = _listen()
    watch = _watch(server)
    assert signal.getsignal(SIGNAL) != before
    watch.close()
    server.close()
    assert signal.getsignal(SIGNAL) == before
