"""The training commands' entry points: `train` (`torchmoe train`) and `evaluate` (`torchmoe eval`),
each a `Trainer` joined to the launched world and watched for failed peers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torchmoe.config.files.paths import job_paths, user_path_faults
from torchmoe.config.job_config import JobConfig
from torchmoe.distributed.failure import FailureWatch, PeerFailed
from torchmoe.distributed.interruption import leaving_for_failure
from torchmoe.distributed.launcher import watch_launcher
from torchmoe.preflight import train_device
from torchmoe.training.loop import Trainer
from torchmoe.training.validation import ValidationLoss
from torchmoe.training.world import init_distributed
from torchmoe.weights.divergence import TrainingDiverged

__all__ = ["TrainingDiverged", "evaluate", "train"]  # `TrainingDiverged`: what `train` raises, for the CLI

_T = TypeVar("_T")


def train(cfg: JobConfig) -> None:
    """Run the job `cfg` describes (the `torchmoe train` command).

    With several ranks, a rank that fails leaves alone: it enters no further collective, and the
    failure watch (`torchmoe.distributed.failure`) ends every other rank within seconds.

    Raises:
        ConfigError: a user error; also whatever the OS refuses about a file or folder the job
            reads or writes (`config.files.paths.user_path_faults`: turned into one before the failure
            watch takes this rank's exit status from it).
        TrainingDiverged: the loss, gradients or state stopped being finite (on every rank).
        PeerFailed: on the ranks that stopped because another rank failed.
    """
    def body(trainer: Trainer) -> None:
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.create_seed_checkpoint()
        else:
            trainer.load_initial_state()
            trainer.fit()

    _with_trainer(cfg, body)


def evaluate(cfg: JobConfig, *, index_cache: Path | None = None, lora_step: Path | None = None) -> ValidationLoss:
    """The mean token loss over `cfg`'s validation batches (`Trainer.validate`) of the weights its
    run starts from (`checkpoint.initial_load_path`), or with `lora_step` of a LoRA run's
    checkpoint over that base (`Trainer.load_trained`), in its layout, without training: the
    `torchmoe eval` command; the data's indexes kept in `index_cache` (`Trainer`). Failures and
    errors as `train`'s."""
    def body(trainer: Trainer) -> ValidationLoss:
        if lora_step is not None:
            trainer.load_trained(lora_step)
        else:
            trainer.load_initial_state()
        return trainer.validate()

    return _with_trainer(cfg, body, index_cache=index_cache)


def _with_trainer(cfg: JobConfig, body: Callable[[Trainer], _T], *, index_cache: Path | None = None) -> _T:
    """`body(trainer)` for the job's Trainer (`index_cache` as its), joined to the launched world,
    watched for failed peers, its folders released whatever happens (`train`)."""
    paths = job_paths(cfg)
    with user_path_faults(paths):  # the comm traces folder is created here
        world_size = init_distributed(train_device(cfg.training.device), cfg.comm, cfg.parallelism,
                                      Path(cfg.job.dump_folder))
    watch = FailureWatch.start() if world_size > 1 else None
    watch_launcher()  # a torchrun worker whose launcher is killed stops within a second
    trainer: Trainer | None = None
    try:
        with user_path_faults(paths):
            trainer = Trainer(cfg, failure_watch=watch, index_cache=index_cache)
            result = body(trainer)
    except TrainingDiverged as err:
        trainer.close(err)  # every rank diverged at the same step (the loss is global)
        raise
    except BaseException as err:
        leaving_for_failure()  # this rank leaves for `err`: a signal from here on is not another stop
        reason = err
        try:
            if watch is not None:
                watch.fail(err)  # raises PeerFailed when another rank failed first
        except PeerFailed as peer:
            reason = peer  # `err` chained as its cause
            raise
        finally:
            if trainer is not None:
                trainer.release(reason)  # this process leaves the run: its folders are free again
        raise
    trainer.close()
    return result
