"""The `torchmoe` command line (also `python -m torchmoe`, and `torchrun ... -m torchmoe`): the
subcommands by name, each in its own module of `torchmoe.commands`, imported when it runs.

    python -m torchmoe train --config configs/debug_model.toml --training.steps 20
    python -m torchmoe train --config configs/llama4_16e.toml --dry-run --world-size 64

Exit status (DESIGN §3): 0 success, 2 a user error, printed as one message naming the key, the
value and the fix, without a traceback; 1 when training diverged (a non-finite loss or gradient
norm), also one message, naming the step. Anything else is a bug and keeps its traceback. When
one rank of several fails, it reports its error as above and every other rank prints one line
("stopped because rank N failed") and exits with the same status.
"""

from __future__ import annotations

import difflib
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchmoe.commands.exits import RankSpecificError, leave_if_failed
from torchmoe.commands.exits import report_error as _report
from torchmoe.config import ConfigError
from torchmoe.config.launch_env import tell_launcher
from torchmoe.distributed.interruption import Interrupted, interrupt_on_signals
from torchmoe.distributed.interruption import report as report_interruption


@dataclass(frozen=True)
class Subcommand:
    """One `torchmoe <name>` subcommand: a one-line summary and a handler returning the exit code."""

    summary: str
    run: Callable[[list[str]], int]


# Each handler imports its command when it runs: most pull in torch and the model, which a
# config error or --help should not wait for.
def _train(argv: list[str]) -> int:
    from torchmoe.commands.train import train_main

    return train_main(argv)


def _plan(argv: list[str]) -> int:
    from torchmoe.commands.plan import plan_main

    return plan_main(argv)


def _generate(argv: list[str]) -> int:
    from torchmoe.commands.generate import generate_main

    return generate_main(argv)


def _eval(argv: list[str]) -> int:
    from torchmoe.commands.eval import eval_main

    return eval_main(argv)


def _convert(argv: list[str]) -> int:
    from torchmoe.commands.convert import convert_main

    return convert_main(argv)


def _report_figure(argv: list[str]) -> int:
    from torchmoe.commands.report import report_main

    return report_main(argv)


def _prepare_data(argv: list[str]) -> int:
    from torchmoe.commands.prepare_data import prepare_main

    return prepare_main(argv)


def _lighthouse(argv: list[str]) -> int:
    from torchmoe.commands.lighthouse import lighthouse_main

    return lighthouse_main(argv)


SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("Train (or --dry-run plan) a mixture-of-experts model from a TOML job file.", _train),
    "plan": Subcommand("Choose the fastest layout that fits on N GPUs (or --calibrate this machine).", _plan),
    "generate": Subcommand("Sample text from a checkpoint (greedy, or temperature and top-p) with a KV cache.",
                           _generate),
    "eval": Subcommand("The loss and perplexity of a checkpoint on the validation or training data, any layout.",
                       _eval),
    "convert": Subcommand("Convert weights: hf-to-dcp (Hugging Face -> DCP) or dcp-to-hf.", _convert),
    "report": Subcommand("Draw a run's curves, expert load and planner facts: report.png or an HTML page.",
                         _report_figure),
    "prepare-data": Subcommand("Tokenize a corpus once into token shards that training reads by memory map.",
                               _prepare_data),
    "lighthouse": Subcommand("Run torchft's lighthouse: the quorums of fault-tolerant replica groups.", _lighthouse),
}


def _overview() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: torchmoe {{{','.join(SUBCOMMANDS)}}} [OPTIONS]  (or --version)", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    lines += ["", "`torchmoe SUBCOMMAND --help` lists its options (train, generate, eval: every config key with its "
              "default); docs/cli.md has them all."]
    return "\n".join(lines)


def _versions() -> str:
    """`torchmoe X (torch Y, Python Z)`: read from the installed packages' metadata, so it costs no
    torch import and names the torch build a bug report needs."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"torchmoe {installed('torchmoe')} (torch {installed('torch')}, Python {platform.python_version()})"


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in ("-V", "--version"):
        print(_versions())
        return 0
    if argv and argv[0] in ("-h", "--help"):
        print(_overview())
        return 0
    if not argv or argv[0].startswith("-"):
        raise ConfigError("subcommand", argv[0] if argv else "", "missing subcommand",
                          f"run e.g. `torchmoe train --config configs/debug_model.toml`\n{_overview()}")
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        fix = f"did you mean `torchmoe {close[0]}`?" if close else f"available: {', '.join(SUBCOMMANDS)}"
        raise ConfigError("subcommand", name, "unknown subcommand", fix)
    return SUBCOMMANDS[name].run(rest)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `torchmoe` command line; returns the exit status.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    rank = os.environ.get("RANK")
    try:
        # First: a SIGTERM or Ctrl-C during the imports is one line too, not a death by signal.
        with interrupt_on_signals():
            return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except Interrupted as stop:
        tell_launcher(report_interruption(stop))
        leave_if_failed(stop.exit_status)
        return stop.exit_status
    except ConfigError as err:
        # Config errors are the same on every rank: one message from rank 0 is enough (a RANK
        # refused is no rank's: the process it is wrong in says it). Every rank's entry in
        # torchrun's summary holds it: whichever rank exits first is the one it shows last.
        if rank in (None, "0") or err.key == "RANK":
            _report(err, rank=None)
        tell_launcher(f"error: {err}")
        leave_if_failed(2)
        return 2
    except RankSpecificError as wrapped:
        tell_launcher(_report(wrapped.err, rank=rank))
        leave_if_failed(2)
        return 2
    except BrokenPipeError:
        # `torchmoe train --help | head`: the reader left. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again, as the Python docs recommend.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run() -> None:
    """The `torchmoe` program (console script and ``python -m torchmoe``): `main`, then exit with
    its status; after a multi-rank failure without running process-group destructors (see
    `torchmoe.distributed.failure.leave`). Only such a run imports that module: the CLI stays
    quick to answer without torch."""
    entry = main
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # Under torchrun: an unexpected error's message and traceback go to the file torchrun
        # reads, so its failure summary names them (without it: "error_file: <N/A>", and the
        # traceback is somewhere above, among every rank's output).
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(main)
    status = entry()
    failure = sys.modules.get("torchmoe.distributed.failure")
    if failure is not None:
        failure.leave(status)
    sys.exit(status)
