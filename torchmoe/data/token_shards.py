"""Pre-tokenized shards: a corpus tokenized once (`torchmoe prepare-data`), read by memory map.

    shards = TokenShards("data/tokens")             # checks manifest.json and the index files
    shards.check_tokenizer(build_tokenizer(""))     # a DataConfigError unless the same tokenizer made them
    ids = shards.tokens(12345)                      # document 12345: a read-only uint16/uint32 view, O(1)

The format (version 1), one folder:

- `manifest.json`: written last, when every shard is: `format` ("torchmoe-token-shards"),
  `version` (1), `dtype` ("uint16" when the vocabulary has at most 65536 ids, else "uint32"),
  `vocab_size`, `bos_id` (null when the tokenizer has none), `eos_id`, `tokenizer` (`name`, and
  `hash`: `Tokenizer.fingerprint()`), `source` (what was tokenized: the inputs, their file count,
  bytes and a digest of their listing, or the hub dataset, config and split; the text field),
  `shard_tokens` (a shard is closed by the first document that brings it to this many tokens),
  `checksum` ("xxh3_64") and `shards`: per shard its `name`, `documents`, `tokens`, `text_bytes`
  and `files` (each file's digest); then the totals `documents`, `tokens`, `text_bytes`.
- per shard `shard-NNNNN.tokens.npy`: 1-D `dtype`, the token ids of its documents concatenated,
  without BOS/EOS (the packer adds them, as it does to text);
  `shard-NNNNN.docs.npy`: int64 (documents + 1,), where each document's tokens start (the last
  entry is the shard's token count); `shard-NNNNN.sizes.npy`: int64 (documents,), each document's
  size in the source: the UTF-8 bytes of its text.

Every array is a plain `.npy` file (`numpy.save`'s format); they are read with
`numpy.load(mmap_mode="r", allow_pickle=False)`, so nothing is ever unpickled:

    import json, numpy as np
    shard = json.load(open("data/tokens/manifest.json"))["shards"][0]["name"]
    tokens, docs = (np.load(f"data/tokens/{shard}.{kind}.npy", mmap_mode="r") for kind in ("tokens", "docs"))
    first_document = tokens[docs[0]:docs[1]]

Documents are numbered across shards in order: shard k holds the documents after those of shards
0..k-1. `write_shard` and `write_manifest` write the format (each file to a temporary name, synced,
then renamed over its own), `TokenShards` reads it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from torchmoe.config.files.digests import ALGORITHM, digest_file
from torchmoe.config.files.file_writes import os_error, write_file
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import path_faults
from torchmoe.data.documents import DataConfigError, SizedDocuments
from torchmoe.data.read_bounds import check_regular, read_whole
from torchmoe.data.tokenizer import ByteTokenizer, Fingerprint, Tokenizer

__all__ = ["FORMAT", "KINDS", "MANIFEST", "PROGRESS", "VERSION", "TokenShards", "check_digest", "load_shard",
           "manifest_header", "read_manifest", "shard_file", "shard_name", "token_dtype", "write_manifest",
           "write_shard"]

FORMAT = "torchmoe-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # the manifest of an unfinished `prepare-data` run (prepare.py)
KINDS = ("tokens", "docs", "sizes")
_UINT16_IDS = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= _UINT16_IDS else np.uint32)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_file(name: str, kind: str) -> str:
    """The file of one of a shard's arrays (`kind` in KINDS)."""
    return f"{name}.{kind}.npy"


# ---- writing -----------------------------------------------------------------------------------


