"""What a rank says when a run ends for a failure, by kind, and how a collective's error is read
as a peer gone (`torchmoe.distributed.failure`); signals before training (`torchmoe.distributed.interruption`).

    python -m pytest -q tests/unit/test_failure_messages.py
"""

from __future__ import annotations

import signal

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from torchmoe.config.errors import ConfigError
from torchmoe.distributed.failure import LOST_PEER, STORE, Failure, PeerFailed, exit_status, lost_peer
from torchmoe.distributed.interruption import Interrupted

GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:41234: Connection "
              "reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError(GLOO_RESET), "10.0.0.7:41234 (Connection reset by peer)"),
    (RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:5000"), "127.0.0.1:5000 (Connection closed by peer)"),
    (RuntimeError("Write error [::1]:99: Broken pipe"), "::1:99 (Broken pipe)"),
    (RuntimeError("NCCL error: remote process exited or there was a network error"), "remote process exited"),
    (RuntimeError("CUDA out of memory"), None),  # this rank's own error
    (ValueError("expected 3 dims"), None),
    (RuntimeError("[pair.cc:530] Timed out waiting 600000ms for recv operation to complete"), None),  # a timeout
])
def test_a_collective_error_is_read_as_a_peer_gone(error, expected):
    assert lost_peer(error) == expected


def test_a_peer_gone_is_found_where_dcp_and_chaining_wrap_it():
    """DCP raises a CheckpointException holding each rank's failure; the trainer re-raises with
    the collective error as cause or context."""
    wrapped = CheckpointException("save failed", {1: (RuntimeError(GLOO_RESET), None)})
    assert lost_peer(wrapped) == "10.0.0.7:41234 (Connection reset by peer)"
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as cause:
            raise KeyError("during the save") from cause
    except KeyError as err:
        assert lost_peer(err) == "10.0.0.7:41234 (Connection reset by peer)"


@pytest.mark.parametrize(("failure", "line"), [
    (Failure(1, 2, "ConfigError: ..."), "[rank 0] stopped because rank 1 failed (its error is reported by rank 1)"),
    (Failure(1, 1, "rank 1 lost its connection to 10.0.0.7:41234 (Connection reset by peer)", LOST_PEER),
     "[rank 0] stopped: a rank died without reporting an error (killed, out of memory, or its node failed; the "
     "launcher's log names it): rank 1 lost its connection to 10.0.0.7:41234 (Connection reset by peer)"),
    (Failure(None, 1, "lost the rendezvous store at h:1 (DistNetworkError): ...", STORE),
     "[rank 0] stopped: lost the rendezvous store at h:1 (DistNetworkError): ..."),
])
def test_each_kind_of_failure_is_one_line(failure, line):
    assert str(PeerFailed(failure, rank=0)) == line
    assert Failure.decode(failure.encode().encode()) == failure  # as the store carries it


@pytest.mark.parametrize(("error", "status"), [
    (ConfigError("k", 1, "bad", "fix"), 2), (RuntimeError("bug"), 1),
    (Interrupted(signal.SIGTERM), 143), (Interrupted(signal.SIGINT), 130),
])
def test_exit_status_by_kind_of_error(error, status):
    assert exit_status(error) == status


def test_a_signal_after_a_failure_does_not_replace_it():
    """Inside the CLI's handlers a SIGTERM raises `Interrupted`, until the rank is leaving for a
    failure (torchrun's agent then stops the survivors of a dead rank: that is no new stop); the
    next `interrupt_on_signals` raises again (a job run before in this process does not leak)."""
    import os

    from torchmoe.distributed.interruption import interrupt_on_signals, leaving_for_failure

    with pytest.raises(Interrupted), interrupt_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
    with interrupt_on_signals():  # python -m torchmoe's handlers around the CLI's (cli.main)
        with interrupt_on_signals():
            leaving_for_failure()
            os.kill(os.getpid(), signal.SIGTERM)  # nothing raised: the failure's report stays
        os.kill(os.getpid(), signal.SIGTERM)  # nor while the CLI prints it, outside the inner handlers
    leaving_for_failure()  # a Trainer.fit that failed in this process, outside the CLI
    with pytest.raises(Interrupted), interrupt_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


def test_every_user_error_crosses_a_broadcast_whole() -> None:
    """Rank 0 finds some errors for every rank (a load_step without its checkpoint, a refused
    lock) and broadcasts them as objects: each kind must unpickle as itself, with its parts."""
    import importlib
    import pickle

    for module in ("torchmoe.weights.weight_files", "torchmoe.data.errors"):  # the subclasses' homes
        importlib.import_module(module)
    kinds = _subclasses(ConfigError)
    assert len(kinds) >= 4, kinds
    for kind in kinds:
        err = kind("checkpoint.load_step", [9], "no complete checkpoint step-9", "name one of those steps")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is kind and str(back) == str(err), kind
        assert (back.key, back.value, back.problem, back.fix) == (err.key, err.value, err.problem, err.fix), kind
