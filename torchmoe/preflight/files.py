"""Checks of the files a run reads and writes, before it trains: a file that can only fail
later (a checkpoint folder that is a file, a dump folder nobody may write, a dataset with too
little text for the batch rows) is refused at start, not after the steps it would lose."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.paths import (
    WRITE_FIX,
    path_faults,
    source_key,
    writable_file,
    writable_folder,
    written_folders,
)
from torchmoe.config.job_config import Checkpoint, Job, JobConfig, Model, Training
from torchmoe.config.launch_env import launch_int
from torchmoe.config.validate import check_dataset
from torchmoe.data.dataset import DataConfigError, FileDocuments, build_documents
from torchmoe.data.documents import SizedDocuments
from torchmoe.data.file_index import INDEX_FOLDER
from torchmoe.data.mixture import KEY as MIX_KEY
from torchmoe.data.mixture import source_settings
from torchmoe.data.tokenizer import Tokenizer
from torchmoe.metrics.metrics_records import METRICS_FILE
from torchmoe.metrics.run_logs import LOG_FILE_NAME, LOG_FOLDER
from torchmoe.metrics.wandb_logger import RUN_ID_FILE, WANDB_FOLDER
from torchmoe.models.registry import hf_mapping
from torchmoe.plan.dry_run import DRY_RUN_FILE
from torchmoe.run_folders.run_info import RUN_INFO_FILE
from torchmoe.run_folders.run_lock import LOCK_NAMES
from torchmoe.weight_sources.folder_model import hf_folder

_STEP_NAME = re.compile(r"step-(\d+)(-hf)?")
# Every name the checkpoint manager writes, renames or prunes: step-N, its -hf export, a LoRA run's
# base, their temporaries.
_STEP_ENTRY = re.compile(r"(step-\d+(-hf)?|base)(\.tmp-\w+)?")


# ---- what the run reads ----------------------------------------------------------------------


def resumes(cfg: JobConfig) -> bool:
    """Whether the run will resume from a complete `step-N/` of its own (as CheckpointManager
    finds them), and so never read `checkpoint.initial_load_path`."""
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    return cfg.checkpoint.enable and folder.is_dir() and any(
        _STEP_NAME.fullmatch(p.name) and (p / ".complete").is_file() for p in folder.iterdir())


def check_hf_assets(model: Model) -> None:
    """`model.hf_assets_path` must be a folder this user can list (torchtitan's one folder of
    tokenizer, config and weights): a file there would otherwise be read as the tokenizer and
    refused as a bad tokenizer.json, or not read at all when the tokenizer is given."""
    if model.hf_assets_path:
        with path_faults("model.hf_assets_path", model.hf_assets_path, "point it at a Hugging Face model folder "
                         "(tokenizer.json; config.json and *.safetensors for checkpoint.initial_load_in_hf)"):
            os.listdir(model.hf_assets_path)  # the OS says what is wrong: "Not a directory" for a file


def check_initial_load_path(cfg: JobConfig) -> None:
    """`checkpoint.initial_load_path`, when the run will load it (a seed run always does), must be what
    `initial_load_in_hf` says: a DCP folder (`.metadata`) or a Hugging Face folder (safetensors).
    What is inside is checked where it is loaded, before the first step."""
    ckpt = cfg.checkpoint
    if not ckpt.initial_load_path or (resumes(cfg) and not ckpt.create_seed_checkpoint):  # a seed run never resumes
        return
    key = source_key(cfg, "checkpoint.initial_load_path")
    hf = hf_folder(cfg.model)
    dcp = "a DCP checkpoint folder: a step-N folder of a run, or the output of `torchmoe convert hf-to-dcp`"
    want = hf if ckpt.initial_load_in_hf else dcp
    with path_faults(key, ckpt.initial_load_path, f"point it at {want}, or leave it empty to start from random "
                     "weights"):
        names = os.listdir(ckpt.initial_load_path)  # the OS says what is wrong with the path, if anything
    is_dcp = ".metadata" in names
    is_hf = "model.safetensors.index.json" in names or any(name.endswith(".safetensors") for name in names)
    if ckpt.initial_load_in_hf and not is_hf:
        fix = ("it is a DCP checkpoint: set checkpoint.initial_load_in_hf = false" if is_dcp
               else f"point it at {hf}")
        raise ConfigError(key, ckpt.initial_load_path, "initial_load_in_hf = true, but the folder holds no "
                          "*.safetensors", fix)
    if not ckpt.initial_load_in_hf and not is_dcp:
        fix = ("it is a Hugging Face folder: set checkpoint.initial_load_in_hf = true" if is_hf
               else f"point it at {dcp}")
        raise ConfigError(key, ckpt.initial_load_path, "not a DCP checkpoint (no .metadata in the folder)", fix)


def check_tokenizer(tokenizer: Tokenizer, model_vocab: int, model: Model, training: Training, *,
                    key: str = "model.tokenizer_path") -> None:
    """Every token id must have an embedding row, and `training.add_bos` needs a BOS token; `key`
    named the tokenizer (`source_key`)."""
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(key, model.tokenizer_path,
                          f"the tokenizer has {tokenizer.vocab_size} tokens but flavor {model.flavor!r} has vocab_size "
                          f"{model_vocab}", "use a tokenizer that fits the flavor's vocabulary")
    if training.add_bos and tokenizer.bos_id is None:
        raise ConfigError("training.add_bos", True, f"the tokenizer ({model.tokenizer_path}) has no BOS token",
                          "name one as bos_token in its tokenizer_config.json, or set add_bos = false")


def check_dataset_mix(training: Training) -> None:
    """`training.dataset_mix` as written, without opening a source (a dry run checks it too): each
    entry's form, weight and name (`parse_mix`), its dataset kind and path, and no
    `training.dataset_path` beside it."""
    if not training.dataset_mix:
        return
    if training.dataset_path:
        raise ConfigError("training.dataset_path", training.dataset_path,
                          "is set together with training.dataset_mix, which names every source itself",
                          "put this dataset in the mixture, or leave training.dataset_mix empty")
    for source, alone in source_settings(training):
        try:
            check_dataset("training", alone.dataset, alone.dataset_path)
        except ConfigError as err:
            problem = err.problem.replace("dataset = ", "its dataset ") if err.key.endswith("_path") else \
                f"its DATASET {show_value(alone.dataset)}: {err.problem}"
            raise ConfigError(MIX_KEY, source.entry, problem,
                              "write each entry as [NAME=]WEIGHT:DATASET[:PATH], e.g. \"web=0.7:local:data/web/*.jsonl\"; "
                              + err.fix.replace("set dataset_path to", "its PATH is")) from None


def check_dataset_rows(training: Training, global_batch_size: int, tokenizer: Tokenizer, *,
                       key: str = "training.dataset_path") -> None:
    """Every row of the global batch must get text to pack: files are cut into G ranges
    (`data.documents`), so each range must hold some; a hub dataset's row j reads its rows j,
    j + G, ..., so it must hold G rows. Reads the first unit of the first row (of a hub dataset,
    its first G rows), so a dataset that cannot be resolved, or an undecodable or malformed
    document there, fails here too (the python_docs corpus is always there); later documents
    say the same when a rank reads them. `key` names the dataset's path
    (``validation.dataset_path`` for the validation data). Pre-tokenized shards must come from
    `tokenizer` (their digests are checked when the run opens them). Files whose documents need
    an index (.jsonl, .json, .parquet) are only listed here: their rows are cut, and checked
    alike, when the run opens them (`DataLoader`), once one rank has read them (every rank
    reading every byte here would read the corpus N times)."""
    if training.dataset_mix:  # its entries were checked before (`check_dataset_mix`)
        for _, alone in source_settings(training):
            check_dataset_rows(alone, global_batch_size, tokenizer, key=MIX_KEY)
        return
    if training.dataset == "python_docs":
        return
    # Token shards' digests are checked when the run opens them, each rank hashing a share
    # (`dataloader.build_corpus`): here every rank would hash every index file.
    docs = build_documents(training, key=key, check_digests=False)
    docs.check_tokenizer(tokenizer)
    if isinstance(docs, FileDocuments) and docs.indexed:
        # Cut into rows when the run opens it: indexing reads every byte, which one rank does for
        # all (`file_index`), not every rank here; each then checks its own rows (`RowCorpus`).
        return
    if isinstance(docs, SizedDocuments):
        # Every row must get a part (cutting needs only the sizes), but only the first row's first
        # unit is read: each row's would be the whole corpus again, read by every rank at once.
        rows = [docs.split(row, global_batch_size) for row in range(global_batch_size)]
        next(iter(rows[0]), None)
        return
    count = sum(1 for _ in itertools.islice(docs.iter_from(0), global_batch_size))
    if count == 0:
        raise DataConfigError(key, training.dataset_path, "holds no documents",
                              "point it at a hub dataset that holds text")
    if count < global_batch_size:
        raise DataConfigError(
            key, training.dataset_path,
            f"holds {count} row(s), fewer than the {global_batch_size} rows of a global batch (batch row j packs "
            f"the hub dataset's rows j, j + {global_batch_size}, ...)",
            f"use training.global_batch_size <= {count}, or prepare the data as files (torchmoe prepare-data, or "
            "local files: their bytes are cut into one range per batch row)",
        )  # fmt: skip


# ---- what the run writes ---------------------------------------------------------------------


def check_outputs(cfg: JobConfig, world_size: int, device: torch.device) -> None:
    """Everything the run will write must be writable now: the dump folder, the files and
    folders in it, and the `step-N` names the run will save under; and no name the run writes or
    deletes may be a symbolic link (`_refuse_links`)."""
    dump = Path(cfg.job.dump_folder)
    # Where the NCCL flight recorder dumps too (`training.world.init_distributed`).
    folders = written_folders(cfg, nccl_traces=device.type == "cuda" and world_size > 1)
    for folder in folders:
        _check_folder(folder.key, folder.value, Path(folder.path))
    own = ["config.toml", METRICS_FILE, RUN_INFO_FILE, *LOCK_NAMES]
    if cfg.metrics.enable_wandb:  # W&B's run id and folder have fixed names in the dump folder
        own.append(RUN_ID_FILE)
        _check_folder("job.dump_folder", cfg.job.dump_folder, dump / WANDB_FOLDER)
    for name in own:
        _check_file("job.dump_folder", cfg.job.dump_folder, dump / name)
    _check_folder("job.dump_folder", cfg.job.dump_folder, dump / INDEX_FOLDER)
    own.append(INDEX_FOLDER)
    if cfg.metrics.enable_log_files:  # each rank's rank<r>.log (`run_logs`)
        _check_folder("job.dump_folder", cfg.job.dump_folder, dump / LOG_FOLDER)
        own.append(LOG_FOLDER)
        _refuse_links("job.dump_folder", cfg.job.dump_folder, dump / LOG_FOLDER, LOG_FILE_NAME.fullmatch)
    if cfg.metrics.enable_wandb:
        own.append(WANDB_FOLDER)
    for folder in folders:
        written = (lambda name: name in own) if folder.key == "job.dump_folder" else _written_names(folder.key, cfg)
        _refuse_links(folder.key, folder.value, Path(folder.path), written)
    if cfg.checkpoint.enable:
        _check_step_names(cfg.checkpoint, dump / cfg.checkpoint.folder, cfg.training.steps)


_ITERATION = re.compile(r"iteration_\d+(_exit)?")


def _written_names(key: str, cfg: JobConfig) -> Callable[[str], bool]:
    """Which names of the folder of `key` the run writes or deletes (besides its lock file)."""
    if key == "checkpoint.folder":
        return lambda name: bool(_STEP_ENTRY.fullmatch(name))
    if key in ("profiling.save_traces_folder", "profiling.save_memory_snapshot_folder"):
        return lambda name: bool(_ITERATION.fullmatch(name))
    if key == "comm.save_traces_folder":
        return lambda name: name.startswith(cfg.comm.save_traces_file_prefix)
    return lambda name: False  # TensorBoard: event files of new names


def _refuse_links(key: str, value: str, folder: Path, written: Callable[[str], bool]) -> None:
    """No name of `folder` that the run writes or deletes (`written`, and its lock file) may be a
    symbolic link, nor a file in such a folder of traces (`iteration_N/rank0_trace.json`): a
    write would go through it (out of the folder, into another run's file), pruning would delete
    through it (a shared checkpoint's marker). The folder itself may be a link: each folder is
    locked at its real location (`run_lock`). A folder that does not exist yet is fine."""
    try:
        entries = [e for e in os.scandir(folder) if e.name in LOCK_NAMES or written(e.name)]
    except (FileNotFoundError, NotADirectoryError):
        return  # created by the run (`_check_folder` said whether it can be)
    for entry in entries:
        traces = _ITERATION.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        for link in [entry, *(os.scandir(entry.path) if traces else ())]:
            if link.is_symlink():
                checkpoint = "; to start from another run's checkpoint, set checkpoint.initial_load_path to it" \
                    if key == "checkpoint.folder" else ""
                raise ConfigError(key, value, f"{link.path} is a symbolic link (to {os.readlink(link.path)}): a run "
                                  "never writes or deletes through a link it did not make",
                                  f"remove the link, or put a copy of what it points to in its place{checkpoint}")


def check_dry_run_outputs(job: Job) -> None:
    """The dry run writes `dry_run.json` into the dump folder (on this machine)."""
    _check_folder("job.dump_folder", job.dump_folder, Path(job.dump_folder))
    _check_file("job.dump_folder", job.dump_folder, Path(job.dump_folder) / DRY_RUN_FILE)
    _refuse_links("job.dump_folder", job.dump_folder, Path(job.dump_folder), lambda name: name == DRY_RUN_FILE)


def _check_folder(key: str, value: str, folder: Path) -> None:
    """`folder`, or the nearest ancestor that exists (the run creates the rest), must be a
    folder this process can create files in (`writable_folder`). Under a launcher only the
    node's first rank (LOCAL_RANK 0) creates its probe file; the node's other ranks, which share
    its mounts, ask the kernel (`access`: permissions and read-only mounts, so that they refuse
    alike in the usual cases). Every rank creating and deleting a file in one folder was 2N
    writes under that folder's lock (Lustre, GPFS) as the job started."""
    with path_faults(key, value, WRITE_FIX):
        writable_folder(folder, create=launch_int("LOCAL_RANK", 0) == 0)


def _check_file(key: str, value: str, file: Path) -> None:
    """A file the run appends to or replaces must be a file it may open for writing
    (`writable_file`)."""
    with path_faults(key, value, "move or delete what is in the way, fix its permissions, or use another dump "
                     "folder"):
        writable_file(file)


def _check_step_names(checkpoint: Checkpoint, folder: Path, steps: int) -> None:
    """No file may sit where a checkpoint will be saved: step-N at every interval-th step and
    the last (step-0 for a seed checkpoint; step-N-hf for the final Hugging Face weights)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        m = _STEP_NAME.fullmatch(entry.name)
        if not m or entry.is_dir():
            continue
        step, hf = int(m.group(1)), m.group(2) is not None
        saved = (step == steps and checkpoint.last_save_in_hf) if hf else (
            step == 0 if checkpoint.create_seed_checkpoint else
            0 < step <= steps and (step % checkpoint.interval == 0 or step == steps))
        if saved:
            raise ConfigError("checkpoint.folder", checkpoint.folder,
                              f"{entry} is a file, where the run will save {show_value(entry.name)}",
                              "move or delete that file")
