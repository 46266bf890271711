"""torchft's log records of a lost peer as one line, and its NCCL-only note kept off the console:
`quiet_lost_peers()`, once torchft is imported.

When a replica group dies, the survivors' collectives across groups fail with gloo's "Connection
closed by peer" (NCCL's own words on CUDA). torchft expects it: it logs the error with
``logger.exception`` (its manager's "got exception waiting for work", its process group's "got
exception in future -- skipping remaining"), fails the step's commit, and the quorum goes on
without the dead group. The traceback it prints, on every rank of every surviving group, says
nothing the next line does not ("step N was not committed ...; trying it again"), and looks like
the run failing. Such a record becomes one warning naming the peer (`failure.lost_peer`). So does
its sibling at a quorum change: a group killed while the survivors build the new quorum's process
group never writes its address to the store, and torchft logs "got exception in pg configure" with
the store's wait timeout (a key under ``/torchft/``) and its traceback; the step is not committed
either. A record of any other exception keeps its traceback, as does everything else torchft logs.

On a torch build without NCCL (CPU-only) torchft's manager warns at every quorum change, on every
rank, that it cannot reset NCCL's flight recorder: a group that no NCCL runs in has none to
reset. That warning goes to the log files (INFO), not to the console.
"""

from __future__ import annotations

import logging
import re

import torch.distributed

from torchmoe.distributed.failure import lost_peer

__all__ = ["quiet_lost_peers"]

_LIBRARY = "torchft"
# The loggers that report a failed collective with its traceback: the manager's is made when a
# Manager is (torchft.manager has no logger of its own at import), so it is named here.
_REPORTERS = ("torchft.manager", "torchft.process_group")


_NO_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder"
# torch's store error when a peer never set the key a new process group waits for (torchft's keys).
_NEVER_JOINED = re.compile(r"wait timeout after (\d+) ?ms, keys: (/torchft/\S+)")


def _gone(error: BaseException) -> str | None:
    """What a lost peer's `error` says, as the warning words it; None for any other error."""
    peer = lost_peer(error)
    if peer is not None:
        return f"the peer at {peer} is gone (its replica group failed)"
    never = _NEVER_JOINED.search(str(error)) if isinstance(error, torch.distributed.DistStoreError) else None
    if never is not None:
        return (f"a peer of the new quorum never joined it (no {never.group(2)} in the store after {never.group(1)} ms: "
                f"its replica group failed)")
    return None


class _LostPeerLine(logging.Filter):
    """Rewrites a record whose exception is a lost peer's into one warning line, traceback dropped
    (and the flight recorder's note of a build without NCCL to INFO)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _NO_FLIGHT_RECORDER in str(record.msg) and not torch.distributed.is_nccl_available():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return True
        error = record.exc_info[1] if record.exc_info else None
        gone = _gone(error) if error is not None else None
        if gone is None:
            return True
        # torchft formats the exception into its message: keep what comes before it.
        head = record.getMessage().split(str(error))[0].rstrip(" :")
        record.msg = f"{head}: {gone}; this step is not committed"
        record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def quiet_lost_peers() -> None:
    """Put the lost-peer filter on torchft's loggers: those that exist once it is imported, and
    the manager's (a logger's filters see only its own records). Idempotent."""
    names = {_LIBRARY, *_REPORTERS, *(name for name in logging.root.manager.loggerDict if name.startswith(f"{_LIBRARY}."))}
    for name in sorted(names):
        log = logging.getLogger(name)
        if not any(isinstance(f, _LostPeerLine) for f in log.filters):
            log.addFilter(_LostPeerLine())
