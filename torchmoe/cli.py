"""The `torchmoe` command line (also `python -m torchmoe`, and `torchrun ... -m torchmoe`).

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
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from torchmoe.config import ConfigError, JobConfig, load_job_config, validate_sections
from torchmoe.config.folder_owners import refuse_held
from torchmoe.config.job_config import Parallelism
from torchmoe.config.launch_env import launch_int, tell_launcher
from torchmoe.config.loader import CONFIG_FLAGS, config_toml
from torchmoe.config.numbers import MAX_RANKS, parse_int
from torchmoe.config.paths import job_paths, replica_group_config, user_path_faults
from torchmoe.interruption import Interrupted, interrupt_on_signals
from torchmoe.interruption import report as report_interruption

if TYPE_CHECKING:
    from torchmoe.distributed.failure import PeerFailed

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


@dataclass(frozen=True)
class Subcommand:
    """One `torchmoe <name>` subcommand: a one-line summary and a handler returning the exit code."""

    summary: str
    run: Callable[[list[str]], int]


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


def _env_world_size() -> int | None:
    return launch_int("WORLD_SIZE", 1) if "WORLD_SIZE" in os.environ else None


def _degree_product(parallelism: Parallelism) -> int:
    """The world size the degrees describe, counting dp_shard = -1 as 1 (for the dry-run)."""
    degrees = (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree,
               parallelism.context_parallel_degree, parallelism.tensor_parallel_degree,
               parallelism.pipeline_parallel_degree)
    # Invalid degrees count as 1 here so that validation reports them by name.
    return math.prod(max(d, 1) for d in degrees)


def resolve_world_size(flag: int | None, dry_run: bool, parallelism: Parallelism) -> int:
    """World size for `train`: `--world-size`, else WORLD_SIZE, else (dry-run) the degrees' product.

    A real run always uses the launched world (WORLD_SIZE, or 1 without torchrun), so a
    `--world-size` that disagrees with it is an error rather than silently ignored.
    """
    env = _env_world_size()
    if dry_run:
        if flag is not None:
            return flag
        return env if env is not None else _degree_product(parallelism)
    launched = env if env is not None else 1
    if flag is not None and flag != launched:
        raise ConfigError("--world-size", flag, f"this run was launched with {launched} process(es) (WORLD_SIZE)",
                          "use --world-size only with --dry-run; launch a real run with torchrun --nproc-per-node N")
    return launched


class _RankSpecificError(Exception):
    """A ConfigError raised while running, which may differ between ranks, so every rank reports it."""

    def __init__(self, err: ConfigError) -> None:
        super().__init__(str(err))
        self.err = err


_FILE_FIX = ("pass a job file: --config configs/debug_model.toml is the tiny job (CPU, 21 s); configs/ holds the "
             "others (an empty .toml file trains the defaults)")


def _job_config(config_argv: list[str], prog: str, description: str, *,
                require_file: Callable[[JobConfig], str] | None = None, fix: str = _FILE_FIX,
                set_keys: set[str] | None = None) -> JobConfig | int:
    """The job file and overrides of `config_argv`, each section checked; an int when --help was
    printed (the exit status). Notes (torchtitan keys mapped) are printed once, by rank 0.

    Args:
        require_file: what the command would do with the defaults, when it needs a job file (a
            missing --config is then a `ConfigError`, with `fix`).
        set_keys: filled with the keys the file and the flags set.
    """
    notes: list[str] = []
    try:
        cfg = load_job_config(config_argv, prog=prog, description=description, notes=notes, set_keys=set_keys)
    except SystemExit as exit_:  # --help was printed
        return int(exit_.code or 0)
    if os.environ.get("RANK") in (None, "0"):  # the same on every rank: rank 0 says it once
        for note in notes:
            Console(stderr=True, soft_wrap=True, highlight=False).print(f"[yellow]warning:[/] {escape(note)}")
    validate_sections(cfg)  # answers a typo at once: what follows imports torch and the model
    if require_file is not None and not any(token.partition("=")[0] in CONFIG_FLAGS for token in config_argv):
        raise ConfigError("--config", "(not given)", f"without a job file torchmoe would {require_file(cfg)}", fix)
    return cfg


def _train(argv: list[str]) -> int:
    flags = _split_train_flags(argv)
    dry_run, config_argv = flags.dry_run, list(flags.config_argv)
    set_keys: set[str] = set()  # what the file and the flags set: the dry run's search keeps them
    cfg = _job_config(config_argv, "torchmoe train", TRAIN_DESCRIPTION, set_keys=set_keys,
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
    from torchmoe.components.folder_model import with_folder_model
    from torchmoe.preflight import validate_job_config

    cfg = with_folder_model(cfg, set_keys=set_keys, absent_ok=dry_run)  # from a Hugging Face folder: its config.json
    validate_job_config(cfg, world_size, check_device=not dry_run)
    if cfg.job.print_config and os.environ.get("RANK") in (None, "0"):
        print(f"# the resolved job config\n{config_toml(cfg)}", flush=True)
    try:
        # Imported here: both pull in the whole training stack, which config errors and
        # --help should not wait for.
        if dry_run:
            from torchmoe.plan.dry_run import run_dry_run
            from torchmoe.planner import dry_run_advice
            from torchmoe.preflight import device_memory_gib

            run_dry_run(cfg, world_size, machine_device_gib=device_memory_gib())
            if os.environ.get("RANK") in (None, "0"):
                dry_run_advice(cfg, world_size, hardware=flags.hardware, gpus_per_node=flags.gpus_per_node,
                               set_keys=set_keys)
        else:
            from torchmoe.distributed.failure import PeerFailed
            from torchmoe.trainer import TrainingDiverged, train

            try:
                train(cfg)
            except PeerFailed as err:
                return _stopped_by_peer(err)
            except TrainingDiverged as err:
                # Not a bug but the run's outcome: one message (the loss is global, so every rank
                # stops at the same step and rank 0 speaks for all), exit 1 rather than the 2 of
                # a config error.
                if os.environ.get("RANK") in (None, "0"):
                    _report(err, rank=None)
                tell_launcher(f"error: {err}")
                return 1
    except ConfigError as err:
        raise _RankSpecificError(err) from err
    return 0


def _needs_a_run(cfg: JobConfig) -> str:
    return f"read the newest checkpoint of {cfg.job.dump_folder}/, which holds no run (no config.toml)"


_WEIGHTS_FIX = ("name the weights: --job.dump_folder of a run that saved checkpoints (its config.toml gives the "
                "model), --checkpoint FOLDER (a run's step-N, or a Hugging Face folder), or a job file: --config FILE")


def _checkpoint_job(config_argv: list[str], prog: str, description: str, *, checkpoint: str,
                    step: int | None) -> tuple[JobConfig, Path, bool] | int:
    """The job whose trained weights `generate` and `eval` read, the weights' folder and whether
    it is a Hugging Face one (`trained_weights`); an int when --help was printed.

    Without a job file the job is the run's own config.toml: that of the run whose step-N
    `checkpoint` is, else that of `--job.dump_folder`. The model is the weights' own wherever
    they tell it (`with_weights_model`: a run's config.toml, a Hugging Face config.json), but for
    the `--model.*` flags given; a job file that says otherwise gets one note. Under fault
    tolerance the dump folder is the replica group's own (`replica_group_config`).
    """
    from torchmoe.components.trained_weights import run_config_file, trained_weights, with_weights_model

    if not any(token.partition("=")[0] in CONFIG_FLAGS for token in config_argv):
        run = run_config_file(Path(checkpoint)) if checkpoint else None
        if run is None and not checkpoint and not any(token in ("-h", "--help") for token in config_argv):
            own = Path(load_job_config(config_argv, notes=[]).job.dump_folder) / "config.toml"
            run = own if own.is_file() else None
        if run is not None:
            config_argv = ["--config", str(run), *config_argv]
    cfg = _job_config(config_argv, prog, description, require_file=None if checkpoint else _needs_a_run,
                      fix=_WEIGHTS_FIX)
    if isinstance(cfg, int):
        return cfg
    cfg = replica_group_config(cfg)
    folder, in_hf = trained_weights(cfg, "--checkpoint", path=checkpoint, step=step)
    flags = {token[2:].partition("=")[0].replace("-", "_") for token in config_argv if token.startswith("--model.")}
    cfg, note = with_weights_model(cfg, folder, in_hf, flag_keys=flags)
    if note and os.environ.get("RANK") in (None, "0"):
        Console(stderr=True, soft_wrap=True, highlight=False).print(f"[yellow]note:[/] {escape(note)}")
    return cfg, folder, in_hf


def _generate(argv: list[str]) -> int:
    from torchmoe.generate import generate_main  # imported here: it pulls in torch and the model

    try:
        return generate_main(argv, _checkpoint_job)
    except ConfigError as err:
        raise _RankSpecificError(err) from err  # one process: its message is the message


def _eval(argv: list[str]) -> int:
    from torchmoe.evaluate import eval_main  # imported here: it pulls in the checkpoint code

    def check(cfg: JobConfig) -> None:
        from torchmoe.preflight import validate_job_config

        validate_job_config(cfg, resolve_world_size(None, False, cfg.parallelism), check_device=True)

    @contextmanager
    def running() -> Iterator[None]:
        try:
            yield
        except ConfigError as err:  # raised while running: it may differ between ranks
            raise _RankSpecificError(err) from err

    from torchmoe.distributed.failure import PeerFailed

    try:
        return eval_main(argv, _checkpoint_job, check, running)
    except PeerFailed as err:
        return _stopped_by_peer(err)


def _stopped_by_peer(err: PeerFailed) -> int:
    """Another rank failed and reports its error itself: one line here, its exit status; torchrun's
    summary of this rank names the failing rank's error too (`tell_launcher`)."""
    print(err, file=sys.stderr)
    tell_launcher(err.with_cause())
    _leave_if_failed(err.exit_status)
    return err.exit_status


def _convert(argv: list[str]) -> int:
    from torchmoe.convert import convert_main  # imported here: it pulls in the model stack

    return convert_main(argv)


def _report_figure(argv: list[str]) -> int:
    from torchmoe.report import report_main  # imported here: it pulls in torch and the planner

    return report_main(argv)


def _prepare_data(argv: list[str]) -> int:
    from torchmoe.data.prepare import prepare_main  # imported here: it pulls in numpy and torch

    return prepare_main(argv)


def _plan(argv: list[str]) -> int:
    from torchmoe.planner import plan_main  # imported here: the preflight it runs pulls in torch

    return plan_main(argv)


def _lighthouse(argv: list[str]) -> int:
    from torchmoe.lighthouse import lighthouse_main  # imported here: torchft pulls in torch

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


def _report(err: Exception, rank: str | None) -> str:
    """Print `err` as the one message of a user error; returns its text (without the colour)."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    # soft_wrap: never break the message (the arithmetic, paths) at the terminal width.
    Console(stderr=True, soft_wrap=True, highlight=False).print(
        f"{escape(prefix)}[bold red]error:[/] {escape(str(err))}")  # "[rank 1]" is not markup
    return f"{prefix}error: {err}"


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
        _leave_if_failed(stop.exit_status)
        return stop.exit_status
    except ConfigError as err:
        # Config errors are the same on every rank: one message from rank 0 is enough (a RANK
        # refused is no rank's: the process it is wrong in says it). Every rank's entry in
        # torchrun's summary holds it: whichever rank exits first is the one it shows last.
        if rank in (None, "0") or err.key == "RANK":
            _report(err, rank=None)
        tell_launcher(f"error: {err}")
        _leave_if_failed(2)
        return 2
    except _RankSpecificError as wrapped:
        tell_launcher(_report(wrapped.err, rank=rank))
        _leave_if_failed(2)
        return 2
    except BrokenPipeError:
        # `torchmoe train --help | head`: the reader left. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again, as the Python docs recommend.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _leave_if_failed(status: int) -> None:
    """A rank that left a multi-rank run for a failure exits here, from the handler that reported
    it, before its frames are freed (`torchmoe.distributed.failure.leave_if_failed`). Only such
    a run imports that module: the CLI stays quick to answer without torch."""
    failure = sys.modules.get("torchmoe.distributed.failure")
    if failure is not None:
        failure.leave_if_failed(status)


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
