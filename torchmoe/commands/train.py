"""`torchmoe train`: check a job, then train it, or with `--dry-run` plan it without a process group.

    python -m torchmoe train --config configs/debug_model.toml --training.steps 20
    python -m torchmoe train --config configs/llama4_16e.toml --dry-run --world-size 64

A diverged run (`TrainingDiverged`) ends with exit status 1 and one message from rank 0; a rank
stopped by another's failure prints one line (`exits`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from torchmoe.commands.exits import RankSpecificError, report_error, stopped_by_peer
from torchmoe.commands.job import job_config, resolve_world_size
from torchmoe.config import ConfigError, JobConfig
from torchmoe.config.files.folder_owners import refuse_held
from torchmoe.config.files.paths import job_paths, replica_group_config, user_path_faults
from torchmoe.config.job_file import config_toml
from torchmoe.config.launch_env import tell_launcher
from torchmoe.config.numbers import MAX_RANKS, parse_int

TRAIN_DESCRIPTION = """\
Train a mixture-of-experts model (model.name: llama4, qwen3, deepseek_v3, gpt_oss) from a TOML job
file plus --section.key overrides (precedence: flag > TOML > default). Booleans take true/false;
lists take several values.

  --config FILE    TOML job file, e.g. configs/debug_model.toml; the defaults shown below are
                   the values in effect with it.
  --dry-run        Validate, then print the mesh, parallel plan, parameter and FLOP counts and
                   per-rank memory, without creating a process group or real tensors.
  --world-size N   Ranks to plan for with --dry-run (default: WORLD_SIZE if set, else the
                   product of the degrees with data_parallel_shard_degree -1 counted as 1).
  --hardware NAME  With --dry-run: the profile (h100, h200, b200, a100 or a JSON from
                   `torchmoe plan --calibrate`) the layout is compared with the planner's best
                   on (default h100 for GPU jobs; CPU jobs are compared only when given).
  --gpus-per-node N  With --dry-run: ranks per node for that comparison (default: the profile's).
"""


def _ranks(key: str, text: str, fix: str) -> int:
    return parse_int(key, text, low=1, high=MAX_RANKS, fix=fix)


@dataclass(frozen=True)
class TrainFlags:
    """`torchmoe train`'s own flags; `config_argv` is the rest, for the config loader."""

    dry_run: bool = False
    world_size: int | None = None
    hardware: str = ""
    gpus_per_node: int | None = None
    config_argv: tuple[str, ...] = ()


def _split_train_flags(argv: Sequence[str]) -> TrainFlags:
    """Take `--dry-run`, `--world-size N`, `--hardware NAME` and `--gpus-per-node N` out of argv."""
    found: dict[str, object] = {}
    rest: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        flag, eq, value = token.partition("=")
        flag = flag.replace("_", "-") if "." not in flag else flag
        if flag == "--dry-run":
            if eq:
                raise ConfigError("--dry-run", value, "takes no value", "pass --dry-run alone")
            found["dry_run"] = True
        elif flag in ("--world-size", "--gpus-per-node", "--hardware"):
            value = value if eq else next(tokens, "")
            if flag == "--hardware":
                found["hardware"] = value or "h100"
            else:
                found[flag[2:].replace("-", "_")] = _ranks(flag, value, f"pass a number of ranks, e.g. {flag} 8")
        else:
            rest.append(token)
    flags = TrainFlags(**found, config_argv=tuple(rest))
    if not flags.dry_run and (flags.hardware or flags.gpus_per_node):
        flag = "--hardware" if flags.hardware else "--gpus-per-node"
        raise ConfigError(flag, flags.hardware or flags.gpus_per_node, "only plans: it has no effect on training",
                          "pass it with --dry-run, or leave it out")
    return flags


def train_main(argv: list[str]) -> int:
    """`torchmoe train ARGV`: returns the exit status."""
    flags = _split_train_flags(argv)
    dry_run, config_argv = flags.dry_run, list(flags.config_argv)
    set_keys: set[str] = set()  # what the file and the flags set: the dry run's search keeps them
    cfg = job_config(config_argv, "torchmoe train", TRAIN_DESCRIPTION, set_keys=set_keys,
                      require_file=None if dry_run else
                      lambda cfg: f"train its defaults: {cfg.training.steps:,} steps of {cfg.model.flavor} into "
                                  f"{cfg.job.dump_folder}/")
    if isinstance(cfg, int):
        return cfg
    world_size = resolve_world_size(flags.world_size, dry_run, cfg.parallelism)
    cfg = replica_group_config(cfg)
    # Whatever the OS refuses about a path from here on is a user error naming the key that set it.
    with user_path_faults(job_paths(cfg)):
        return _run_train(cfg, world_size, flags, set_keys)


def _run_train(cfg: JobConfig, world_size: int, flags: TrainFlags, set_keys: set[str]) -> int:
    """Check `cfg` for `world_size` ranks, then plan it (`flags.dry_run`) or train it."""
    dry_run = flags.dry_run
    if dry_run:
        # Before the checks' write probes and any output: a bad profile, or a dump folder a live
        # run holds (its dry_run.json would land among that run's files).
        if flags.hardware:
            from torchmoe.plan.hardware import load_profile

            load_profile(flags.hardware)
        refuse_held("job.dump_folder", cfg.job.dump_folder, cfg.job.dump_folder)
    from torchmoe.preflight import validate_job_config
    from torchmoe.weight_sources.folder_model import with_folder_model

    cfg = with_folder_model(cfg, set_keys=set_keys, absent_ok=dry_run)  # from a Hugging Face folder: its config.json
    validate_job_config(cfg, world_size, check_device=not dry_run)
    if cfg.job.print_config and os.environ.get("RANK") in (None, "0"):
        print(f"# the resolved job config\n{config_toml(cfg)}", flush=True)
    try:
        # Imported here: both pull in the whole training stack, which config errors and
        # --help should not wait for.
        if dry_run:
            from torchmoe.commands.plan import dry_run_advice
            from torchmoe.plan.dry_run import run_dry_run
            from torchmoe.preflight import device_memory_gib

            run_dry_run(cfg, world_size, machine_device_gib=device_memory_gib())
            if os.environ.get("RANK") in (None, "0"):
                dry_run_advice(cfg, world_size, hardware=flags.hardware, gpus_per_node=flags.gpus_per_node,
                               set_keys=set_keys)
        else:
            from torchmoe.distributed.failure import PeerFailed
            from torchmoe.training.session import TrainingDiverged, train

            try:
                train(cfg)
            except PeerFailed as err:
                return stopped_by_peer(err)
            except TrainingDiverged as err:
                # Not a bug but the run's outcome: one message (the loss is global, so every rank
                # stops at the same step and rank 0 speaks for all), exit 1 rather than the 2 of
                # a config error.
                if os.environ.get("RANK") in (None, "0"):
                    report_error(err, rank=None)
                tell_launcher(f"error: {err}")
                return 1
    except ConfigError as err:
        raise RankSpecificError(err) from err
    return 0
