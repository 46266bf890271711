"""Fixtures of every test tier.

Every test leaves the process as it found it (`_restore_global_state`): the suite passes in any
order (CI runs it shuffled, `pytest-randomly`) and whatever a test changes globally (torch's
compiler configs, the environment, threads, default dtype, deterministic mode, logging,
warning filters) never reaches the next one.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings

import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.fx.experimental._config

from tests import fork_server
from tests.cost_ledger import CostLedger
from tests.launch import cli_env
from torchmoe.metrics.run_logs import reset_logging

# The loggers torchmoe configures (`metrics.run_logs`) as the tests found them, before any
# test or fixture ran.
_RUN_LOGS = [logging.getLogger(name) for name in ("torchmoe", "torch.distributed", "torchft")]
_PRISTINE_LOGS = [(list(log.handlers), log.level, log.propagate) for log in _RUN_LOGS]
# torch's config modules that torchmoe (`_torch_private`) or a test may switch.
_CONFIGS = (torch._dynamo.config, torch._inductor.config, torch._functorch.config, torch.fx.experimental._config)


_TIERS = ("distributed", "integration")  # the unit tier after them


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker computes on one thread: the workers share the machine's cores, and a
    second OpenMP thread per worker oversubscribes them, its spinning taking the cycles the other
    worker needs (the unit tier on 2 workers and 2 cores: 132 s with torch's 2 threads per
    worker, 82 s with 1). The processes a test starts get one thread each too (`cli_env`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    config.pluginmanager.register(CostLedger(config), "cost_ledger")  # each module's CPU seconds, at the end
    # The hundreds of processes the tests start each import torchmoe: with bytecode cached
    # (`__pycache__`, git-ignored) the first compiles it and the rest read it, about 0.25 s of CPU
    # less per process than compiling every module again where the machine sets
    # PYTHONDONTWRITEBYTECODE (as this project's CI machine does).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    # `python -m torchmoe` runs of one process fork from a warm interpreter (`tests/fork_server.py`):
    # about 3 s of CPU less each. TORCHMOE_FORK_SERVER=0 starts every one as a subprocess.
    if os.environ.get("TORCHMOE_FORK_SERVER", "1") != "0":
        fork_server.enable(cli_env())


def pytest_unconfigure(config: pytest.Config) -> None:
    fork_server.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The distributed tier's modules first, then the integration tier's, then the unit tests,
    each tier in the order pytest-randomly chose (this runs after it): xdist hands the workers
    whole modules in this order, so the minutes-long world modules start early and the many
    short ones even out the end, instead of one worker finishing a world module alone."""
    def tier(item: pytest.Item) -> int:
        return next((i for i, mark in enumerate(_TIERS) if item.get_closest_marker(mark)), len(_TIERS))

    items.sort(key=tier)  # stable: the random order within a tier stays


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports and the collection made (torch's, transformers', the test modules'
    objects: over a million): no later collection walks them. A full collection of this process
    (every run's `GarbageCollection` starts with one, and a test runs dozens) then walks only what
    the tests made since, not seconds' worth of objects that live as long as the process."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_torchmoe_logging():
    """Tests and fixtures (module-scoped ones too) that build a Trainer or run `torchmoe.commands.cli.main`
    in this process get torchmoe's logging setup (its own stderr handler, no propagation to the
    root logger, a rank's log file); undo it after every test, or pytest's log capture would miss
    the `torchmoe` records of later tests (a unit test's `caplog` after a trainer test, in any
    order), and a Trainer a test did not release would keep writing its log file."""
    yield
    reset_logging()
    for log, (handlers, level, propagate) in zip(_RUN_LOGS, _PRISTINE_LOGS):
        log.handlers[:], log.level, log.propagate = handlers, level, propagate


@pytest.fixture(autouse=True)
def _restore_global_state():
    """What a test changes in the process, put back after it: torch's compiler configs (only
    the keys that changed, as their own setters would), the environment, intra-op threads, the
    default dtype, deterministic mode, the root and `torch` loggers' levels and handlers, the
    warning filters."""
    configs = [config.get_config_copy() for config in _CONFIGS]
    environ = dict(os.environ)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    loggers = [(log, list(log.handlers), log.level) for log in (logging.getLogger(), logging.getLogger("torch"))]
    filters = list(warnings.filters)
    yield
    for config, saved in zip(_CONFIGS, configs):
        now = config.get_config_copy()
        for key, value in saved.items():
            if now.get(key) != value:
                setattr(config, key, value)
    os.environ.clear()
    os.environ.update(environ)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        torch.use_deterministic_algorithms(deterministic)
    for log, handlers, level in loggers:
        log.handlers[:], log.level = handlers, level
    warnings.filters[:] = filters
