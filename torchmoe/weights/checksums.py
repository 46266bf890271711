"""A checksum of every file of a DCP folder, recorded when it is written and checked before it loads.

    dcp.save(state, storage_writer=ChecksummingWriter(folder))   # writes folder/.checksums.json too
    problem = verify(folder, ["__0_0.distcp", ...], group)       # collective; None: all match
    problem = metadata_fault(folder, metadata_bytes)             # the .metadata, before unpickling it

Flipped bytes in a `.distcp` file load without an error (DCP reads byte ranges; torch's zip reader
does not check its CRCs) and change the numbers the run trains on. So every file gets an xxh3_64
digest (`xxhash`, ~10 GB/s on one core) as it is written: each rank hashes its own files while
writing them (no second read), the digests reach rank 0 with DCP's gathered write results, and
rank 0 records them, with that of `.metadata`, in `.checksums.json` next to it, before the save
finishes (so before a checkpoint folder is renamed into place). `verify` checks them before a
load, each rank hashing a share of the files (rank 0 reads the sidecar for all).

A folder without `.checksums.json` (written before torchmoe recorded checksums, or by another
tool) loads unverified, with a log line that says so.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchmoe.config.files.digests import ALGORITHM, digest_file
from torchmoe.config.files.file_kinds import read_regular
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import describe_os_error
from torchmoe.distributed.one_reader import one_reads

__all__ = ["ALGORITHM", "SIDECAR", "ChecksummingWriter", "digest_file", "metadata_fault", "verify"]

logger = logging.getLogger(__name__)

SIDECAR = ".checksums.json"


# ---- writing ---------------------------------------------------------------------------------------


class _HashingStream:
    """A file opened for writing that hashes what is written through it. DCP writes every file
    front to back (each item appended, `tell` for its offset), so the digest is the file's."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._hash = xxhash.xxh3_64()

    def write(self, data: Any) -> int:
        self._hash.update(data)
        return self._raw.write(data)

    def seek(self, *args: Any) -> int:
        raise OSError("a checksummed checkpoint file is written front to back")  # would break the digest

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close
        return getattr(self._raw, name)


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, recording the digest of every file written: name -> hex digest
    (a rename carries the digest to the new name)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        self.digests[Path(path).name] = hashing.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.digests:
            self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


@dataclass(frozen=True)
class _HashedResult(WriteResult):
    """DCP's write result of one item, with the digest of the file it went into: how the digests
    of every rank's files reach rank 0 (DCP gathers the results there for `finish`)."""

    file_digest: str


class ChecksummingWriter(FileSystemWriter):
    """torch's `FileSystemWriter` that also writes `.checksums.json`: {"algorithm": "xxh3_64",
    "files": {name: digest}} for every data file of every rank and `.metadata` (module docstring).
    Use one writer per save."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # FileSystemWriter writes before returning (its future is already done).
        results = super().write_data(plan, planner).wait()
        hashed: Future[list[WriteResult]] = Future()
        hashed.set_result([_HashedResult(r.index, r.size_in_bytes, r.storage_data,
                                         self.fs.digests[r.storage_data.relative_path]) for r in results])
        return hashed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0, once every rank has written: `.metadata` (torch), then the digests."""
        files = {r.storage_data.relative_path: r.file_digest for rank in results for r in rank}
        super().finish(metadata, results)
        files.update(self.fs.digests)  # .metadata, and this rank's files again
        tmp, final = Path(self.path) / f"{SIDECAR}.tmp", Path(self.path) / SIDECAR
        with open(tmp, "w") as f:
            json.dump({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, f, indent=1)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, final)


# ---- checking --------------------------------------------------------------------------------------


def _recorded(folder: Path) -> dict[str, str] | None:
    """name -> digest from `folder`'s sidecar; None when there is none.

    Raises:
        ValueError: (its message says what is wrong) the sidecar is not one this module wrote, or
            not a regular file.
        OSError: it cannot be read.
    """
    path = folder / SIDECAR
    if not path.exists():
        return None
    try:
        record = json_loads(read_regular(path).decode("utf-8"))  # NotARegularFile: a ValueError
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{SIDECAR} is damaged (not JSON)") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or record.get("algorithm") != ALGORITHM:
        raise ValueError(f"{SIDECAR} is damaged (no {ALGORITHM} digests)")
    return files


def _recorded_or_fault(folder: Path) -> tuple[dict[str, str] | None, str | None]:
    """(`_recorded(folder)`, None), or (None, what is wrong with the sidecar)."""
    try:
        return _recorded(folder), None
    except ValueError as err:
        return None, str(err)
    except OSError as err:
        return None, describe_os_error(err)


def _mismatch(name: str, digest: str, recorded: dict[str, str]) -> str | None:
    if name not in recorded:
        return f"{name} has no checksum in {SIDECAR}: the folder's files are not the ones it was saved with"
    if digest != recorded[name]:
        return (f"{name} does not match the checksum recorded when it was saved ({ALGORITHM} {digest}, "
                f"recorded {recorded[name]}): it changed on disk")
    return None


def metadata_fault(folder: Path, data: bytes) -> str | None:
    """Why `data`, the bytes of `folder/.metadata`, are not what was saved, or None (they are, or
    no checksums were recorded)."""
    recorded, problem = _recorded_or_fault(folder)
    if problem is not None or recorded is None:
        return problem
    return _mismatch(".metadata", xxhash.xxh3_64_hexdigest(data), recorded)


def verify(folder: Path, names: list[str], group: dist.ProcessGroup | None = None) -> str | None:
    """Check the files `names` of `folder` against its recorded checksums: collective under a
    process group (rank 0 reads the checksums, every rank hashes every world_size-th file, then
    all agree).

    Returns:
        What is wrong (a file that does not match), the same on every rank; None when every file
        matches or none were recorded (logged).
    """
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    recorded, problem = one_reads(lambda: _recorded_or_fault(folder), group)  # rank 0 reads the sidecar
    if recorded is None and problem is None and rank == 0:
        logger.info("%s has no %s (saved before torchmoe recorded checksums, or by another tool): "
                    "loading it unverified", folder, SIDECAR)
    try:
        for name in sorted(names)[rank::world] if recorded is not None else ():
            problem = _mismatch(name, digest_file(folder / name), recorded)
            if problem is not None:
                break
    except OSError as err:
        problem = describe_os_error(err)
    if dist.is_initialized():
        problems: list[str | None] = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        problem = next((p for p in problems if p is not None), None)
    return problem
