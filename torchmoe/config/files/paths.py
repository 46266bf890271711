"""The files and folders a user names: whatever the OS refuses about one is one `ConfigError`.

    with path_faults("--config", path, fix):       # where the key is known: any OSError -> ConfigError
        data = Path(path).read_bytes()
    with user_path_faults(job_paths(cfg)):          # the net: the key is found from the path
        train(cfg)

A fault is anything the OS says about a path (`OSError`): missing, a folder where a file is
read or written, a file where a folder is, a path through a file, a name too long, a symbolic
link to nothing, no permission, an I/O error. The message names the key, its value, the path
the OS refused where that is another (a file in the named folder, a folder under the dump
folder) and the OS's own reason (`strerror`), plus what those words leave out: the file in the
way of "Not a directory", the missing target of a symbolic link.

Checks that look before the run reads or writes (`writable_folder`, `writable_file`) make the
OS call itself rather than ask `Path.exists()` / `is_dir()`, which answer False for some faults
(a path through a file, a dangling link) and raise for others (a name too long, no permission).
"""

from __future__ import annotations

import errno
import glob
import itertools
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig

__all__ = ["FULL_FIX", "free_folder_name", "PATH_KEYS", "READ_KEYS", "WRITE_FIX", "WRITTEN_FOLDER_KEYS", "UserPath", "describe_os_error",
           "job_paths", "key_value", "nonempty_path", "path_fault", "path_faults", "replica_group_config", "source_key",
           "user_path_faults", "writable_file", "writable_folder", "written_folders"]


# ---- the path-valued keys ----------------------------------------------------------------------

# The folders a run writes into: the dump folder, and the folders under it (each may be absolute).
WRITTEN_FOLDER_KEYS = ("job.dump_folder", "checkpoint.folder", "metrics.save_tb_folder",
                       "profiling.save_traces_folder", "profiling.save_memory_snapshot_folder",
                       "comm.save_traces_folder")
# What a run reads; "" means "not set" for each (the byte tokenizer, random weights, no dataset).
READ_KEYS = ("model.hf_assets_path", "model.tokenizer_path", "checkpoint.initial_load_path",
             "training.dataset_path", "validation.dataset_path")
PATH_KEYS = WRITTEN_FOLDER_KEYS + READ_KEYS


def nonempty_path(key: str, value: str, fix: str, *, means: str = "the current directory") -> str:
    """`value`, unless it is empty or blank: a path no one types, but what an unset shell variable
    gives (``--job.dump_folder "$RUN"``), and which the OS takes for `means`.

    Raises:
        ConfigError: naming `key`, with `fix`.
    """
    if not value.strip():
        raise ConfigError(key, value, f"an empty path (an unset shell variable?), which would mean {means}", fix)
    return value


# ---- the message -------------------------------------------------------------------------------


def _filename(err: OSError) -> str | None:
    """The path `err` is about, if it names one (some calls name a file descriptor instead)."""
    return os.fsdecode(err.filename) if isinstance(err.filename, (str, bytes, os.PathLike)) else None


def describe_os_error(err: OSError, value: str | None = None) -> str:
    """What the OS said about a path given as `value`: ``[path: ]reason[ (what is in the way)]``,
    the path only where it is not `value` itself."""
    reason = err.strerror or str(err)
    path = _filename(err)
    if path is None:
        return reason
    where = "" if value is not None and os.path.abspath(path) == os.path.abspath(value) else f"{path}: "
    return f"{where}{reason}{_in_the_way(path, err)}"


def _in_the_way(path: str, err: OSError) -> str:
    """What the OS's reason leaves out: a symbolic link whose target does not exist (for "No such
    file or directory", or "File exists" from a mkdir), or (for "Not a directory") the file that
    sits where a folder of the path should be."""
    if err.errno in (errno.ENOENT, errno.EEXIST) and os.path.islink(path) and not os.path.exists(path):
        return f" ({path} is a symbolic link to {os.readlink(path)}, which does not exist)"
    if err.errno == errno.ENOTDIR:
        for part in (*reversed(Path(path).parents), Path(path)):
            if os.path.exists(part) and not os.path.isdir(part):
                return f" ({part} is a file)"
    return ""


# A full filesystem is fixed by space, not by another path or permissions.
_FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_FIX = "free space on that filesystem (or use a folder on another one), then run again"


def path_fault(key: str, value: str, err: OSError, fix: str, *,
               error: type[ConfigError] = ConfigError) -> ConfigError:
    """The `error` (a `ConfigError` kind) for `err`, raised about the path that `key` = `value` names;
    for a full disk the fix is `FULL_FIX` whatever `fix` says."""
    return error(key, value, describe_os_error(err, value), FULL_FIX if err.errno in _FULL else fix)


