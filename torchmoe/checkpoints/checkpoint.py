"""Distributed checkpoints (DCP) with atomic visibility and automatic resume.

    ckpt = CheckpointManager(job.dump_folder, job_config.checkpoint, total_steps=steps)
    state = {
        "model": ModelWrapper(model_parts),
        "optimizer": OptimizerWrapper(model_parts, optimizers),
        "lr_scheduler": scheduler,
        "dataloader": dataloader,                 # its rows: a DTensor over the batch mesh
        "rng": RankLocal(RNGState(), rank=rank),
    }
    step = ckpt.load_latest(state) or 0           # resume; None when there is no checkpoint
    for step in range(step + 1, steps + 1):
        ...
        ckpt.maybe_save(step, state)
    ckpt.close()

Layout (DESIGN §3, a contract): `<dump_folder>/<checkpoint.folder>/step-N/`, DCP format, plus a
`.complete` marker holding JSON metadata. Every rank writes its shards into
`step-N.tmp-<id>/`; once DCP reports the save finished on all ranks, rank 0 writes the marker
and renames the folder to `step-N/`. A `step-N/` without the marker is never loaded, so a job
killed at any moment leaves either the previous checkpoints or a complete new one. The writer
records a checksum of every file in `.checksums.json` (`checksums.ChecksummingWriter`); a load
checks them first and unpickles nothing but DCP's metadata and plain values (`weight_files.load_dcp`).

What a checkpoint holds (the model, optimizer, RNG and per-rank wrappers) and DCP's load of it
are `checkpoint_state.py`'s; a saved layout loads under another (DTensors by FQN). State that is
split over ranks in a way that must survive a change of layout is a DTensor, like the model's:
the dataloader's positions are a (global_batch_size, 3) tensor sharded over the batch mesh (each
dp rank holds its rows; its CP/TP/PP peers hold the same rows, which DCP saves once), so DCP
reshards them into any dp degree.

A save that fails (full disk, permissions changed mid-run) deletes its temporary folder and
raises `SaveFailed` on every rank alike, so the ranks agree whether to go on; the checkpoints
already on disk and the training state in memory are untouched.

A Stateful's `check_saved_shapes` (`checkpoint_state`) raising `ConfigError` stops the resume
on every rank instead of falling back to older checkpoints, which share the problem.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from torchmoe.checkpoints.checkpoint_state import dcp_load, dist_on
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_writes import os_cause, write_fault
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.config.job_config import Comm as CommConfig
from torchmoe.distributed.one_reader import one_reads
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.weights.checksums import ChecksummingWriter
from torchmoe.weights.finite import NonFiniteValues, nonfinite_names, require_finite
from torchmoe.weights.weight_files import UnreadableWeights, describe, read_dcp_metadata

logger = logging.getLogger(__name__)

MARKER = ".complete"
BASE_DIR = "base"
"""A LoRA run's frozen base, saved once next to its step-N folders (`lora.checkpoint_base`)."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^(step-\d+(-hf)?|base)\.tmp-(?P<id>\w+)$")  # a save's, a Hugging Face export's, the base's


