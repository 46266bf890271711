"""argparse for the subcommands that use it (`convert`, `report`): a usage error is a
`ConfigError`, reported like every other user error (one message, exit 2).

    parser = ArgumentParser(prog="torchmoe report", description="...")
    opts = parse_args(parser, argv)
    if opts is None:   # --help was printed
        return 0
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from torchmoe.config.errors import ConfigError

__all__ = ["ArgumentParser", "parse_args"]


class _UsageError(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises on usage errors (instead of printing and exiting)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)


def parse_args(parser: ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | None:
    """`parser.parse_args(argv)`; None when `--help` was printed.

    Raises:
        ConfigError: a usage error (keyed by the command, valued by its arguments), with the
            fix of running the failing (sub)command's `--help`.
    """
    try:
        return parser.parse_args(argv)
    except SystemExit:  # --help was printed; usage errors raise _UsageError instead
        return None
    except _UsageError as err:
        raise ConfigError(parser.prog, " ".join(argv), str(err), f"run `{err.prog} --help` for the usage") from None
