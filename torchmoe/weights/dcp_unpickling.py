"""Unpickling what a DCP folder holds without running code from it.

    metadata = unpickle_metadata(path.read_bytes(), ".metadata")   # DCP's metadata classes only
    reader = SafeReader(folder, metadata)                          # hands DCP that, reads no pickle
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())

A DCP folder holds two kinds of pickle. `.metadata` is one, which torch's `FileSystemReader`
loads with `pickle.load`: a crafted one runs any code it names, and may still return valid
metadata so that the run goes on as if nothing happened. Values that are not tensors (optimizer
param groups, the LR scheduler's and the data loader's counters, Python's RNG state) are stored
as `torch.save` bytes inside the `.distcp` files, which DCP's `DefaultLoadPlanner` loads with
`torch.load(weights_only=False)`: the same hole. (Tensors DCP already reads with
`weights_only=True`.)

Here `.metadata` goes through an unpickler that resolves only the classes DCP itself pickles
there (listed in `_METADATA_GLOBALS`: what torch 2.13 writes for every checkpoint torchmoe saves:
every layout, sync and async, model-only exports, `torchmoe convert hf-to-dcp`), and stored
values through `torch.load(weights_only=True)`, which allows plain containers, numbers, strings
and tensors. Anything else is refused with `RefusedPickle`, naming the file and what it asked
for, before it is called.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from torchmoe import _torch_private as private

__all__ = ["KnownMetadata", "RefusedPickle", "SafeLoadPlanner", "SafeReader", "StoredValueRefused", "unpickle_metadata",
           "value_fault"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

# (module, name) of every global DCP's `.metadata` refers to. The dataclasses and the enum of
# TensorProperties' memory format; FileSystemWriter's per-item (file, offset, length); shapes and
# offsets (torch.Size); TensorProperties' layout (looked up by name); the checkpoint's own path
# (StorageMeta.checkpoint_id, a pathlib path; `pathlib._local` is its module where pathlib is a
# package, Python 3.13+).
# Dtypes are `_DTYPES`.
_METADATA_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
})
# torch.float32 and the like pickle as a reference to the attribute of `torch` (no call).
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class RefusedPickle(Exception):
    """A pickle in a checkpoint names a global it must not (a function to call, a class to build):
    refused before anything was called.

    Args:
        file: the file holding it, as named in the checkpoint folder (``.metadata``, ``__0_0.distcp``).
        offender: the global it asked for (``posix.system``).
        where: which value of the file, when not the whole file.
    """

    def __init__(self, file: str, offender: str, where: str = "") -> None:
        super().__init__(f"{file}{f' ({where})' if where else ''} asks to load {offender}, which a checkpoint never "
                         "holds: refused, nothing of it was run")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: str) -> None:
        super().__init__(io.BytesIO(data))
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        # Every global a pickle refers to passes here (GLOBAL, STACK_GLOBAL, INST, OBJ, the copyreg
        # extension codes); persistent ids are refused by the base class.
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise RefusedPickle(self.file, f"{module}.{name}")


def unpickle_metadata(data: bytes, file: str = ".metadata") -> Any:
    """Unpickle the bytes of a DCP `.metadata` (`file` names it in errors), resolving only DCP's
    metadata classes. The result is whatever those build: the caller checks it is a `Metadata`.

    Raises:
        RefusedPickle: it refers to anything else.
        EOFError: the bytes end early.
        pickle.UnpicklingError: they are damaged (pickle's own error, or whatever else pickle
            raised for them: a KeyError, an IndexError...).
    """
    try:
        return _MetadataUnpickler(data, file).load()
    except (RefusedPickle, EOFError, pickle.UnpicklingError):
        raise
    except Exception as err:  # noqa: BLE001 - garbage makes pickle raise almost anything
        raise pickle.UnpicklingError(f"{type(err).__name__}: {err}") from err


# torch's weights_only unpickler names the global it refused in these words.
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refused_global(err: pickle.UnpicklingError) -> str | None:
    """The global that torch.load(weights_only=True) refused to load, as `err` names it, or None
    (the bytes were damaged)."""
    found = _REFUSED_GLOBAL.search(str(err))
    return found.group(1) if found else None


class KnownMetadata:
    """For a DCP storage reader (listed before it among the bases): `read_metadata` hands DCP the
    `metadata` given to the reader, read once by the caller (by one rank for all:
    `distributed.one_reader`), instead of reading the folder again on every rank and every
    call."""

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # What torch's readers do after reading it: tag the metadata with this load's id.
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeReader(KnownMetadata, FileSystemReader):
    """torch's `FileSystemReader` for `path`, except that it never unpickles `.metadata` itself:
    it hands DCP the `metadata` the caller read with `unpickle_metadata` (DCP's fallback to a
    rank-local `__<rank>.metadata` when reading the global one fails is gone with it). Tensors it
    reads as torch does, with `torch.load(weights_only=True)`; one that names another global is
    a `RefusedPickle` of its file."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # torch reads file by file; here one file per call, so that a refusal names its file.
        files: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            files.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in files.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as err:
                offender = _refused_global(err)
                if offender is None:
                    raise
                raise RefusedPickle(name, offender) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class StoredValueRefused(ValueError):
    """A stored plain value unlike the one it would replace (`value_fault`), in one sentence."""


