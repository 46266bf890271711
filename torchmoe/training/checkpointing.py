"""Checkpoints as training writes them: after each step when due (or when a signal stops the
run), the Hugging Face export at the end, the seed checkpoint, and what a failed save means."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchmoe.arch.model_args import ModelArgs
from torchmoe.checkpoints.base_fingerprint import base_fingerprint
from torchmoe.checkpoints.checkpoint import CheckpointManager, SaveFailed, saved_base
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, dcp_load, load_model_only
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.paths import source_key
from torchmoe.config.job_config import JobConfig
from torchmoe.hf_files.base_files import BASE_FILES, keep_base_files
from torchmoe.hf_files.hf_storage import save_hf_weights
from torchmoe.hf_files.tokenizer_files import copy_tokenizer_files, tokenizer_files
from torchmoe.nn.lora import is_adapter_name
from torchmoe.training.adapters import (
    base_source,
    base_tensors,
    base_weights,
    checkpointed,
    export_hf,
    hf_base,
    import_adapter,
    put_back,
    set_aside,
)
from torchmoe.training.log import logger
from torchmoe.weight_sources.folder_model import base_config_folder
from torchmoe.weight_sources.initial_load import hf_bias_drop, load_initial_weights
from torchmoe.weights.divergence import TrainingDiverged
from torchmoe.weights.finite import NonFiniteValues
from torchmoe.weights.weight_files import read_dcp_metadata


class Checkpoints:
    """This rank's side of the run's checkpoints.

    Args:
        cfg: the job (`[checkpoint]`, the model's files).
        manager: the checkpoint folder's manager.
        state: what a checkpoint holds (`CheckpointManager.save`'s `state`).
        model, model_args: this rank's model and what it is.
        rank: this process's rank.
    """

    def __init__(self, cfg: JobConfig, manager: CheckpointManager, state: dict, model: nn.Module,
                 model_args: ModelArgs, *, rank: int) -> None:
        self.cfg, self.manager, self.state = cfg, manager, state
        self.model, self.model_args = model, model_args
        self.rank = rank

    def load_initial_weights(self, *, resumed: bool) -> None:
        """The weights of `checkpoint.initial_load_path`, if set (else the model keeps its init):
        for a new run; for a `resumed` one only where its checkpoints lack them (LoRA's frozen
        base, `adapters.checkpointed`), from the run's own copy of the base when it saved one
        (`lora.checkpoint_base`). A LoRA run then checks the base's fingerprint against its
        checkpoint's (`check_base`), a new one takes its adapters from `lora.adapter` if set, and
        with `lora.checkpoint_base` the base is saved once."""
        lora, ckpt = self.cfg.lora, self.cfg.checkpoint
        held = checkpointed(lora, self.model_args)
        if resumed and held is None:
            return
        base = saved_base(self.manager.folder) if resumed and lora.enable else None
        # What the resumed checkpoint holds of the base's tensors (the expert biases the run
        # trains): the base loads over them, to be fingerprinted as it is, then they come back.
        trained = set_aside(self.model, lambda name: held(name) and not is_adapter_name(name)) if resumed else {}
        if base is not None:  # checksummed when saved and checked as it loads: the run's own copy
            load_model_only(base, [self.model], key="checkpoint.folder", keep=base_weights(lora))
        elif ckpt.initial_load_path:
            load_initial_weights(ckpt, self.cfg.model.flavor, self.model_args, self.model,
                                 key=source_key(self.cfg, "checkpoint.initial_load_path"), keep=base_weights(lora))
        if not lora.enable:
            return
        self.check_base(base)
        put_back(self.model, trained)
        if not resumed:
            import_adapter(lora, self.model_args, self.model)
        if lora.checkpoint_base and base is None and self.manager.writes and not ckpt.create_seed_checkpoint:
            self.manager.save_base({"model": ModelWrapper([self.model], keep=base_weights(lora))},
                                   files=self._base_files())

    def _base_files(self) -> dict[str, Path]:
        """The files `base/` keeps beside the base's tensors, so that the run and every reader of
        it need the folder it started from no more: a Hugging Face start's config.json and
        generation config (`base_files.BASE_FILES`), and the tokenizer's files."""
        ckpt = self.cfg.checkpoint
        folder = Path(ckpt.initial_load_path)
        files = {name: folder / name for name in BASE_FILES if ckpt.initial_load_in_hf and (folder / name).is_file()}
        return {**tokenizer_files(self.cfg.model.tokenizer_path), **files}

    def load_trained(self, step_dir: Path) -> None:
        """The model of a LoRA run's checkpoint `step_dir` (`torchmoe eval`), as a resume from it
        has it, without its training state: what the checkpoint holds of the model
        (`adapters.checkpointed`) and the base's fingerprint, then the base from
        `checkpoint.initial_load_path` (the run's base: `adapter_checkpoint.lora_base`), checked
        against that fingerprint (`check_base`). Collective."""
        metadata = read_dcp_metadata("--checkpoint", step_dir, "pass a step-N checkpoint folder of the run",
                                     self.manager.group)
        recorded = any(key.startswith("base.") for key in metadata.state_dict_metadata)
        dcp_load({name: self.state[name] for name in ("model", "base") if name == "model" or recorded}, step_dir,
                 self.manager.group)
        self.load_initial_weights(resumed=True)

    def check_base(self, base: Path | None) -> None:
        """Record the fingerprint of the base as loaded (from the run's `base` copy, if not None),
        which a resumed run's checkpoint must have recorded too (`ConfigError`, naming where the
        base came from, when it is another base)."""
        found = base_fingerprint(self.model, base_tensors(self.model_args, self.cfg.lora), self.manager.group)
        key, path, fix = base_source(self.cfg, base)
        self.state["base"].check(found, key=key, path=path, fix=fix)

    def after_step(self, step: int, *, stopping: bool) -> None:
        """After step `step`: save when due (or `stopping` for a signal), if the state is finite
        on every rank (else `TrainingDiverged`: the save checks it); else make a finished async
        save visible.

        A save that fails mid-run (disk full, permissions changed) is reported and training
        goes on: the state in memory is intact and the next interval tries again. When it was
        the run's last save, the run ends with that error (`ConfigError`: exit 2), naming the
        checkpoint it can resume from.
        """
        last = stopping or step == self.cfg.training.steps
        due = stopping or self.manager.should_save(step)
        if due:
            try:  # an earlier async save still in flight: its failure is not this step's
                self.manager.wait()
            except SaveFailed as err:
                self.save_failed(err, last=False)
        try:
            if stopping:
                self.manager.save(step, self.state)
            else:
                self.manager.maybe_save(step, self.state)
            if due and last:
                self.manager.wait()  # an async last save must be on disk before the run ends
        except SaveFailed as err:
            self.save_failed(err, last=last)
        except NonFiniteValues as err:  # the save checked every rank's state: nothing was written
            raise diverged(err, "saving", step) from None

    def save_failed(self, err: SaveFailed, *, last: bool) -> None:
        """Report a failed save: fatal (`ConfigError`) when it was the run's last, else one line."""
        newest = self.manager.complete_checkpoints()
        resume = f"the newest checkpoint on disk is {newest[-1][1]}" if newest else "no checkpoint is on disk"
        if last:
            raise ConfigError("checkpoint.folder", str(self.manager.folder), f"{err}; {resume}",
                              "free space or fix permissions there, then run again to resume") from None
        if self.rank == 0:  # every rank has the same error (the save agreed on it): one line
            logger.error("%s; training goes on (the state in memory is intact, the next save is attempted at its "
                         "interval); %s", err, resume)

    def close_on_exit(self, exc_type, exc, tb) -> bool:
        """Leaving the loop: finish the async save in flight when every rank leaves together
        (done, stopped by a signal, or diverged: the loss is global, so all ranks stop at the
        same step). After any other error this rank leaves alone, and waiting for the save is a
        collective its peers never join."""
        if exc is None or isinstance(exc, TrainingDiverged):
            self.manager.close()
        return False  # never swallows the exception

    def save_hf(self, step: int) -> None:
        """Write the weights as a Hugging Face folder, each rank writing its own shards (under
        LoRA: what `lora.export` names, gathered to rank 0: `adapters.export_hf`), with the
        tokenizer's files (`hf_files.tokenizer_files`; none for the byte tokenizer); not
        when they are non-finite (`TrainingDiverged`: the last step's update, unchecked by a save
        when checkpointing is off). Visible only once complete (`CheckpointManager.save_export`);
        a failed write is the run's last error (`save_failed`)."""
        lora = self.cfg.lora

        def write(folder: Path) -> None:
            if lora.enable:  # the adapters in PEFT's format, or merged into the weights (`lora.export`)
                export_hf(self.model, self.model_args, lora, folder, rank=self.rank,
                          bias_drop=hf_bias_drop(self.cfg.checkpoint), base=hf_base(self.cfg))
            else:
                save_hf_weights(get_model_state_dict(self.model), self.model_args, folder,
                                process_group=self.manager.group, bias_drop=hf_bias_drop(self.cfg.checkpoint))
            if self.rank == 0:  # the base's fields and the tokenizer beside the weights: the folder loads whole
                keep_base_files(folder, base_config_folder(self.cfg.model))
                copy_tokenizer_files(self.cfg.model.tokenizer_path, folder)

        try:
            out = self.manager.save_export(step, write)
        except NonFiniteValues as err:
            raise diverged(err, "writing Hugging Face weights", step) from None
        except SaveFailed as err:  # a full disk: nothing of the export is left
            self.save_failed(err, last=True)  # raises: the run's last write
        logger.info("saved Hugging Face weights to %s", out)

    def save_seed(self) -> None:
        """Write step-0 with the weights as they are."""
        path = self.manager.save_seed_checkpoint(self.state)
        logger.info("seed checkpoint written to %s", path)


def diverged(err: NonFiniteValues, doing: str, step: int) -> TrainingDiverged:
    """The state became non-finite in training by step `step` (what is loaded is checked:
    `weights.finite`); the fix names the setting behind the tensors `err` names."""
    fix = "lower model.load_balance_coeff" if any("expert_bias" in n for n in err.names) else "lower optimizer.lr"
    return TrainingDiverged(f"the model or optimizer state is not finite after step {step} ({err}): "
                            f"stopping without {doing}; {fix}")