def _rank() -> int:
    return dist.get_rank() if dist_on() else 0


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N/` folder (not a link) in `folder` holding the completion
    marker, oldest first; none when `folder` does not exist."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = _STEP_DIR.match(path.name)
        # A symbolic link is not the run's (refused at start): never loaded, never pruned.
        if m and not path.is_symlink() and (path / MARKER).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def saved_base(folder: Path) -> Path | None:
    """`folder`'s complete `base/` (holding the completion marker, not a link), or None."""
    base = folder / BASE_DIR
    return base if not base.is_symlink() and (base / MARKER).is_file() else None


def checkpoint_timeout(checkpoint_cfg: CheckpointConfig, comm_cfg: CommConfig) -> timedelta:
    """The checkpoint group's collective timeout: `checkpoint.timeout_seconds`, -1 meaning the
    init timeout (loading, compile and the first step's)."""
    seconds = checkpoint_cfg.timeout_seconds
    return timedelta(seconds=comm_cfg.init_timeout_seconds if seconds == -1 else seconds)


class SaveFailed(Exception):
    """A checkpoint (`name`: step-N, or its step-N-hf export) could not be written; raised on every
    rank. Its temporary folder is gone and the checkpoints saved before it are intact."""

    def __init__(self, name: str, error: str) -> None:
        self.error = error
        super().__init__(f"checkpoint {name} could not be saved ({error})")


@dataclass
class _PendingSave:
    """An async save in flight: rank 0 finalizes it (marker + rename) once `future` is done."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    future: Future
    finalized: bool = False


class CheckpointManager:
    """Saves `step-N/` checkpoints, keeps the newest k, and resumes from the newest complete one.

    Construct on every rank, after `torch.cuda.set_device` (it broadcasts an id, and creates the
    checkpoint's gloo group); all methods except `should_save` and `complete_checkpoints` are
    collective and must be called by every rank.

    Args:
        dump_folder: job.dump_folder; checkpoints go to `<dump_folder>/<cfg.folder>/`.
        cfg: the `[checkpoint]` section.
        total_steps: training.steps; the last step is always saved.
        timeout: of the checkpoint group's collectives (`checkpoint_timeout`); None: gloo's default.
    """

    def __init__(self, dump_folder: str | os.PathLike, cfg: CheckpointConfig, *, total_steps: int,
                 timeout: timedelta | None = None) -> None:
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.total_steps = total_steps
        self.rank = _rank()
        self.world_size = dist.get_world_size() if dist_on() else 1
        self._pending: _PendingSave | None = None
        self._last_saved: int | None = None
        # All ranks write into the same temporary folder, so its id comes from rank 0. It differs
        # from run to run, so leftovers of a killed run are never mistaken for this run's.
        ids = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        if dist_on():
            dist.broadcast_object_list(ids, src=0)
        self.id: str = ids[0]
        # Every collective of saving and loading runs in a gloo group of its own: DCP's background
        # thread (async saves) must not interleave with the training loop's collectives, and a
        # save's gather waits for the slowest rank's write, which at scale routinely takes longer
        # than the training step's timeout allows (`process_groups`): this group keeps `timeout`.
        self._async = cfg.async_mode != "disabled"
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist_on() else None
        # Whether this run writes checkpoints at all (load_only: resume, never save).
        self.writes = cfg.enable and not cfg.load_only
        if self.rank == 0 and self.folder.is_dir():
            # The run owns its dump folder (`run_lock`): no live run is writing these.
            self._remove_stale_temporaries()

    # ---- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True at every `interval`-th step, at the last step, and at step 1 with
        `enable_first_step_checkpoint` (never with `load_only`)."""
        due = step % self.cfg.interval == 0 or step == self.total_steps or (
            step == 1 and self.cfg.enable_first_step_checkpoint)
        return self.writes and step != self._last_saved and due

    def maybe_save(self, step: int, state: dict[str, Any]) -> bool:
        """Call after every training step: saves when `should_save(step)`; returns whether it did.

        Also makes a finished async save visible (rank 0) without waiting for the next one.
        """
        self._poll()
        if not self.should_save(step):
            return False
        self.save(step, state)
        return True

    def save(self, step: int, state: dict[str, Any], *, model_only: bool = False) -> None:
        """Save `state` as `step-<step>/` (in the background with an async `async_mode`).

        The last step's save holds only the model, cast to `export_dtype`, with
        `last_save_model_only` (an export: `load_latest` never resumes from it).

        Args:
            step: the number of completed training steps.
            state: name -> Stateful or (nested) dict of tensors and picklable values.
            model_only: record in the marker that only "model" was saved (seed checkpoints).

        Raises:
            NonFiniteValues: (on every rank, nothing written) a tensor of `state` holds NaN or inf.
            ConfigError: the export's cast to `export_dtype` overflows a weight to inf.
        """
        require_finite(state, group=self.group)
        if self.cfg.last_save_model_only and step == self.total_steps and not model_only:
            dtype = torch_dtype(self.cfg.export_dtype)
            weights = {name: t.to(dtype) if t.is_floating_point() else t
                       for name, t in state["model"].state_dict().items()}
            try:
                require_finite(weights, group=self.group)
            except NonFiniteValues as err:
                raise ConfigError("checkpoint.export_dtype", self.cfg.export_dtype, f"{err.shown} exceed its range "
                                  f"({torch.finfo(dtype).max:.4g}): the export would hold inf",
                                  "export in bfloat16 or float32, whose range holds them") from None
            state, model_only = {"model": weights}, True
        self.wait()
        tmp = self.folder / f"step-{step}.tmp-{self.id}"
        meta = {
            "step": step,
            "model_only": model_only,
            "world_size": self.world_size,
            "keys": sorted(state),
            "saved_at": time.time(),
        }
        logger.info("saving checkpoint step-%d%s", step, " in the background" if self._async and not model_only else "")
        self._last_saved = step
        if self._async and not model_only:
            future = dcp.async_save(
                state, storage_writer=ChecksummingWriter(tmp), process_group=self.group, no_dist=not dist_on(),
                async_stager=self._stager(),
            )
            # Older return type: a Future; newer with async staging: an AsyncSaveResponse.
            future = getattr(future, "upload_completion", future)
            self._pending = _PendingSave(step, tmp, meta, future)
            return
        error = None
        try:
            dcp.save(state, storage_writer=ChecksummingWriter(tmp), process_group=self.group,
                     no_dist=not dist_on())
        except (Exception, CheckpointException) as e:  # DCP raises a write error on every rank
            error = write_fault(e)
        # dcp.save returns only after rank 0 has gathered every rank's write results and written
        # .metadata, so every shard is on disk: rank 0 may make the folder visible now.
        self._finish(f"step-{step}", tmp, meta, error)

    def _stager(self) -> DefaultStager | None:
        """DCP's copy to host memory before the background write: into pinned memory (a faster
        device-to-host copy) for 'async_with_pinned_mem' on CUDA; torch's default otherwise
        (pinned memory needs CUDA)."""
        if self.cfg.async_mode != "async_with_pinned_mem" or not torch.cuda.is_available():
            return None
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=True))

    def save_seed_checkpoint(self, state: dict[str, Any]) -> Path:
        """Write `step-0/` holding only `state["model"]` (freshly initialized weights).

        Any layout that later finds it loads the model from it and starts training at step 1.
        """
        self.save(0, {"model": state["model"]}, model_only=True)
        return self.folder / "step-0"

    def save_base(self, state: dict[str, Any], files: Mapping[str, Path] | None = None) -> Path:
        """Write `base/` (a LoRA run's frozen base: `state` = {"model": its ModelWrapper}) with
        copies of `files` (name there -> source: the Hugging Face folder's config.json, which
        describes the model, its generation config, the tokenizer's files), as a step-N folder is
        written: checksummed, visible by a rename once complete, replacing an earlier run's.
        Returns the folder.

        Raises:
            SaveFailed: writing it failed (a full disk): nothing of it is left.
        """
        tmp = self.folder / f"{BASE_DIR}.tmp-{self.id}"
        meta = {"step": None, "model_only": True, "world_size": self.world_size, "keys": sorted(state),
                "saved_at": time.time()}
        logger.info("saving the frozen base to %s", self.folder / BASE_DIR)
        error = None
        try:
            dcp.save(state, storage_writer=ChecksummingWriter(tmp), process_group=self.group, no_dist=not dist_on())
            if self.rank == 0:
                for name, file in (files or {}).items():
                    shutil.copyfile(file, tmp / name)
        except (Exception, CheckpointException) as e:
            error = write_fault(e)
        self._finish(BASE_DIR, tmp, meta, error)
        return self.folder / BASE_DIR

    def save_export(self, step: int, write: Callable[[Path], None]) -> Path:
        """Write `step-<step>-hf/` as `write(folder)` does (collective: every rank calls it with the
        same folder), into a temporary folder that becomes visible by a rename once `write` returned
        on rank 0 (it ends when every rank's part is written). Returns the folder.

        Raises:
            SaveFailed: the filesystem refused a write (a full disk): the temporary folder is gone.
                When one rank alone fails in a part of `write` that is not collective, its peers
                are blocked in the next collective: the failure watch ends them, and the next run
                deletes the temporary folder.
        """
        tmp = self.folder / f"step-{step}-hf.tmp-{self.id}"
        try:
            write(tmp)
        except (Exception, CheckpointException) as e:
            if os_cause(e) is None:
                raise  # not the filesystem's: a bug, or non-finite weights (the caller's to say)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise SaveFailed(f"step-{step}-hf", write_fault(e)) from None
        final = self.folder / f"step-{step}-hf"
        if self.rank == 0:
            if final.exists() and not final.is_symlink():  # an earlier run's export of this step
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.folder)
        return final

    def wait(self) -> None:
        """Block until an async save in flight is written and visible; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            error = write_fault(e)
        self._finish(f"step-{pending.step}", pending.tmp, pending.meta, error, finalized=pending.finalized)

    def close(self) -> None:
        """Finish any async save; call once at the end of training, when every rank gets there.
        Not after an error on this rank alone: like every method here it is collective (a rank
        that fails just drops the save in flight; the next run deletes its temporary folder)."""
        self.wait()

    def _finish(self, name: str, tmp: Path, meta: dict[str, Any], error: str | None, *,
                finalized: bool = False) -> None:
        """After the shards of `name` (step-N, base) are written (or not): rank 0 makes it visible, and every
        rank learns whether that worked (in place of a barrier: rank 0's marker or rename can
        fail alone). A failure deletes the temporary folder and raises `SaveFailed` on all ranks.

        Raises:
            SaveFailed: writing or finalizing failed on some rank.
        """
        if error is None and self.rank == 0 and not finalized:
            try:
                self._finalize(name, tmp, meta)
            except OSError as e:
                error = write_fault(e)
        error = _job_error(_gather(error, self.group))
        if error is None:
            return
        self._discard(tmp)  # a failed save (full disk) leaves nothing behind to fail again
        raise SaveFailed(name, error)

    def _poll(self) -> None:
        p = self._pending
        # Only successful saves are finalized here; errors surface in wait() on every rank.
        if self.rank == 0 and p is not None and not p.finalized and p.future.done():
            if p.future.exception() is None:
                self._finalize(f"step-{p.step}", p.tmp, p.meta)
                p.finalized = True

    def _finalize(self, name: str, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0: marker, atomic rename to `name`/ (step-N, base), then prune old checkpoints."""
        marker = tmp / MARKER
        with open(marker, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        final = self.folder / name
        if final.exists() and not final.is_symlink():  # a link: the rename fails ("Not a directory")
            # A folder of the same step without a marker (never loaded) or an older save of
            # this step (e.g. a seed checkpoint written again): replaced by the new one.
            _remove_checkpoint(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        logger.info("checkpoint %s is complete: %s", name, final)
        if not meta["model_only"]:  # a seed checkpoint never prunes: not itself, not the others
            self._prune()

    def _prune(self) -> None:
        """Rank 0: delete complete checkpoints beyond keep_latest_k and stale temp folders."""
        if self.cfg.keep_latest_k > 0:
            for _, path in self.complete_checkpoints()[: -self.cfg.keep_latest_k]:
                logger.info("deleting old checkpoint %s (keep_latest_k=%d)", path, self.cfg.keep_latest_k)
                _remove_checkpoint(path)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Rank 0: delete the temporary folders of other runs' saves (killed or failed)."""
        for path in self.folder.iterdir():
            m = _TMP_DIR.match(path.name)
            if m and m.group("id") != self.id and path.is_dir() and not path.is_symlink():
                logger.info("deleting incomplete checkpoint %s left by an earlier run", path)
                shutil.rmtree(path, ignore_errors=True)

    def _discard(self, tmp: Path) -> None:
        """Rank 0: delete the temporary folder of this run's save that failed (DCP raised its
        error on every rank, so no rank is still writing into it)."""
        if self.rank == 0:
            logger.warning("checkpoint %s failed; deleted its temporary folder", tmp.name.split(".tmp-")[0])
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- loading -----------------------------------------------------------------------------

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step-N/` folder (not a link) holding the completion marker, oldest first."""
        return complete_checkpoints(self.folder)

    def _candidates(self) -> list[tuple[int, Path, bool]]:
        """(step, path, model_only) to try, newest first, as rank 0 sees them: every complete
        checkpoint but model-only exports (a seed's step-0 is model-only too, and is kept), or
        just step-`load_step`.

        Raises:
            ConfigError: `load_step` names no complete, resumable checkpoint.
        """
        found = []
        for step, path in reversed(self.complete_checkpoints()):
            try:
                meta = json_loads((path / MARKER).read_text())
            except (OSError, ValueError) as e:
                logger.warning("ignoring checkpoint %s: unreadable %s (%r)", path, MARKER, e)
                continue
            model_only = bool(meta.get("model_only"))
            if model_only and step > 0:  # last_save_model_only's export: no optimizer state to continue
                if self.cfg.load_step == step:
                    raise ConfigError("checkpoint.load_step", step, f"{path} holds only the weights (an export of "
                                      "last_save_model_only), no training state to resume",
                                      "name a full checkpoint, or load these weights with checkpoint.initial_load_path")
                logger.info("not resuming from %s: it holds only the weights (last_save_model_only)", path)
                continue
            found.append((step, path, model_only))
        if self.cfg.load_step < 0:
            return found
        chosen = [c for c in found if c[0] == self.cfg.load_step]
        if not chosen:
            saved = ", ".join(f"step-{step}" for step, _, _ in reversed(found)) or "none"
            raise ConfigError("checkpoint.load_step", self.cfg.load_step,
                              f"no complete checkpoint step-{self.cfg.load_step} in {self.folder} (found: {saved})",
                              "name one of those steps, or -1 for the newest")
        return chosen

    def _present(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """`state` less its optional entries the checkpoint at `path` lacks (`_optional_absent`):
        a checkpoint of an older version resumes, what it lacks keeping its fresh value."""
        if not any(getattr(part, "optional_in_checkpoints", False) for part in state.values()):
            return state
        metadata = read_dcp_metadata("checkpoint.folder", path, "", self.group)
        absent = _optional_absent(state, metadata.state_dict_metadata)
        if absent and self.rank == 0:
            logger.warning("checkpoint %s holds no %s (written by an older version): resuming without it",
                           path, ", ".join(absent))
        return {name: part for name, part in state.items() if name not in absent}

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest complete checkpoint into `state`; returns its step, None if none.

        A checkpoint that fails to load on any rank (truncated or corrupt file, one that does not
        match its checksum, missing keys, NaN or inf values, which no save writes) is reported with
        a warning and every rank tries the previous one. If every one fails this raises, rather
        than silently training from scratch. A `ConfigError` (the configuration cannot continue the
        checkpoint, e.g. another global batch size; a file that would run code, `UnsafeWeights`)
        is raised at once. A seed
        checkpoint (model only) loads only `state["model"]` and returns 0. Returns None when
        checkpointing is disabled.
        """
        if not self.cfg.enable:
            return None
        # Rank 0 decides (every rank raises its ConfigError), so that every rank tries the same
        # folders even on a filesystem whose directory listings lag between nodes.
        candidates = one_reads(self._candidates, self.group)
        errors = []
        excluded = set(self.cfg.exclude_from_loading)
        for step, path, model_only in candidates:
            to_load = {"model": state["model"]} if model_only else state
            to_load = {name: part for name, part in to_load.items() if name not in excluded}
            t0 = time.perf_counter()
            error = None
            try:
                to_load = self._present(to_load, path)
                dcp_load(to_load, path, self.group)
                bad = nonfinite_names(to_load)  # never saved so: damaged on disk, or by another program
                if bad:
                    error = f"the weights hold {NonFiniteValues(bad)}"
            except UnreadableWeights as e:
                error = e.problem
            except ConfigError:
                # The job's configuration cannot continue this run (another global batch size,
                # a changed dataset): older checkpoints of the run share the problem, so falling
                # back would only hide it.
                raise
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                error = describe(e)
            # DCP raises its read errors on every rank, but a Stateful's load_state_dict may fail
            # on one rank only: all ranks must move on to the same previous checkpoint.
            error = _job_error(_gather(error, self.group))
            if error is not None:
                errors.append(f"{path.name}: {error}")
                if self.rank == 0:  # every rank knows every rank's error: one line for the job
                    logger.warning("could not load checkpoint %s (%s); trying the previous one", path, error)
                continue
            logger.info(
                "resumed from %s%s in %.1fs", path, " (model only)" if model_only else "",
                time.perf_counter() - t0,
            )
            self._last_saved = step
            return step
        if errors:
            # A user-fixable state of the run's folder, not a bug: one message, exit 2.
            raise ConfigError("checkpoint.folder", str(self.folder),
                              "no checkpoint there could be loaded:" + "".join(f"\n  {e}" for e in errors),
                              "delete or move the broken step-N folders to start over")
        return None


def _optional_absent(state: dict[str, Any], keys: Any) -> list[str]:
    """The entries of `state` that may be missing from a checkpoint (``optional_in_checkpoints``:
    added after checkpoints of older versions were written) and that `keys` (its metadata's
    state_dict_metadata) lacks."""
    return [name for name, part in state.items() if getattr(part, "optional_in_checkpoints", False)
            and not any(key == name or key.startswith(f"{name}.") for key in keys)]


def _gather(error: str | None, group: dist.ProcessGroup | None) -> list[str | None]:
    """Every rank's `error` (None where it loaded), in rank order, gathered over `group`."""
    if not dist_on():
        return [error]
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return errors


def _job_error(errors: list[str | None]) -> str | None:
    """One line for the ranks' errors (None when every rank loaded): the error itself when every
    rank has it, else each error with the ranks that have it."""
    ranks: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error is not None:
            ranks.setdefault(error, []).append(rank)
    if not ranks:
        return None
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(errors):
        return next(iter(ranks))
    return "; ".join(f"rank {', '.join(map(str, rs))}: {error}" for error, rs in ranks.items())


def _remove_checkpoint(path: Path) -> None:
    # The marker goes first: if deletion is interrupted, the rest is never taken for complete.
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX: the directory entry itself must be synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems cannot sync a directory; the rename itself still holds
    finally:
        os.close(fd)