_INT64 = 2**63


def _kind(value: Any) -> str:
    return {bool: "a boolean", str: "a string", type(None): "None", tuple: "a tuple", list: "a list",
            dict: "a dict"}.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def value_fault(template: Any, obj: Any) -> str | None:
    """Why `obj`, loaded from a checkpoint, cannot replace `template`, the value of this run in
    its place, or None: a boolean, string or number where `template` is one (any number for a
    number: an int setting may have been a float in the run that saved), finite and within 64
    bits; a tuple of as many items, each in kind; a list (of any length) or dict whose items
    are in kind. Where
    `template` is None (or a tensor, which DCP reads itself) anything plain will do; None is
    taken for a float (Python's RNG state holds one or the other)."""
    if template is None or isinstance(template, torch.Tensor):
        return None
    if isinstance(template, bool) or isinstance(obj, bool) or isinstance(template, str):
        return None if type(obj) is type(template) else f"{_kind(obj)}, where {_kind(template)} belongs"
    if isinstance(template, (int, float)):
        if obj is None and isinstance(template, float):
            return None
        if not isinstance(obj, (int, float)):
            return f"{_kind(obj)} ({obj!r:.40}), where a number belongs"
        if isinstance(obj, float) and not math.isfinite(obj):
            return f"{obj}, not a finite number"
        if isinstance(obj, int) and not -_INT64 <= obj < _INT64:
            return f"{obj:.3g}, beyond 64 bits" if obj.bit_length() < 1000 else "an integer beyond 64 bits"
        return None
    if isinstance(template, tuple):  # a fixed record (Adam's betas, Python's RNG state)
        if not isinstance(obj, (tuple, list)) or len(obj) != len(template):
            return f"{_kind(obj)} ({obj!r:.40}), where a tuple of {len(template)} belongs"
        return next((f"[{i}] {fault}" for i, (t, o) in enumerate(zip(template, obj))
                     if (fault := value_fault(t, o)) is not None), None)
    if isinstance(template, list):  # as long as the layout makes it (rows per rank): each item in kind
        if not isinstance(obj, (tuple, list)):
            return f"{_kind(obj)} ({obj!r:.40}), where a list belongs"
        return next((f"[{i}] {fault}" for i, o in enumerate(obj) if template
                     and (fault := value_fault(template[min(i, len(template) - 1)], o)) is not None), None)
    if isinstance(template, dict):  # the keys its own owner checks; the values in kind
        if not isinstance(obj, dict):
            return f"{_kind(obj)} ({obj!r:.40}), where a dict belongs"
        return next((f"[{k!r}] {fault}" for k in template.keys() & obj.keys()
                     if (fault := value_fault(template[k], obj[k])) is not None), None)
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that stored values that are not tensors are loaded with
    `torch.load(weights_only=True)`; one that names another global raises `RefusedPickle`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            offender = _refused_global(err)
            if offender is None:
                raise  # damaged bytes: the caller's fault handling names them
            info = self.metadata.storage_data[read_item.storage_index]
            raise RefusedPickle(info.relative_path, offender, f"its value {fqn}") from None
        # Of the kind of the value it replaces (this run's own, of the same code): a crafted or
        # altered file can hold any plain value (`betas = "oops"`, a NaN, an int of 2**70).
        fault = value_fault(self.state_dict.get(fqn), obj)
        if fault is not None:
            info = self.metadata.storage_data[read_item.storage_index]
            raise StoredValueRefused(f"{info.relative_path}: its value {fqn} is {fault}: the file was altered "
                                     "or crafted")
        # The rest is DefaultLoadPlanner.load_bytes (torch 2.13) with `obj` for its torch.load.
        if self.flatten_state_dict:
            private.set_state_dict_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
