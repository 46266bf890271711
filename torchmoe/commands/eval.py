"""`torchmoe eval`: the mean token loss of trained weights on a split, with training's own code.

    torchmoe eval --job.dump_folder outputs/debug-40                      # newest checkpoint, [validation]
    torchmoe eval --config configs/debug_model.toml --split train --batches 1 --step 0
    torchrun --nproc_per_node 4 -m torchmoe eval --checkpoint outputs/x/checkpoint/step-800

`--checkpoint` (or the newest checkpoint of the job's run, or `--step N`'s) gives the weights,
and with them the model where they tell it (a run's config.toml and the Hugging Face folder it
started from, a Hugging Face config.json, a PEFT adapter folder's base: `--base`, else the one
its adapter_config.json names: `weight_sources.trained_weights`). A LoRA run's checkpoint is its
adapters over the run's base, loaded as a resume loads them (`Trainer.load_trained`); an
adapter folder goes over its base as `lora.adapter` does. The job (the job file, or without one
the weights' run's config.toml) gives the layout (any layout training runs: the loss is the same
in each) and the data. `--split validation` (the default) reads the `[validation]` section;
`--split train` reads `[training]`'s corpus from its start, in batches of its `local_batch_size`
rows per rank, so with no gradient accumulation `--batches 1` on a run's step-0 (seed) checkpoint
gives that run's logged step-1 loss. `--batches N` reads N batches (default: `validation.steps`;
-1 is one pass over the data). The result says what the mean is over: the batches read, and
their targets (every token of text data) with the conversations holding them.

It runs training's validation (`Trainer.validate`): same forward, masking and loss. The data's
indexes (`data.file_index`) are the run's own, in `job.dump_folder/data_index`, where its
training and validation indexed the same files: on the file system every node shares (a
node-local scratch folder had each node's ranks index the corpus again), and kept for the next
eval, which indexes nothing where the files are unchanged. Only where this user cannot write there
(another user's run) do they go to the scratch folder. The evaluation's other files (config,
locks) go to a scratch folder that is removed afterwards: of the run's folder, only its index
cache is written to (files named by each data file's identity, each written whole by a rename,
so a live run indexing the same file at once is no harm). `--out FILE.json` writes the result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from torchmoe.commands.exits import rank_specific_errors, stopped_by_peer
from torchmoe.commands.job import checkpoint_job, resolve_world_size
from torchmoe.config import ConfigError, JobConfig
from torchmoe.config.files.output_files import check_output_file, write_output
from torchmoe.config.files.paths import writable_folder
from torchmoe.config.flags import Integer, split_flags
from torchmoe.config.launch_env import launch_int
from torchmoe.config.numbers import INT64_MAX
from torchmoe.config.wording import counted
from torchmoe.data.file_index import INDEX_FOLDER
from torchmoe.weight_sources.trained_weights import STEP, TrainedWeights

if TYPE_CHECKING:
    from torchmoe.training.validation import ValidationLoss

__all__ = ["EVAL_DESCRIPTION", "eval_config", "eval_main"]

logger = logging.getLogger(__name__)

_FLAGS = {"--checkpoint": str, "--base": str, "--step": STEP, "--split": str, "--out": str,
          "--batches": Integer(-1, INT64_MAX, "10", fix="pass a number of batches >= 1, e.g. --batches 10, or -1 "
                               "for one pass")}

EVAL_DESCRIPTION = (
    "The mean token loss (and perplexity) of trained weights: those of --checkpoint (a step-N folder, a DCP folder, "
    "a Hugging Face folder, or a PEFT adapter folder over --base FOLDER or the base its adapter_config.json names), "
    "or else the newest checkpoint of the run in --job.dump_folder (--step N picks one), with the weights' own model, "
    "adapters and tokenizer (the run's config.toml and the folder it started from, the folder's config.json) and the "
    "job's layout and data (--config, optional with a run's weights: the run's config.toml is the job). Own flags: "
    "--split validation|train (validation: the [validation] section; train: [training]'s corpus from its start), "
    "--batches N (default validation.steps; -1: one pass), --out FILE.json. Every other flag overrides the job file "
    "as in `torchmoe train`; launch with torchrun for several ranks.")


def eval_config(cfg: JobConfig, *, weights: TrainedWeights, split: str, batches: int | None,
                work_folder: Path) -> JobConfig:
    """`cfg` as the evaluation runs it: starts from `weights` (a LoRA run's checkpoint: from the
    run's base, the adapters loading over it: `session.evaluate`), saves nothing, writes its run
    files to `work_folder`, validates on `split` for `batches` batches.

    Raises:
        ConfigError: an unknown split, a batch count below -1 or 0, a training mixture as the
            split; a LoRA run's base that is gone (`adapter_checkpoint.lora_base`).
    """
    if split not in ("train", "validation"):
        raise ConfigError("--split", split, "unknown split", "pass --split validation or --split train")
    if batches is not None and (batches == 0 or batches < -1):
        raise ConfigError("--batches", batches, "must be a number of batches >= 1, or -1 for one pass",
                          "pass e.g. --batches 10")
    val = cfg.validation
    if split == "train":
        training = cfg.training
        if training.dataset_mix:
            raise ConfigError("--split", split, "training.dataset_mix draws from several corpora: there is no one "
                              "training corpus to read from its start", "set [validation] to the source to "
                              "evaluate on and pass --split validation")
        val = dataclasses.replace(val, dataset=training.dataset, dataset_path=training.dataset_path,
                                  dataset_split=training.dataset_split, local_batch_size=training.local_batch_size,
                                  seq_len=training.seq_len)
    val = dataclasses.replace(val, enable=True, steps=val.steps if batches is None else batches)
    path, in_hf = _start(weights)
    training = cfg.training
    if weights.lora_step and not path:  # the base is the run's random init: its seed draws it again
        training = dataclasses.replace(training, seed=weights.run.training.seed)
    checkpoint = dataclasses.replace(cfg.checkpoint, enable=False, initial_load_path=path, initial_load_in_hf=in_hf,
                                     create_seed_checkpoint=False, last_save_in_hf=False)
    job = dataclasses.replace(cfg.job, dump_folder=str(work_folder))
    # Training's own metrics sinks and log files stay off: the result is printed (and --out), and
    # the work folder is deleted.
    metrics = dataclasses.replace(cfg.metrics, enable_tensorboard=False, enable_wandb=False, enable_log_files=False)
    # One launch: a fault-tolerant run's replica group evaluates alone, joining no lighthouse.
    ft = dataclasses.replace(cfg.fault_tolerance, enable=False)
    return dataclasses.replace(cfg, validation=val, training=training, checkpoint=checkpoint, job=job,
                               metrics=metrics, fault_tolerance=ft)


def _start(weights: TrainedWeights) -> tuple[str, bool]:
    """(the folder the evaluated model loads from, whether it is a Hugging Face one): the weights
    themselves, an adapter folder's base, a LoRA run's base (its adapters load over it)."""
    if weights.lora_step:
        from torchmoe.training.adapter_checkpoint import lora_base  # imported here: it pulls in torch

        return lora_base(weights.run, weights.folder)
    if weights.form == "adapter":
        return str(weights.base), True
    return str(weights.folder), weights.in_hf


def _work_folder() -> Path:
    """A scratch folder for the run's files, the same on every rank of a node: named by the
    launch's rendezvous (torchrun's variables) under several ranks, a fresh one alone."""
    if launch_int("WORLD_SIZE", 1) == 1:
        return Path(tempfile.mkdtemp(prefix="torchmoe-eval-"))
    launch = "-".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    return Path(tempfile.gettempdir()) / f"torchmoe-eval-{launch.replace(os.sep, '_')}"


def _index_cache(run_folder: Path, work: Path) -> Path:
    """Where the evaluation keeps its data's indexes: the run's own cache (`run_folder/data_index`,
    module docstring), or `work`'s where this process cannot create files there. Under a launcher
    only each node's first rank probes by creating a file; the others ask the kernel
    (`writable_folder`)."""
    cache = run_folder / INDEX_FOLDER
    try:
        writable_folder(cache, create=launch_int("LOCAL_RANK", 0) == 0)
    except OSError as err:
        logger.warning("the run's data index cache %s cannot be written (%s): the data is indexed into this "
                       "evaluation's scratch folder, again at every eval", cache, err.strerror or err)
        return work / INDEX_FOLDER
    return cache


_OUT_FIX = "pass the path of a .json file this user can write"


def eval_main(argv: list[str]) -> int:
    """`torchmoe eval`: print the loss and perplexity (rank 0), and write them to `--out`; returns
    the exit status.

    The job file and its overrides are parsed as `train` parses them, and the weights found
    (`--checkpoint`, `--step`: `job.checkpoint_job`); the job is checked as `train` checks it
    (preflight) before it runs. A rank stopped by another's failure prints one line."""
    from torchmoe.distributed.failure import PeerFailed

    try:
        return _evaluate(argv)
    except PeerFailed as err:
        return stopped_by_peer(err)


