"""One failing rank ends every rank within seconds, with one message.

    watch = FailureWatch.start()      # every rank, right after init_process_group
    try:
        ...                           # build, load, train
    except BaseException as err:
        watch.fail(err)               # raises PeerFailed when another rank failed first
        raise                         # this rank's own error: the CLI reports it
    watch.stop()                      # finished normally (then destroy_process_group)

Why this is needed: a rank that raises leaves its peers blocked in a collective with it. NCCL
peers notice only at the collective timeout; gloo peers notice when the failed process exits,
but it may not exit: on its way out it can enter a collective of its own (a checkpoint barrier)
that the others, blocked elsewhere, never join. torchrun's agent kills the survivors once a
worker has exited; started by SLURM's srun (no agent), nobody does.

The protocol runs over the rendezvous store every rank already holds (torchrun's agent store,
or the TCPStore that rank 0 hosts under env:// rendezvous), on connections of its own (a
`clone()` per thread, so it never waits behind torch's own store traffic):

1. The failing rank claims the failure record (`compare_set`: the first failure wins) with its
   rank, exit status and message. It enters no further collective (no checkpoint wait or
   barrier, not even `destroy_process_group`); in an NCCL job it aborts its communicators.
2. Every other rank's watch thread polls the record (`check`, once per `POLL_S`), acks it and,
   under NCCL, aborts its process groups, so that its main thread's blocked collective fails at
   once. Under gloo that collective fails when the failing process exits and its sockets close
   (measured: gloo's abort does neither, and an aborted gloo group hangs the interpreter's exit).
   The main thread then raises `PeerFailed`: one line, "rank N failed", with the failing rank's
   exit status.
3. The failing rank waits (up to `ACK_WAIT_S`) until every peer has acked before it exits: the
   peers then know why their collectives fail when its exit closes its sockets, and have read
   the record before its exit takes the store with it (rank 0 under srun).
4. The failing rank marks its record reported once its error is printed (the CLI's handler, or
   the interpreter's hook for an unexpected error's traceback), and every other rank waits for
   that mark (up to `REPORT_WAIT_S`) before it exits. A launcher stops the rest of a job as soon
   as one process exits: without the wait, a peer that learned of the failure from the record
   (no collective blocked it: the ranks raised the same error, or NCCL's abort freed it) exits
   first and torchrun's SIGTERM takes the failing rank's message with it.
5. Backstop: once a rank knows of a failure it exits within `EXIT_GRACE_S` (plus the wait for
   the report), whatever its main thread is blocked in (a gloo collective with another
   survivor, an async checkpoint's future, interpreter exit joining a thread stuck in a
   collective): `os._exit` with the failure's status, after printing the one line if the main
   thread never got to it.

A rank that dies without a word (`kill -9`, the OOM killer, a node gone) publishes nothing. Its
peers' collectives with it fail on the lost connection ("Connection reset by peer": `lost_peer`
reads it in the error or what the error wraps); the first such rank publishes a LOST_PEER record
in its place, naming the connection, and every rank stops with one line, status 1, without a
traceback (the publishing rank waits only for the live peers' acks). A lost store (its host
killed) cannot carry a record: each rank's watch leaves at once with one line (STORE), since the
live ranks could otherwise go on training among themselves until the backstop.

At the normal end rank 0 leaves last (`stop` waits, bounded, until every rank has stopped its
watch): under env:// rendezvous rank 0's exit ends the store, and a rank still polling it would
take that for a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from torchmoe import _torch_private as private
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.launch_env import tell_launcher
from torchmoe.distributed.interruption import Interrupted
from torchmoe.distributed.process_groups import device_backend

POLL_S = 1.0  # how often the watch thread looks for a failure record
ACK_WAIT_S = 5.0  # how long the failing rank waits for every peer to have read its record
EXIT_GRACE_S = 5.0  # how long a rank that knows of a failure may take to exit before os._exit
REPORT_WAIT_S = 5.0  # how long a peer waits for the failing rank to have printed its error

# Set once this process has left a run for a failure (its own or a peer's): see `leave`.
_FAILED = False
_LEAVING: FailureWatch | None = None  # the watch of the run this process left for a failure


def leave(status: int) -> None:
    """End the process with `status` (see `leave_if_failed`)."""
    leave_if_failed(status)
    sys.exit(status)


def leave_if_failed(status: int) -> None:
    """After a failure, end the process with `status` at once. Its process groups may still have
    work in flight (a dropped async save), and their C++ destructors can abort the process
    ("terminate called without an active exception"): such a process leaves with its output
    flushed and without running them. Call it while the failing frames (the trainer, its meshes
    and process groups) are still referenced: in the handler that reported the error, before
    unwinding frees them."""
    if _FAILED:
        if threading.current_thread() is threading.main_thread():
            # Leaving with `status` already: a peer that saw the report mark may exit first, and
            # torchrun's SIGTERM to this rank, still waiting for the other peers' marks, ended it
            # by the signal (exit -15 instead of its own status: a CI failure): the CLI's
            # handlers, which would ignore it, are gone once its `interrupt_on_signals` has ended.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        if _LEAVING is not None:
            _LEAVING.settle_report()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


_PREFIX = "torchmoe/failure/"
_RECORD, _ACKS, _STOPPED, _REPORTED, _SEEN = "record", "acks", "stopped", "reported", "seen"


# Failure kinds: a rank's own error; a rank that lost its connection to a peer which died without
# a word (killed, out of memory, its node gone); the rendezvous store lost.
ERROR, LOST_PEER, STORE = "error", "lost_peer", "store"


@dataclass(frozen=True)
class Failure:
    """The first failure, as published: `rank` is the rank that failed (ERROR) or found a peer
    gone (LOST_PEER), None when the store itself was lost (STORE)."""

    rank: int | None
    status: int  # the exit status every rank takes: 2 for a user error, 128 + n for signal n, else 1
    message: str
    kind: str = ERROR

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> Failure:
        return cls(**json_loads(data))


class PeerFailed(RuntimeError):
    """This rank stopped because another rank failed (or the rendezvous store was lost); the
    cause is reported by that rank, this one prints one line and exits with `exit_status`."""

    def __init__(self, failure: Failure, rank: int) -> None:
        self.failure = failure
        self.exit_status = failure.status
        if failure.kind == STORE:
            text = f"[rank {rank}] stopped: {failure.message}"
        elif failure.kind == LOST_PEER:
            text = (f"[rank {rank}] stopped: a rank died without reporting an error (killed, out of memory, or its "
                    f"node failed; the launcher's log names it): {failure.message}")
        else:
            text = f"[rank {rank}] stopped because rank {failure.rank} failed (its error is reported by rank {failure.rank})"
        super().__init__(text)

    def with_cause(self) -> str:
        """This rank's line and, for a rank's own error, that error: what torchrun's summary of
        this rank says (`launch_env.tell_launcher`), which may be the last thing on the screen."""
        if self.failure.kind != ERROR:
            return str(self)
        return f"{self}\nrank {self.failure.rank}'s error: {self.failure.message}"


def exit_status(err: BaseException) -> int:
    """The CLI's exit status for `err`: 2 for a user error (`ConfigError`), 128 + n for a run
    interrupted by signal n before training (`Interrupted`), 1 for anything else."""
    if isinstance(err, ConfigError):
        return 2
    return getattr(err, "exit_status", 1) if isinstance(err, Interrupted) else 1


# What gloo (and NCCL) say when the other end of a connection is gone: its process died.
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|"
                        r"remote process exited")
_ADDRESS = re.compile(r"\[([^\]]+)\]:(\d+)")


def lost_peer(err: BaseException) -> str | None:
    """"ADDRESS (reason)" when `err`, or an error it wraps (its cause or context, a DCP
    `CheckpointException`'s per-rank failures), is a collective's connection to a peer process
    that is gone; else None."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found = _PEER_GONE.search(str(e))
        if found:
            address = _ADDRESS.search(str(e))
            return f"{address.group(1)}:{address.group(2)} ({found.group(0)})" if address else found.group(0)
        pending += [e.__cause__, e.__context__, *(exc for exc, _ in getattr(e, "failures", {}).values())]
    return None


def abort_process_groups() -> None:
    """Abort the process groups of an NCCL job, without entering a collective: collectives
    blocked on them (this rank's own, when the watch thread calls it) fail at once instead of
    at the timeout. Every group is aborted at once, as torch orders it (`_torch_private.abort_process_groups`).

    Gloo jobs are left alone: gloo's abort fails no pending operation (here or on the peers,
    which fail when this process exits and its sockets close), and an aborted gloo group hangs
    the interpreter's exit. (An NCCL job's gloo groups, the checkpoint's and those beside NCCL
    under CPU offload, are aborted with the rest; should that hold up the exit, the watch's
    backstop ends the process.)
    """
    if dist.is_initialized() and device_backend("cuda") == "nccl":  # "nccl" or "cuda:nccl,cpu:gloo"
        private.abort_process_groups()


class FailureWatch:
    """This rank's side of the failure protocol (module docstring); one per process.

    Args:
        store: the rendezvous store (the default process group's). It is kept referenced: under
            env:// rendezvous rank 0's store object runs the server every rank talks to, which
            must outlive `destroy_process_group` until every rank has stopped its watch.
        rank, world_size: this process's rank in, and the size of, the default group.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int) -> None:
        self._rendezvous = store
        self._store = dist.PrefixStore(_PREFIX, store.clone())  # the main thread's connection
        self._watch_store = dist.PrefixStore(_PREFIX, store.clone())  # the watch thread's
        self.rank = rank
        self.world_size = world_size
        self._lock = threading.Lock()
        self._failure: Failure | None = None  # the failure this rank is leaving for
        self._backstop: threading.Timer | None = None
        self._report_deadline: float | None = None  # when a peer stops waiting for the report
        self._report_seen = threading.Event()  # the watch thread saw the failing rank's mark
        self._reported = threading.Event()  # the main thread has taken over the reporting
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="torchmoe-failure-watch", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls) -> FailureWatch:
        """Watch for failures of the default process group's ranks (call after init_process_group)."""
        return cls(private.default_store(), rank=dist.get_rank(),
                   world_size=dist.get_world_size())

    @property
    def failure(self) -> Failure | None:
        """The failure this rank is leaving for, once known (its own or a peer's)."""
        with self._lock:
            return self._failure

    # ---- the main thread -------------------------------------------------------------------------

    def fail(self, err: BaseException) -> None:
        """End this rank's run on `err`, without any collective: publish it unless another rank
        failed first, abort the process groups and arm the exit backstop.

        Returns when `err` is the first failure (the caller re-raises it, and the CLI reports it
        with its exit status).

        Raises:
            PeerFailed: another rank failed first (`err` is then a consequence, e.g. this
                rank's collective failing, and is chained as its cause), or the store was lost.
        """
        self._reported.set()
        global _FAILED, _LEAVING
        _FAILED, _LEAVING = True, self
        # A collective whose peer process is gone is no error of this rank's: the peer died
        # without a word (it would have published its own error first), and every rank is told so.
        # A user error is this rank's own, whatever OS reason its text quotes ("Connection
        # refused" of a lighthouse that is gone).
        peer = None if isinstance(err, ConfigError) else lost_peer(err)
        mine = Failure(self.rank, 1, f"rank {self.rank} lost its connection to {peer}", LOST_PEER) if peer else \
            Failure(self.rank, exit_status(err), f"{type(err).__name__}: {err}")
        first = self.failure or self._claim(mine)
        self._learn(first, self._store)
        if first.rank == self.rank:  # every live peer (not the one that died) reads it before this rank leaves
            self._wait_for_acks(self.world_size - 1 - (first.kind == LOST_PEER))
        self._arm_backstop(first)  # after the acks: the CLI must still get to print the error
        if first.rank != self.rank or first.kind != ERROR:
            raise PeerFailed(first, self.rank) from err
        # An error the CLI does not catch is printed by the interpreter's hook, on the way out.
        sys.excepthook = _then_mark_reported(sys.excepthook, self)

    def settle_report(self) -> None:
        """Before this process exits for a failure. The failing rank marks its error printed and
        waits (up to REPORT_WAIT_S) until every peer's watch thread has seen the mark, so that
        no peer touches the store after its exit (rank 0 without torchrun hosts it). A peer
        waits (up to REPORT_WAIT_S from its first call) until its watch thread has seen it."""
        failure = self.failure
        if failure is None or failure.kind != ERROR:
            return  # LOST_PEER and STORE: every rank prints the same line, nobody waits
        if failure.rank != self.rank:
            with self._lock:
                if self._report_deadline is None:
                    self._report_deadline = time.monotonic() + REPORT_WAIT_S
                deadline = self._report_deadline
            self._report_seen.wait(max(0.0, deadline - time.monotonic()))
            return
        deadline = time.monotonic() + REPORT_WAIT_S
        try:
            self._store.set(_REPORTED, "1")
            while self._store.add(_SEEN, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        except dist.DistError:
            pass  # the store's host left: nobody can read the mark

    def stop(self) -> None:
        """This rank finished normally: stop watching, then let rank 0 leave last (bounded), so
        that no rank still polls a store whose host has exited."""
        self._stopped.set()
        self._thread.join()
        try:
            left = self._store.add(_STOPPED, 1)
            deadline = time.monotonic() + EXIT_GRACE_S
            while self.rank == 0 and left < self.world_size and time.monotonic() < deadline:
                time.sleep(0.02)
                left = self._store.add(_STOPPED, 0)
        except dist.DistError:
            pass  # the store is gone: nobody is left to wait for

    def _claim(self, mine: Failure) -> Failure:
        """Publish `mine` unless a record exists; returns the record now in the store."""
        try:
            return Failure.decode(self._store.compare_set(_RECORD, "", mine.encode()))
        except dist.DistError as err:
            return _store_lost(err)  # its host died, which is why this rank's collective failed

    def _wait_for_acks(self, peers: int) -> None:
        """Until `peers` ranks have acked this rank's record, or ACK_WAIT_S."""
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            while self._store.add(_ACKS, 0) < peers and time.monotonic() < deadline:
                time.sleep(0.02)
        except dist.DistError:
            pass  # the store's host left: whoever has not read the record fails on its own

    # ---- both threads ----------------------------------------------------------------------------

    def _learn(self, failure: Failure, store: dist.Store) -> None:
        """First sight of `failure` on this rank: ack a peer's record (through `store`, the
        calling thread's connection) and abort the process groups. Later calls do nothing."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            if failure.rank not in (None, self.rank):
                try:
                    store.add(_ACKS, 1)
                except dist.DistError:
                    pass  # the failing rank exited already (it waited for us as long as it could)
            abort_process_groups()

    def _arm_backstop(self, failure: Failure) -> None:
        """Exit with `failure`'s status EXIT_GRACE_S from now unless the process is gone by then
        (only the first call arms it)."""
        with self._lock:
            if self._backstop is not None:
                return
            self._backstop = threading.Timer(EXIT_GRACE_S, self._exit_now, args=(failure,))
        self._backstop.daemon = True
        self._backstop.start()

    def _exit_now(self, failure: Failure) -> None:
        """The backstop: the process is still alive EXIT_GRACE_S after learning of `failure`."""
        if not self._reported.is_set():  # the main thread is stuck: say why this rank stops
            stopped = PeerFailed(failure, self.rank)
            print(stopped, file=sys.stderr)
            tell_launcher(stopped.with_cause())
        self.settle_report()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(failure.status)

    # ---- the watch thread ------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                if not self._watch_store.check([_RECORD]):
                    continue
                failure = Failure.decode(self._watch_store.get(_RECORD))
            except dist.DistError as err:
                if self._stopped.is_set():
                    return
                failure = _store_lost(err)
            if failure.rank == self.rank:  # this rank's own failure is handled by fail()
                return
            self._learn(failure, self._watch_store)
            if failure.kind == STORE and not self._reported.is_set():
                # Without a store no failure can be agreed on, and training may well go on (gloo
                # collectives among the live ranks still work): leave now, not after the grace.
                self._exit_now(failure)
            self._arm_backstop(failure)  # the main thread may be stuck in a collective
            if failure.kind == ERROR:
                self._await_report()
            return

    def _await_report(self) -> None:
        """Wait (a blocking store wait, up to REPORT_WAIT_S past the backstop) for the failing
        rank's mark that its error is printed, then say so to it and to the main thread."""
        try:
            self._watch_store.wait([_REPORTED], timedelta(seconds=EXIT_GRACE_S + REPORT_WAIT_S))
            self._watch_store.add(_SEEN, 1)
        except dist.DistError:
            pass  # not marked in time, or the failing rank is gone: nothing more to wait for
        self._report_seen.set()


def _then_mark_reported(hook, watch: FailureWatch):
    """`hook` (an excepthook), then `watch.settle_report()`: the failing rank's traceback is printed."""
    def report(*exc_info) -> None:
        hook(*exc_info)
        sys.stderr.flush()
        watch.settle_report()
    return report


def _store_lost(err: dist.DistError) -> Failure:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return Failure(None, 1, f"lost the rendezvous store at {where} ({type(err).__name__}): the process hosting it "
                            "(rank 0 without torchrun, else torchrun's agent) is gone", STORE)