@contextmanager
def path_faults(key: str, value: str, fix: str, *, error: type[ConfigError] = ConfigError) -> Iterator[None]:
    """Any `OSError` raised meanwhile is a fault of the path `key` = `value`: `path_fault`."""
    try:
        yield
    except OSError as err:
        raise path_fault(key, value, err, fix, error=error) from None


# ---- the net: which key a path belongs to ------------------------------------------------------


@dataclass(frozen=True)
class UserPath:
    """A path the user named.

    Attributes:
        key: as the user spells it (``job.dump_folder``, ``--out``, ``HF_DIR``).
        value: what the user gave.
        path: where that is: `value`, or under the dump folder for the keys relative to it; a
            glob's folder part.
        fix: what to do when the OS refuses the path or something under it.
    """

    key: str
    value: str
    path: str
    fix: str

    def holds(self, filename: str) -> bool:
        """Whether `filename` is this path or lies under it."""
        mine, theirs = os.path.abspath(self.path), os.path.abspath(filename)
        return theirs == mine or theirs.startswith(mine.rstrip(os.sep) + os.sep)


_UNNAMED_FIX = "check the path and its permissions (this user must be able to read, or create and write, it)"


@contextmanager
def user_path_faults(paths: Sequence[UserPath]) -> Iterator[None]:
    """The net: an `OSError` about a file raised meanwhile becomes a `ConfigError` naming the key
    of the innermost of `paths` that holds it (or, for a path no key names, ``path``). One without
    a file name (a socket, a store) is no file fault and propagates."""
    try:
        yield
    except OSError as err:
        filename = _filename(err)
        if filename is None:
            raise
        owners = [p for p in paths if p.holds(filename)]
        if not owners:
            raise path_fault("path", filename, err, _UNNAMED_FIX) from None
        owner = max(owners, key=lambda p: len(os.path.abspath(p.path)))  # the first of the innermost
        raise path_fault(owner.key, owner.value, err, owner.fix) from None


def _folder_part(value: str) -> str:
    """The part of a path before its first glob pattern (`data/**/*.jsonl` -> `data`)."""
    parts = Path(value).parts
    literal = parts[:next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))]
    return str(Path(*literal)) if literal else "."


# What `model.hf_assets_path` fills where it is not given (`loader._with_hf_assets`).
_FILLED_BY_ASSETS = ("model.tokenizer_path", "checkpoint.initial_load_path")


def source_key(cfg: JobConfig, key: str) -> str:
    """The key the user set for the path in `key`: ``model.hf_assets_path`` where its value filled
    `key` (the tokenizer, the Hugging Face weights to load), else `key`."""
    value = key_value(cfg, key)
    assets = cfg.model.hf_assets_path
    return "model.hf_assets_path" if key in _FILLED_BY_ASSETS and assets and value == assets else key


WRITE_FIX = "use a folder this user can create and write, or move what is in the way"
_READ_FIX = {
    "model.hf_assets_path": "point it at a Hugging Face model folder this user can read",
    "model.tokenizer_path": "point it at a tokenizer.json this user can read, or a folder holding one; or leave "
                            "it empty for the built-in byte tokenizer",
    "checkpoint.initial_load_path": "point it at a checkpoint folder this user can read (DCP, or Hugging Face with "
                                    "initial_load_in_hf), or leave it empty to start from random weights",
    "training.dataset_path": "point it at .txt/.jsonl/.json/.parquet files this user can read, a folder of "
                             "them or a glob",
    "validation.dataset_path": "point it at .txt/.jsonl/.json/.parquet files this user can read, a folder of "
                               "them or a glob",
}