def _evaluate(argv: list[str]) -> int:
    found, rest = split_flags(argv, _FLAGS)
    wants_help = any(token in ("-h", "--help") for token in rest)
    # Before the weights are looked for: a refused output wastes no reading.
    out = check_output_file("--out", str(found["--out"]), _OUT_FIX) if "--out" in found and not wants_help else None
    # [validation] is what eval reads, whatever validation.enable says: its keys are in use.
    loaded = checkpoint_job(rest, "torchmoe eval", EVAL_DESCRIPTION, checkpoint=str(found.get("--checkpoint", "")),
                            step=found.get("--step"), base=str(found.get("--base", "")),
                            runs_with={"validation.enable": True})
    if isinstance(loaded, int):
        return loaded
    cfg, weights = loaded
    split = str(found.get("--split", "validation"))
    work = _work_folder()
    try:
        ecfg = eval_config(cfg, weights=weights, split=split, batches=found.get("--batches"),  # type: ignore[arg-type]
                           work_folder=work)
        from torchmoe.preflight import validate_job_config  # imported here: it pulls in torch

        validate_job_config(ecfg, resolve_world_size(None, False, ecfg.parallelism), check_device=True)
        from torchmoe.training.session import evaluate  # imported here: it pulls in the whole training stack

        with rank_specific_errors():
            result = evaluate(ecfg, index_cache=_index_cache(Path(cfg.job.dump_folder), work),
                              lora_step=weights.folder if weights.lora_step else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loss = result.loss
    if not math.isfinite(loss):  # the same on every rank (a global mean): nothing printed or written
        raise ConfigError("--checkpoint", str(weights.folder), f"the loss is {loss}, computing in "
                          f"{ecfg.training.mixed_precision_param}: the weights (finite when loaded) overflow it",
                          "evaluate in float32 (--training.mixed_precision_param float32), or weights of a run "
                          "that had not diverged (an earlier --step)")
    if os.environ.get("RANK") in (None, "0"):
        val = ecfg.validation
        # exp overflows a float past a loss of ~709: the perplexity is then null, never inf.
        perplexity = math.exp(loss) if loss < 700 else None
        output = {"checkpoint": str(weights.folder), "split": split, "loss": loss, "perplexity": perplexity,
                  "batches": val.steps, "batches_read": result.batches, "targets": result.targets,
                  "documents": result.documents, "seq_len": val.seq_len, "dataset": val.dataset,
                  "dataset_path": val.dataset_path}
        shown = f"{perplexity:.3f}" if perplexity is not None else "over 1e304"
        print(f"{split} loss {loss:.6f} (perplexity {shown}) over {_covered(result, val.steps, val.dataset)} of "
              f"{val.dataset} at seq_len {val.seq_len}; weights {weights.folder}", file=sys.stdout, flush=True)
        if out is not None:
            write_output("--out", out, json.dumps(output, indent=2) + "\n", _OUT_FIX)
    return 0


def _covered(result: ValidationLoss, steps: int, dataset: str) -> str:
    """What the mean is over, said: its batches (one pass: how many there were), and its tokens:
    a chat corpus's targets and the conversations that hold them, every token of text."""
    batches = counted(result.batches, "batch", "batches") + (" (one pass)" if steps == -1 else "")
    if result.documents is None:
        return f"{batches}, {counted(result.targets, 'token')}"
    held = "conversation" if dataset == "chat" else "document"
    return f"{batches}, {counted(result.targets, 'target')} in {counted(result.documents, held)}"

