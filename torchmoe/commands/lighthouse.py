"""`torchmoe lighthouse`: torchft's lighthouse, which forms each step's quorum of replica groups.

    torchmoe lighthouse --min-replicas 1 --bind "[::]:29510"
    # then, for every replica group's launch:
    export TORCHFT_LIGHTHOUSE=http://HOST:29510

One per job, on any host every group can reach (it holds no model state: groups send it a
heartbeat and ask it for quorums). ``--min-replicas`` is the fewest groups a quorum may have:
with fault_tolerance.min_replica_size N, start it with N so that survivors wait for a quorum
instead of computing steps that cannot commit. It runs until SIGTERM or Ctrl-C (exit 0).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torchmoe.commands.arguments import ArgumentParser, parse_args
from torchmoe.config.errors import ConfigError
from torchmoe.config.numbers import parse_int
from torchmoe.distributed.fault_tolerance import LIGHTHOUSE_ENV, import_torchft
from torchmoe.distributed.interruption import Interrupted

# What each number may be: beyond these a lighthouse serves nothing useful (a quorum that waits
# for more groups than any job has, a tick of a day between quorums), and beyond 2**64 torchft's
# core cannot even take it (an OverflowError it reported as a bind failure).
BOUNDS = {
    "min_replicas": (1, 100_000, "replica groups"),
    "join_timeout_ms": (1, 86_400_000, "ms (a day)"),
    "heartbeat_timeout_ms": (1, 86_400_000, "ms (a day)"),
    "quorum_tick_ms": (1, 60_000, "ms (a minute)"),
}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchmoe lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-replicas", default="1",
                        help="fewest replica groups in a quorum (fault_tolerance.min_replica_size); default 1")
    parser.add_argument("--bind", default="[::]:29510",
                        help='HOST:PORT to listen on, PORT 0 for any free one (default "[::]:29510")')
    parser.add_argument("--join-timeout-ms", default="60000",
                        help="how long a quorum waits for more groups to join once it could form (default 60000)")
    parser.add_argument("--heartbeat-timeout-ms", default="5000",
                        help="a group silent this long is out of the next quorum (default 5000)")
    parser.add_argument("--quorum-tick-ms", default="100", help="how often quorums are formed (default 100)")
    return parser


def _check_bind(bind: str) -> None:
    """`bind` is HOST:PORT with a port a socket can have (torchft's own error for "[::]" or a
    port of 99999 says only "invalid port value")."""
    host, sep, port = bind.rpartition(":")
    fix = 'pass HOST:PORT, e.g. --bind "[::]:29510" (every interface) or --bind "0.0.0.0:0" (any free port)'
    if not sep or not host:
        raise ConfigError("--bind", bind, "is not HOST:PORT (an IPv6 host goes in brackets: [::1]:29510)", fix)
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError("--bind", bind, f"has no port a socket can have ({port!r}: 0 .. 65535)", fix)


def lighthouse_main(argv: Sequence[str]) -> int:
    """`torchmoe lighthouse ARGS`; returns the exit status (ConfigError propagates: exit 2)."""
    opts = parse_args(_parser(), argv)
    if opts is None:
        return 0
    for key, (low, high, unit) in BOUNDS.items():
        flag = "--" + key.replace("_", "-")
        setattr(opts, key, parse_int(flag, getattr(opts, key), low=low, high=high,
                                     fix=f"pass {low} .. {high:,} {unit}; the default is {_parser().get_default(key)}"))
    _check_bind(opts.bind)
    import_torchft()
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(bind=opts.bind, min_replicas=opts.min_replicas,
                                  join_timeout_ms=opts.join_timeout_ms, quorum_tick_ms=opts.quorum_tick_ms,
                                  heartbeat_timeout_ms=opts.heartbeat_timeout_ms)
    except RuntimeError as err:  # the Rust server's bind error (address in use, no such host)
        raise ConfigError("--bind", opts.bind, f"the lighthouse cannot listen there ({err})",
                          'pass a free HOST:PORT, e.g. --bind "[::]:29511"') from None
    port = server.address().rsplit(":", 1)[1]
    try:  # from the line on: a signal the moment it is read stops the lighthouse as one after it
        print(f"lighthouse listening on {server.address()} (min_replicas {opts.min_replicas}); for every "
              f"replica group: export {LIGHTHOUSE_ENV}=http://HOST:{port}", flush=True)
        _serve_until_a_signal()
    except Interrupted:  # SIGTERM / Ctrl-C: the way a lighthouse is meant to stop
        pass
    finally:
        server.shutdown()
    return 0


def _serve_until_a_signal() -> None:
    """Wait until a signal's handler raises (never returns otherwise).

    Never in one untimed wait: the kernel may hand a SIGTERM to any thread that does not block
    it, here one of the Rust server's, and CPython then only marks it pending for the main thread,
    which runs the handler when it next executes bytecode. A main thread blocked on a lock for
    good slept through it (a lighthouse ignored about one SIGTERM or Ctrl-C in ten); waking every
    `_WAKE_S` runs a pending handler within that."""
    while True:
        time.sleep(_WAKE_S)


_WAKE_S = 0.2