def replica_group_config(cfg: JobConfig) -> JobConfig:
    """`cfg` with ``job.dump_folder`` = ``<job.dump_folder>/replica_<replica_id>`` under fault
    tolerance: every replica group is a launch of its own, and each owns its folder (metrics,
    checkpoints, data positions; the run lock refuses two launches in one). Without it, `cfg`."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return cfg
    return replace(cfg, job=replace(cfg.job, dump_folder=str(Path(cfg.job.dump_folder) / f"replica_{ft.replica_id}")))


def job_paths(cfg: JobConfig) -> list[UserPath]:
    """Every path-valued key of `cfg` that is set: the dump folder, the folders the run writes
    under it (each may also be absolute), and what the run reads."""
    dump = cfg.job.dump_folder
    paths = [UserPath("job.dump_folder", dump, dump, WRITE_FIX)]
    paths += [UserPath(key, value, os.path.join(dump, value), WRITE_FIX) for key in WRITTEN_FOLDER_KEYS[1:]
              if (value := key_value(cfg, key))]
    # model.hf_assets_path comes first: where it filled another key, the path is the same.
    paths += [UserPath(key, value, _folder_part(value), _READ_FIX[key]) for key in READ_KEYS
              if (value := key_value(cfg, key))]
    return paths


def written_folders(cfg: JobConfig, *, nccl_traces: bool) -> list[UserPath]:
    """The folders this run writes into: the dump folder, and each folder under it (or elsewhere,
    for an absolute key) that the run uses; `nccl_traces`: the NCCL flight recorder dumps into
    comm.save_traces_folder (a multi-rank CUDA run with a trace buffer)."""
    # Even load_only deletes failed saves' leftovers; last_save_in_hf exports there without checkpoints.
    used = {"checkpoint.folder": cfg.checkpoint.enable or cfg.checkpoint.last_save_in_hf,
            "metrics.save_tb_folder": cfg.metrics.enable_tensorboard,
            "profiling.save_traces_folder": cfg.profiling.enable_profiling or cfg.profiling.enable_step_breakdown,
            "profiling.save_memory_snapshot_folder": cfg.profiling.enable_memory_snapshot,
            "comm.save_traces_folder": nccl_traces and cfg.comm.trace_buf_size > 0}
    return [p for p in job_paths(cfg) if p.key == "job.dump_folder" or used.get(p.key, False)]


def key_value(cfg: JobConfig, key: str) -> str:
    """The value of ``section.key`` in `cfg`."""
    section, _, leaf = key.partition(".")
    return getattr(getattr(cfg, section), leaf)


# ---- looking before writing --------------------------------------------------------------------


def free_folder_name(folder: str) -> str:
    """`folder` when nothing has that name (nor a link), else the first of `folder`-2, -3, ... that
    is free: a folder of its own to suggest for a run (a fix, `torchmoe plan --out`'s job)."""
    base = folder.rstrip("/") or folder
    if not os.path.lexists(base):
        return folder
    return next(f"{base}-{n}" for n in itertools.count(2) if not os.path.lexists(f"{base}-{n}"))


def writable_folder(folder: Path, *, create: bool = True) -> Path:
    """`folder`, or the nearest ancestor that exists (where the writer creates the rest), once this
    process has created a file in it; creates nothing that stays. Writes and deletes one empty file
    to find out: permission bits do not tell (root, read-only mounts, ACLs). Without `create`
    asks the kernel instead (`access`: permissions and read-only mounts; ACLs and an NFS server's
    root squashing only the probe finds), for ranks whose node's first rank creates the file.

    Raises:
        OSError: what the OS says: a file in the way, a symbolic link to nothing (a writer's mkdir
            would fail on it), a name too long, no permission.
    """
    existing = folder
    while True:
        try:
            os.stat(existing)
            break
        except FileNotFoundError:
            if os.path.islink(existing) or existing == existing.parent:
                raise
            existing = existing.parent
    # Unique across nodes too: ranks of one job on two nodes (or in two pid namespaces) share
    # pids, and a pid alone let one rank's O_EXCL meet another's probe ("File exists").
    probe = existing / f".torchmoe-write-check-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        if create:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # "Not a directory" for a file
        elif not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        elif not os.access(existing, os.W_OK | os.X_OK):  # EROFS or EACCES, as the create's
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as err:  # about the folder, not the probe's made-up name
        raise OSError(err.errno, f"cannot create files in it: {err.strerror}{_kernel_file_system(existing)}",
                      str(existing)) from None
    if create:
        os.unlink(probe)
    return existing


# File systems the kernel makes up (processes, devices, cgroups...): nobody creates files there,
# and the OS's reason says otherwise ("No such file or directory" in /proc, "Permission denied"
# to root in /sys).
_KERNEL_FILE_SYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf",
                        "pstore", "efivarfs", "devpts", "mqueue", "binfmt_misc", "fusectl", "autofs"}


def _kernel_file_system(folder: Path) -> str:
    """" (it is on a proc file system, ...)" when `folder` lies on one of the kernel's own file
    systems (the mount table, /proc/self/mounts, says: Linux), else ""."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return ""
    path = os.path.realpath(folder)
    # The innermost mount point holding the folder; the table escapes a space in a name as \040.
    holding = [(point.replace("\\040", " "), kind) for point, kind in mounts
               if path == point or path.startswith(point.rstrip("/") + "/")]
    if not holding:
        return ""
    kind = max(holding, key=lambda m: len(m[0]))[1]
    return f" (it is on a {kind} file system, which the kernel provides: no files can be created there)" \
        if kind in _KERNEL_FILE_SYSTEMS else ""


def writable_file(file: Path) -> None:
    """A file a writer replaces or appends to must open for writing where it exists (not a folder,
    not read-only); opening without O_CREAT changes and creates nothing. A missing file is fine
    (its folder is `writable_folder`'s to check), a symbolic link to nothing is not.

    Raises:
        OSError: what the OS says.
    """
    try:
        os.close(os.open(file, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except FileNotFoundError:
        if os.path.islink(file):
            raise