def _save(path: Path, dtype: np.dtype, chunks: Sequence[np.ndarray]) -> None:
    """The concatenation of `chunks` (1-D arrays cast to `dtype`) as a .npy file at `path`: written to
    `path.tmp` (never through a symbolic link), synced, then renamed over `path`, so that `path` is
    whole or absent after a kill. Streams the chunks: the concatenation is never in memory.

    Raises:
        OSError: what the OS says, naming the file.
    """
    tmp = path.with_name(path.name + ".tmp")
    count = sum(len(c) for c in chunks)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with open(fd, "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            for chunk in chunks:
                f.write(np.ascontiguousarray(chunk, dtype=dtype).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise os_error(err, tmp) from None


def write_shard(folder: Path, index: int, dtype: np.dtype, token_chunks: Sequence[np.ndarray],
                token_counts: np.ndarray, sizes: np.ndarray) -> dict[str, Any]:
    """Write shard `index` of `folder`; returns its manifest entry.

    Args:
        token_chunks: its documents' ids, concatenated in order and cut anywhere (1-D arrays).
        token_counts: int64 (documents,), each document's token count.
        sizes: int64 (documents,), each document's UTF-8 bytes.
    """
    name = shard_name(index)
    offsets = np.zeros(len(token_counts) + 1, dtype=np.int64)
    np.cumsum(token_counts, out=offsets[1:])
    arrays = {"tokens": (dtype, token_chunks), "docs": (np.dtype(np.int64), [offsets]),
              "sizes": (np.dtype(np.int64), [np.asarray(sizes, dtype=np.int64)])}
    for kind, (kind_dtype, chunks) in arrays.items():
        _save(folder / shard_file(name, kind), kind_dtype, chunks)
    return {"name": name, "documents": len(token_counts), "tokens": int(offsets[-1]), "text_bytes": int(sizes.sum()),
            "files": {shard_file(name, kind): digest_file(folder / shard_file(name, kind)) for kind in KINDS}}


def manifest_header(tokenizer: Tokenizer, source: dict[str, Any], shard_tokens: int) -> dict[str, Any]:
    """Every manifest field but the shards and totals: what decides the shards' bytes."""
    fingerprint = tokenizer.fingerprint()
    return {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tokenizer.vocab_size).name,
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "tokenizer": {"name": fingerprint.name, "hash": fingerprint.hash}, "source": source,
            "shard_tokens": shard_tokens, "checksum": ALGORITHM}


def write_manifest(path: Path, header: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """`header` (`manifest_header`) with `shards` and their totals, as JSON at `path` (atomically);
    returns it."""
    manifest = {**header, "shards": shards,
                **{total: sum(s[total] for s in shards) for total in ("documents", "tokens", "text_bytes")}}
    write_file(path, json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---- reading -----------------------------------------------------------------------------------


def read_manifest(path: Path, key: str, value: str) -> dict[str, Any]:
    """The manifest (or progress record) at `path`, checked for what `TokenShards` relies on.

    Raises:
        DataConfigError: about `key` = `value`: not JSON, another format or version, a field missing
            or of the wrong type. `OSError` passes through.
    """
    fix = "prepare the data again with `torchmoe prepare-data`"
    data = read_whole(path, key=key, value=value, fix=None, large_fix=fix)
    try:
        manifest = json_loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataConfigError(key, value, f"{path.name} is not JSON ({e})", fix) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataConfigError(key, value, f"{path.name} does not describe {FORMAT} (no \"format\": \"{FORMAT}\")", fix)
    if manifest.get("version") != VERSION:
        raise DataConfigError(key, value, f"{path.name} is format version {manifest.get('version')!r}; this "
                              f"torchmoe reads version {VERSION}", f"{fix} (with this torchmoe)")
    ints = {"vocab_size": manifest.get("vocab_size"), "eos_id": manifest.get("eos_id"),
            "shard_tokens": manifest.get("shard_tokens")}
    shards = manifest.get("shards")
    problem = None
    if not all(isinstance(v, int) and v >= 0 for v in ints.values()):
        problem = f"vocab_size, eos_id and shard_tokens must be integers, not {ints}"
    elif manifest.get("dtype") != token_dtype(manifest["vocab_size"]).name:
        problem = f"dtype {manifest.get('dtype')!r} is not the one of a {manifest['vocab_size']}-id vocabulary"
    elif manifest.get("checksum") != ALGORITHM:
        problem = f"checksum {manifest.get('checksum')!r} is not {ALGORITHM!r}"
    elif not isinstance(manifest.get("tokenizer"), dict) or not all(
            isinstance(manifest["tokenizer"].get(k), str) for k in ("name", "hash")):
        problem = "tokenizer must hold a name and a hash"
    elif not isinstance(shards, list) or not all(_is_shard_entry(s, i) for i, s in enumerate(shards)):
        problem = "shards must list shard-00000, shard-00001, ... each with documents, tokens and files"
    if problem:
        raise DataConfigError(key, value, f"{path.name} is damaged: {problem}", fix)
    return manifest


def _is_shard_entry(entry: Any, index: int) -> bool:
    if not isinstance(entry, dict) or entry.get("name") != shard_name(index):
        return False
    files = entry.get("files")
    return (all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("documents", "tokens", "text_bytes"))
            and isinstance(files, dict) and set(files) == {shard_file(entry["name"], kind) for kind in KINDS})


def check_digest(folder: Path, file: str, recorded: str, key: str) -> None:
    """Raises a DataConfigError (about `key` = `folder`) unless `folder/file` has the `recorded`
    digest. A file found good is not read again by this process while it stays as it was (the
    checks before a run and the run open the same shards: every rank would hash every index
    file twice)."""
    check_regular(folder / file, key=key, value=str(folder))  # hashed whole: a named pipe would wait for ever
    st = os.stat(folder / file)
    ident = (os.path.abspath(folder / file), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, recorded)
    if ident in _VERIFIED:
        return
    digest = digest_file(folder / file)
    if digest != recorded:
        raise DataConfigError(key, str(folder), f"{file} does not match the checksum in {MANIFEST} ({ALGORITHM} "
                              f"{digest}, recorded {recorded}): it changed on disk",
                              "prepare the data again with `torchmoe prepare-data`")
    if time.time() - st.st_mtime > 2:  # "racy" otherwise: a change within the clock's tick keeps the times
        _VERIFIED.add(ident)


_VERIFIED: set[tuple] = set()  # files whose digest this process checked, as they were then


def _load(folder: Path, file: str, dtype: np.dtype, count: int, key: str) -> np.ndarray:
    """The 1-D array of `count` `dtype` items in `folder/file`, memory-mapped read-only; never unpickles.

    Raises:
        DataConfigError: a file that is not a .npy array of that dtype and length (truncated: shorter
            than its header says). `OSError` passes through.
    """
    fix = "prepare the data again with `torchmoe prepare-data`"
    check_regular(folder / file, key=key, value=str(folder))  # numpy would open a named pipe, and wait
    try:
        array = np.load(folder / file, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # not .npy, an object array, or shorter than its header says
        raise DataConfigError(key, str(folder), f"{file} is not a whole .npy array ({e})", fix) from None
    if array.dtype != dtype or array.shape != (count,):
        problem = (f"{file} is truncated ({os.path.getsize(folder / file)} bytes)"
                   if array.dtype == dtype and array.ndim == 1 and len(array) < count else
                   f"{file} holds {array.dtype} {array.shape}, where {MANIFEST} says {dtype.name} ({count},)")
        raise DataConfigError(key, str(folder), problem, fix)
    return array


def load_shard(folder: Path, shard: dict[str, Any], dtype: np.dtype,
               key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The files of the manifest entry `shard` in `folder`, memory-mapped and checked against
    it: its docs offsets, int64 (documents + 1,); sizes, int64 (documents,); tokens, `dtype`
    (tokens,). Never unpickles.

    Raises:
        DataConfigError: as `_load`'s, naming `key`.
    """
    int64 = np.dtype(np.int64)
    return (_load(folder, shard_file(shard["name"], "docs"), int64, shard["documents"] + 1, key),
            _load(folder, shard_file(shard["name"], "sizes"), int64, shard["documents"], key),
            _load(folder, shard_file(shard["name"], "tokens"), dtype, shard["tokens"], key))


class TokenShards(SizedDocuments):
    """A folder of pre-tokenized shards (module docstring), opened and checked: `manifest.json` (its
    format, version and fields), every shard's files (present, the small index files matching their
    checksums, token files as long as the manifest says). As a corpus (`training.dataset =
    "tokens"`) its documents are token ids, read by memory map, and its rows are cut by the sizes
    the source measured, as the raw text's are (`documents.py`).

    Args:
        folder: the folder `torchmoe prepare-data` wrote.
        key: the setting that named it, for messages.
        check_digests: hash the index files against the manifest here; False leaves that to
            `check_digests`, which ranks share (a run's corpus: `dataloader.build_corpus`).

    Raises:
        DataConfigError: what is wrong with the folder, naming `key` and the file: missing (an
            unfinished run says so), unreadable (the OS's reason), damaged, truncated, changed.
    """

    def __init__(self, folder: str | os.PathLike, *, key: str = "training.dataset_path",
                 check_digests: bool = True) -> None:
        self.folder = Path(folder)
        self.key = key
        self.source = (key, str(folder))
        fix = "point it at a folder written by `torchmoe prepare-data`, or prepare one"
        with path_faults(key, str(folder), fix, error=DataConfigError):
            manifest_path = self.folder / MANIFEST
            if not manifest_path.exists() and (self.folder / PROGRESS).exists():
                raise DataConfigError(key, str(folder), f"is an unfinished prepare-data run ({PROGRESS}, no {MANIFEST})",
                                      "run the same `torchmoe prepare-data` command again: it resumes and finishes")
            self.manifest: dict[str, Any] = read_manifest(manifest_path, key, str(folder))
            self.dtype = np.dtype(self.manifest["dtype"])
            shards = self.manifest["shards"]
            self._names = [s["name"] for s in shards]
            self._tokens: list[np.ndarray] = []  # per shard: (its tokens,) of dtype
            self._offsets: list[np.ndarray] = []  # per shard: int64 (its documents + 1,)
            self._sizes: list[np.ndarray] = []  # per shard: int64 (its documents,)
            for s in shards:
                offsets, sizes, tokens = load_shard(self.folder, s, self.dtype, key)
                self._offsets.append(offsets)
                self._sizes.append(sizes)
                self._tokens.append(tokens)
        # first[k]: the index of shard k's first document; first[-1]: the document count.
        self._first = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([s["documents"] for s in shards], out=self._first[1:])
        if check_digests:
            self.check_digests()

    def check_digests(self, share: int = 0, shares: int = 1) -> None:
        """Check the index files (docs, sizes) of every `shares`-th shard from `share` on against
        the manifest's digests: a rank of `shares` hashes its share of the folder (these files are
        8 bytes a document each; every rank of a big run hashing all of them would read them all
        from the shared file system once per rank).

        Raises:
            DataConfigError: a file changed on disk, or cannot be read (naming it).
        """
        fix = "point it at a folder written by `torchmoe prepare-data`, or prepare one"
        with path_faults(self.key, str(self.folder), fix, error=DataConfigError):
            for s in self.manifest["shards"][share::shares]:
                for kind in ("docs", "sizes"):
                    file = shard_file(s["name"], kind)
                    check_digest(self.folder, file, s["files"][file], self.key)

    def __repr__(self) -> str:
        return f"TokenShards({str(self.folder)!r}, {self.num_documents} documents in {len(self._names)} shards)"

    @property
    def num_documents(self) -> int:
        return int(self._first[-1])

    def sizes(self) -> np.ndarray:
        """int64 (num_documents,): each document's size as its source measured it (`prepare.py`)."""
        return self._all_sizes

    @cached_property
    def _all_sizes(self) -> np.ndarray:
        return np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int64)

    def _where(self, index: int) -> tuple[int, int]:
        """(shard, document within it) of document `index`."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} is not in [0, {self.num_documents})")
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        return shard, index - int(self._first[shard])

    def tokens(self, index: int) -> np.ndarray:
        """(token_count(index),) ids of document `index`, without BOS/EOS: a read-only view of the
        memory-mapped shard (copy what outlives this object).

        Raises:
            DataConfigError: the document holds an id outside the manifest's vocabulary, or its
                offsets in docs.npy are not a range of the shard's tokens (a shard written or
                changed by something else, its digests forged: an id past the model's embedding
                is an IndexError mid-step, one inside it trains a token no tokenizer makes, and
                bad offsets read another document's tokens, or none, silently).
        """
        shard, start, end = self._range(index)
        ids = self._tokens[shard][start:end]
        if ids.size and int(ids.max()) >= self.manifest["vocab_size"]:
            raise DataConfigError(self.key, str(self.folder), f"{self.locate(index)} holds token id {int(ids.max())}, "
                                  f"outside the vocabulary of {self.manifest['vocab_size']} ids its manifest.json "
                                  "records: the shard was not written by this prepare-data run",
                                  "prepare the data again with `torchmoe prepare-data` into a new folder")
        return ids

    def read(self, index: int) -> np.ndarray:
        return self.tokens(index)

    def token_count(self, index: int) -> int:
        _, start, end = self._range(index)
        return end - start

    def _range(self, index: int) -> tuple[int, int, int]:
        """(shard, start, end) of document `index` in its shard's tokens, checked: one document at
        a time, as it is read (checking the whole docs.npy at open would read it on every rank)."""
        shard, doc = self._where(index)
        start, end = (int(v) for v in self._offsets[shard][doc:doc + 2])
        if not 0 <= start <= end <= len(self._tokens[shard]):
            raise DataConfigError(self.key, str(self.folder), f"{self.locate(index)} spans tokens {start} to {end} "
                                  f"in docs.npy, not a range of the shard's {len(self._tokens[shard])} tokens: the "
                                  "shard was not written by this prepare-data run",
                                  "prepare the data again with `torchmoe prepare-data` into a new folder")
        return shard, start, end

    def locate(self, index: int) -> str:
        """Where document `index` is, for messages: ``shard-00003 document 17``."""
        shard, doc = self._where(index)
        return f"{self._names[shard]} document {doc}"

    def fingerprint(self) -> Fingerprint:
        """The fingerprint of the tokenizer that made the shards."""
        return Fingerprint(self.manifest["tokenizer"]["name"], self.manifest["tokenizer"]["hash"])

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raises a DataConfigError (about `model.tokenizer_path`) unless `tokenizer` is the one that
        made the shards (the same fingerprint hash)."""
        made, given = self.fingerprint(), tokenizer.fingerprint()
        if made.hash == given.hash:
            if self.manifest["vocab_size"] != tokenizer.vocab_size:  # the hash matched, the number was changed
                raise DataConfigError(self.key, str(self.folder), f"its manifest.json records a vocabulary of "
                                      f"{self.manifest['vocab_size']} ids, but its tokenizer ({given}) has "
                                      f"{tokenizer.vocab_size}", "prepare the data again into a new folder")
            return
        raise DataConfigError(
            "model.tokenizer_path", _setting(given), f"the shards in {self.folder} were tokenized with {made}, "
            f"not {given}",
            f"prepare the data again with {_flag(given)}, or set model.tokenizer_path to {_setting(made)!r}",
        )  # fmt: skip


def _setting(fingerprint: Fingerprint) -> str:
    """The `model.tokenizer_path` of the tokenizer `fingerprint` names ("" for the byte tokenizer)."""
    return "" if fingerprint == ByteTokenizer().fingerprint() else fingerprint.name


def _flag(fingerprint: Fingerprint) -> str:
    """The `prepare-data` flag that picks the tokenizer `fingerprint` names."""
    setting = _setting(fingerprint)
    return f"--tokenizer {setting}" if setting else "no --tokenizer (the byte tokenizer)"
