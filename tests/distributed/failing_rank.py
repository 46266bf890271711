"""A torchmoe rank that fails (or is slow) on purpose, for `test_failures.py`.

    python tests/distributed/failing_rank.py CASE OUT_DIR -- train ARGS...

Run under torchrun, or as one of several processes given RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (as SLURM's srun starts them). On rank `FAIL_RANK` (default 1) it replaces one
function before running the CLI, so that production code needs no test hooks; the other ranks
run unchanged:

- `load`: `Trainer.load_initial_state` raises a `ConfigError` (a Hugging Face shard that only
  this rank misses) while the others load, and wait for it in a collective.
- `async_save`: this rank's first background checkpoint write fails (OSError ENOSPC) in DCP's
  file writer, as a full disk would; DCP reports it to every rank's save (not a failure that
  ends the run: the ranks agree to skip that checkpoint).
- `data`: the data loader raises `DataConfigError` for step 3 (a corrupt shard only this rank
  reads) while the others train step 3.
- `agreed`: every rank's `Trainer.load_initial_state` raises the same `ConfigError` (an error
  every rank finds, as a refused run lock; with `AGREED_ERROR=unexpected` the same
  `RuntimeError`), rank `FAIL_RANK` first and the others a second later; rank `FAIL_RANK` takes
  `SLOW_REPORT_S` seconds to print it (a loaded node), so the others learn of its failure from
  the record and could exit before it prints.
- `none`: nothing (for a rank killed from outside).
- `hang_save`: this rank's first checkpoint write writes `OUT_DIR/blocked` and hangs (for a test
  that kills the rank in the middle of a save).
- `slow`: not a failure but a slow peer: each of this rank's checkpoint writes (DCP's file writer)
  and its first validation (what compiling the forward without gradients, or indexing a new
  corpus, costs a rank) first sleep `SLOW_WRITE_S` seconds, and its `destroy_process_group` (the
  teardown after a good run) `SLOW_TEARDOWN_S` seconds.

Before raising it writes `OUT_DIR/failed_at` (its `time.time()`). With `FAIL_ON_GO=1` it first
writes `OUT_DIR/blocked` and waits for `OUT_DIR/go`, so that the test can act meanwhile.
`WATCH_POLL_S` sets every rank's failure-watch poll interval (a slow store on a big cluster).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path


def _about_to_fail(out: Path) -> None:
    if os.environ.get("FAIL_ON_GO") == "1":
        (out / "blocked").touch()
        while not (out / "go").exists():
            time.sleep(0.05)
    (out / "failed_at").write_text(repr(time.time()))


def _break_load(out: Path) -> None:
    from torchmoe.config.errors import ConfigError
    from torchmoe.training.loop import Trainer

    def load_initial_state(self) -> None:
        _about_to_fail(out)
        raise ConfigError("checkpoint.initial_load_path", self.cfg.checkpoint.initial_load_path,
                          "model-00002-of-00002.safetensors is missing", "copy the whole Hugging Face folder")

    Trainer.load_initial_state = load_initial_state


def _break_async_save(out: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data
    calls = []

    def failing_write_data(self, plan, planner):
        calls.append(1)
        if len(calls) == 1:
            _about_to_fail(out)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing_write_data


def _break_data(out: Path) -> None:
    from torchmoe.data.dataloader import DataLoader
    from torchmoe.data.dataset import DataConfigError

    next_batch = DataLoader.next_batch

    def failing_next_batch(self):
        if self.state_dict()["step"] == 2:  # the batch of step 3
            _about_to_fail(out)
            raise DataConfigError("training.dataset_path", "shard-00007.jsonl", "shard-00007.jsonl:12 is not JSON",
                                  "repair or remove that file")
        return next_batch(self)

    DataLoader.next_batch = failing_next_batch


def _agreed_error(out: Path) -> None:
    from torchmoe.commands import cli
    from torchmoe.config.errors import ConfigError
    from torchmoe.training.loop import Trainer

    first = os.environ["RANK"] == os.environ.get("FAIL_RANK", "1")

    def load_initial_state(self) -> None:
        if first:
            _about_to_fail(out)
        else:
            time.sleep(1.0)  # after the first rank's claim
        if os.environ.get("AGREED_ERROR") == "unexpected":
            raise RuntimeError("an unexpected error every rank meets")
        raise ConfigError("job.dump_folder", self.cfg.job.dump_folder, "is held by another run (pid 4242)",
                          "wait for it to finish")

    def slowly(print_error):
        def slow(*args, **kwargs):
            time.sleep(float(os.environ["SLOW_REPORT_S"]))
            return print_error(*args, **kwargs)
        return slow

    Trainer.load_initial_state = load_initial_state
    if first:  # the CLI prints a user error, the interpreter's hook an unexpected one's traceback
        cli._report, sys.excepthook = slowly(cli._report), slowly(sys.excepthook)


def _hang_in_save(out: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    def hanging_write_data(self, plan, planner):
        (out / "blocked").touch()
        while True:
            time.sleep(1)

    FileSystemWriter.write_data = hanging_write_data


def _slow_down(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from torchmoe.training.loop import Trainer

    write_data, destroy, validate = FileSystemWriter.write_data, dist.destroy_process_group, Trainer.validate
    validated = []

    def slow_write_data(self, plan, planner):
        time.sleep(float(os.environ["SLOW_WRITE_S"]))
        return write_data(self, plan, planner)

    def slow_first_validation(self):
        if not validated:
            validated.append(time.sleep(float(os.environ["SLOW_WRITE_S"])))
        return validate(self)

    def slow_destroy(*args, **kwargs):
        time.sleep(float(os.environ["SLOW_TEARDOWN_S"]))
        return destroy(*args, **kwargs)

    FileSystemWriter.write_data = slow_write_data
    dist.destroy_process_group = slow_destroy
    Trainer.validate = slow_first_validation


BREAK = {"load": _break_load, "agreed": _agreed_error, "async_save": _break_async_save, "data": _break_data, "hang_save": _hang_in_save,
         "slow": _slow_down, "none": lambda out: None}

if __name__ == "__main__":
    case, out_dir, sep, *cli_args = sys.argv[1:]
    assert sep == "--", sys.argv
    if "WATCH_POLL_S" in os.environ:
        import torchmoe.distributed.failure as failure

        failure.POLL_S = float(os.environ["WATCH_POLL_S"])
    if os.environ["RANK"] == os.environ.get("FAIL_RANK", "1") or case == "agreed":
        BREAK[case](Path(out_dir))

    from torchmoe.commands.cli import main

    sys.exit(main(cli_args))
