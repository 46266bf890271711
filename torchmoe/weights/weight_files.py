"""Reading model weights from folders a user names: whatever is wrong with a file is one `ConfigError`.

    metadata = read_dcp_metadata(key, folder, fix)               # .metadata, checked (read by rank 0)
    problem = misfit(model.state_dict(), model_tensors(metadata), extra_ok=True)
    load_dcp(state, folder, metadata, key=key, fix=fix)          # checksums first; runs no code
    config = read_json_object(key, folder, "config.json", fix)
    with reading(key, folder, fix, what=name):                   # any other read: a fault -> ConfigError
        ...

Weights come from copies cut short, downloads that stopped, files of another kind. Reading such
a file, torch, pickle and safetensors raise what they raise (EOFError, UnpicklingError,
SafetensorError, an OSError...), under a process group wrapped in DCP's `CheckpointException`,
whose text is a traceback per rank. `read_fault` says in one line what is wrong with the file;
an exception of any other kind is a bug, and keeps its traceback.

While DCP loads it also logs, on the root logger and with the traceback, a metadata file it
cannot read ("Global metadata is not found ..."), before raising the error; with no handler
configured Python prints that record to stderr. `quiet_dcp_logs` drops DCP's records for the
duration of a read, so that a fault is reported once: as the `ConfigError`, or (resuming a run)
one warning.

Loading never runs code from a file (`dcp_unpickling`): a pickle in a DCP folder that names
anything but DCP's metadata classes or plain values is `UnsafeWeights`, a `ConfigError` that a
resume does not skip (a crafted file is not damage to step past). Every file of a DCP folder is
checked against the checksums recorded when it was saved (`checksums`): a mismatch is damage,
`UnreadableWeights`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_kinds import NotARegularFile, is_plain_name, read_regular, regular_fd
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import describe_os_error
from torchmoe.config.files.text import NotUTF8, utf8_text
from torchmoe.distributed.one_reader import one_reads
from torchmoe.weights import checksums
from torchmoe.weights.dcp_unpickling import RefusedPickle, SafeLoadPlanner, SafeReader, unpickle_metadata

__all__ = ["UnreadableWeights", "UnsafeWeights", "describe", "load_dcp", "misfit", "model_prefix",
           "model_tensors", "non_float", "quiet_dcp_logs", "read_dcp_metadata", "read_fault", "read_json_object",
           "reading"]

_DCP_SOURCE = os.path.dirname(dcp.__file__)


class UnreadableWeights(ConfigError):
    """Weights that cannot be read (`problem` says why, in one line): what every reader here
    raises, so that a caller probing several checkpoints can tell it from other `ConfigError`s."""


class UnsafeWeights(ConfigError):
    """A file that would run code if loaded (`RefusedPickle`): refused, never skipped for an older
    checkpoint, so that a crafted file is reported rather than stepped past."""


_UNSAFE_FIX = ("do not load it: DCP and torchmoe never write code into a checkpoint, so the file was crafted or "
               "altered; delete it, and load only checkpoints from a source you trust")


def _refused(err: BaseException) -> RefusedPickle | None:
    """The `RefusedPickle` that `err` is or holds (DCP wraps each rank's error), or None."""
    if isinstance(err, CheckpointException):
        return next((exc for exc, _ in err.failures.values() if isinstance(exc, RefusedPickle)), None)
    return err if isinstance(err, RefusedPickle) else None


def _first_line(err: BaseException, limit: int = 160) -> str:
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Where torch.load deserializes a file: whatever it raises there (garbage makes its unpickler raise
# IndexError, KeyError, ...) is a fault of the bytes it was given.
_DESERIALIZERS = (os.path.join("torch", "serialization.py"), os.path.join("torch", "_weights_only_unpickler.py"))


def read_fault(err: BaseException, what: str = "a file") -> str | None:
    """One line saying what is wrong with the file(s) `what` that raised `err` while being read,
    or None when `err` is no fault of a file (a bug). An OSError names its file itself."""
    if isinstance(err, CheckpointException):  # failures: rank -> (exception, its traceback)
        faults = [_fault(exc, trace, what) for exc, trace in err.failures.values()]
        # Every rank usually fails on the same file in the same way: said once.
        return None if None in faults else "; ".join(dict.fromkeys(faults))
    return _fault(err, traceback.extract_tb(err.__traceback__), what)


def _fault(err: BaseException, trace: traceback.StackSummary, what: str) -> str | None:
    if isinstance(err, OSError):  # the OS's reason, with the file it names
        return describe_os_error(err) if err.strerror else f"{what} cannot be read: {_first_line(err)}"
    if isinstance(err, EOFError):
        return f"{what} ends early: it is truncated"
    if isinstance(err, UnicodeDecodeError):
        return f"{what} is not UTF-8 text (byte {err.start} is {err.object[err.start:err.start + 1]!r})"
    if isinstance(err, (pickle.UnpicklingError, SafetensorError)) or (
            isinstance(err, RuntimeError) and str(err).startswith("PytorchStreamReader")):  # torch.load's zip reader
        return f"{what} is damaged or truncated ({_first_line(err).split('. ')[0]})"
    if any(frame.filename.endswith(_DESERIALIZERS) for frame in trace):
        return f"{what} is damaged or truncated (torch.load failed: {type(err).__name__})"
    if isinstance(err, ValueError):  # a reader's own check (HFConversionError is one): a sentence already
        return _first_line(err)
    return None


def describe(err: BaseException) -> str:
    """One line for any failure while loading a checkpoint: its `read_fault`, else the exception's
    type and first line (without the tracebacks a `CheckpointException` holds)."""
    if isinstance(err, CheckpointException):
        return "; ".join(dict.fromkeys(describe(exc) for exc, _ in err.failures.values()))
    return read_fault(err) or f"{type(err).__name__}: {_first_line(err)}"


class _DropDCPRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(_DCP_SOURCE)


@contextmanager
def quiet_dcp_logs() -> Iterator[None]:
    """Drop what DCP logs on the root logger (tracebacks of the errors it then raises) meanwhile."""
    root, drop = logging.getLogger(), _DropDCPRecords()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


@contextmanager
def reading(key: str, path: str | os.PathLike, fix: str, *, what: str = "a file") -> Iterator[None]:
    """Read weights from `path` (the value of `key`): a fault of the file(s) `what` becomes one
    `UnreadableWeights` naming `key`, `path` and `fix`, a refused pickle one `UnsafeWeights`; DCP's
    logs are quiet meanwhile. A `ConfigError` raised meanwhile (a Stateful's `load_state_dict`
    refusing the state for the job's settings) is no fault of the files and keeps its own message."""
    with quiet_dcp_logs():
        try:
            yield
        except ConfigError:  # a Stateful refusing what it loads (a changed dataset): said in full
            raise
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            refused = _refused(err)
            if refused is not None:
                raise UnsafeWeights(key, str(path), str(refused), _UNSAFE_FIX) from None
            fault = read_fault(err, what)
            if fault is None:
                raise
            raise UnreadableWeights(key, str(path), fault, fix) from None


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def read_json_object(key: str, folder: Path, name: str, fix: str) -> dict:
    """The JSON object in `folder/name` (a config.json, an index), as a dict.

    Raises:
        UnreadableWeights: the file is missing, unreadable, not UTF-8 (a byte order mark names its
            encoding), not JSON or not an object.
    """
    path = folder / name
    if not path.exists():
        raise UnreadableWeights(key, str(folder), f"has no {name}", fix)
    with reading(key, folder, fix, what=name):
        data = read_regular(path)
    try:
        # Not `finite`: each number of config.json is checked by the field that reads it, which the
        # message then names (transformers writes NaN and Infinity as Python's json does).
        value = json_loads(utf8_text(data, nul=False), finite=False)
    except NotUTF8 as err:
        raise UnreadableWeights(key, str(folder), f"{name} {err.problem}", err.fix(path)) from None
    except json.JSONDecodeError as err:
        raise UnreadableWeights(key, str(folder), f"{name} is not JSON ({err.msg} at line {err.lineno} "
                                f"column {err.colno})", fix) from None
    if not isinstance(value, dict):
        raise UnreadableWeights(key, str(folder), f"{name} holds {_JSON_TYPES[type(value)]}, not a JSON object", fix)
    return value


def read_dcp_metadata(key: str, folder: Path, fix: str, group: dist.ProcessGroup | None = None) -> Metadata:
    """The `.metadata` of the DCP checkpoint `folder`, unpickled safely (`unpickle_metadata`).
    Collective under a process group (`group`, default the world): rank 0 reads the file, its
    recorded checksum and the size of every data file, and the others receive the metadata
    (`distributed.one_reader`: on a shared file system every rank reading it is a storm of
    requests for the same answer).

    Raises:
        UnreadableWeights: it is missing, unreadable, damaged (by its recorded checksum too), or
            holds something else; a data file it points into is missing or too short.
        UnsafeWeights: it would run code.
    """
    return one_reads(lambda: _read_dcp_metadata(key, folder, fix), group)


def _read_dcp_metadata(key: str, folder: Path, fix: str) -> Metadata:
    if not (folder / ".metadata").exists():
        raise UnreadableWeights(key, str(folder), "not a DCP checkpoint (no .metadata)", fix)
    with reading(key, folder, fix, what=".metadata"):
        data = read_regular(folder / ".metadata")
    problem = checksums.metadata_fault(folder, data)  # before unpickling it: damage is not a refusal
    if problem is not None:
        raise UnreadableWeights(key, str(folder), problem, fix)
    with reading(key, folder, fix, what=".metadata"):
        metadata = unpickle_metadata(data)
    if not isinstance(metadata, Metadata):
        raise UnreadableWeights(key, str(folder), ".metadata is not DCP metadata (a pickle of something else)", fix)
    problem = _data_files_fault(folder, metadata)
    if problem is not None:
        raise UnreadableWeights(key, str(folder), problem, fix)
    return metadata


def _data_files_fault(folder: Path, metadata: Metadata) -> str | None:
    """Why a data file that `metadata` points into cannot hold the bytes it points at (it is
    missing, a folder, or shorter), or None. DCP reads only the byte ranges it loads: a file cut
    short may load some tensors and fail on others, or, when only the model of a step-N folder is
    loaded, not fail at all. Its size names it before any load."""
    ends = _data_ends(metadata)
    for name, end in sorted(ends.items()):
        if not is_plain_name(name):
            return f".metadata points at the data file {name!r}, which is not a file of this folder: it was altered " \
                   "or crafted"
        try:
            fd = regular_fd(folder / name)  # the OS says what else is wrong with it
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except (OSError, NotARegularFile) as err:
            return read_fault(err)
        if size < end:
            return f"{name} is truncated ({size} bytes; the checkpoint's data needs {end})"
    return None


def _data_ends(metadata: Metadata) -> dict[str, int]:
    """Data file -> the end of the last byte range `metadata` points at in it."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        if hasattr(info, "relative_path"):  # FileSystemWriter's entries: (file, offset, length)
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def load_dcp(state: dict, folder: Path, metadata: Metadata, *, key: str, fix: str,
             planner: SafeLoadPlanner | None = None, group: dist.ProcessGroup | None = None) -> None:
    """`dcp.load` of `state` from the DCP folder `folder`, whose `metadata` `read_dcp_metadata`
    returned: every data file first checked against its recorded checksum (each rank a share), then
    loaded without unpickling anything but plain values (`SafeLoadPlanner`, or `planner`, one of
    its kind). Collective under a process group (`group`, default the world).

    Raises:
        UnreadableWeights: a data file does not match its checksum, or is missing or damaged.
        UnsafeWeights: a stored value would run code.
    """
    problem = checksums.verify(folder, sorted(_data_ends(metadata)), group)
    if problem is not None:
        raise UnreadableWeights(key, str(folder), problem, fix)
    with reading(key, folder, fix, what="a *.distcp file"):
        dcp.load(state, storage_reader=SafeReader(folder, metadata), planner=planner or SafeLoadPlanner(),
                 process_group=group, no_dist=not dist.is_initialized())


def model_prefix(metadata: Metadata) -> str:
    """"model." for a torchmoe step-N folder (the model next to optimizer, data and RNG state),
    "" for a bare model state dict (`torchmoe convert hf-to-dcp`)."""
    return "model." if any(k.startswith("model.") for k in metadata.state_dict_metadata) else ""


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """Name (without `model_prefix`) -> stored metadata of the model tensors of a DCP checkpoint."""
    prefix = model_prefix(metadata)
    return {k.removeprefix(prefix): v for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def misfit(expected: Mapping[str, torch.Tensor], stored: Mapping[str, TensorStorageMetadata], *,
           extra_ok: bool) -> str | None:
    """Why the `stored` tensors are not those of a model with tensors like `expected` (meta
    tensors will do), or None: one is missing or of another shape, or (unless `extra_ok`: a
    pipeline stage loads only its own) one has no place in the model."""
    for name, tensor in expected.items():  # first: another model's tensors mostly differ in shape
        if name in stored and tuple(stored[name].size) != tuple(tensor.shape):
            return f"{name} has shape {tuple(stored[name].size)}, the model's is {tuple(tensor.shape)}"
    missing = sorted(set(expected) - set(stored))
    if missing:
        return f"it lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}"
    extra = sorted(set(stored) - set(expected))
    if extra and not extra_ok:
        return f"it holds {len(extra)} tensors the model does not have, e.g. {extra[:3]}"
    return None


def non_float(expected: Mapping[str, torch.Tensor], stored: Mapping[str, TensorStorageMetadata]) -> str | None:
    """Why a stored tensor cannot become one of `expected`'s floating-point tensors (it is stored
    as integers: not weights, or quantized ones, which a cast would turn into nonsense), or None.
    `stored` holds every tensor of `expected` (`misfit` found none missing)."""
    for name, tensor in expected.items():
        dtype = stored[name].properties.dtype
        if tensor.dtype.is_floating_point and not dtype.is_floating_point:
            return f"{name} is stored as {str(dtype).removeprefix('torch.')}, not as floating-point weights"
    return None
