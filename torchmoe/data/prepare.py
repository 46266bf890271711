"""Tokenize a corpus once into pre-tokenized shards (the body of `torchmoe prepare-data INPUT... OUT_DIR`,
whose flags `commands/prepare_data.py` parses).

    torchmoe prepare-data corpus/ data/tokens                       # text files, .jsonl/.json/.parquet rows; byte tokenizer
    torchmoe prepare-data 'corpus/*.jsonl' data/tokens --tokenizer path/to/tokenizer.json --workers 16
    torchmoe prepare-data hf:allenai/c4:en data/c4 --split validation

INPUT is a file, folder or glob of local files (read as `training.dataset = "local"` reads them,
in the order of `local_files` over each INPUT in turn), or one `hf:NAME[:CONFIG]` hub dataset
(streamed as `training.dataset = "hf"`). The output is the format of `token_shards.py`.

Documents are read in order by this process and tokenized by `--workers` processes (default: every
core this process may run on), a batch of about `BATCH_CHARS` of text each, at most
`IN_FLIGHT_PER_WORKER` batches per worker ahead of the writer; each worker builds the tokenizer
once and encodes on one core (`TOKENIZERS_PARALLELISM=false`: the pool is the parallelism). Ids
are those of the packer: `Tokenizer.encode_batch`, and `encode_pieces` for a document longer
than `PIECE_CHARS` characters. A progress bar (on a terminal; else one line per shard) shows
tokens/s and, for local files, the ETA from the bytes tokenized over the files' total bytes (an
estimate for .jsonl and .parquet, whose files hold more or less than their text).

Resuming: `progress.json` (the manifest so far) is written when the run starts and after each
shard, every file atomically (a temporary file renamed over its name). Run again with the same
inputs, tokenizer and `--shard-tokens`, a killed run continues after its last complete shard
(reading, not tokenizing, the documents before it) and ends with the same files as a run never
killed; `manifest.json` is written last, and `progress.json` removed. An OUT_DIR that holds
anything else (another run's shards, a finished other dataset, other files) is refused.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from torchmoe.config.files.folder_owners import refuse_held
from torchmoe.config.files.paths import path_faults
from torchmoe.data.dataset import DataConfigError, Documents, FileDocuments
from torchmoe.data.documents import SizedDocuments
from torchmoe.data.file_listing import local_files
from torchmoe.data.hub_documents import HFDocuments
from torchmoe.data.packing import PIECE_CHARS
from torchmoe.data.token_shards import (
    MANIFEST,
    PROGRESS,
    check_digest,
    load_shard,
    manifest_header,
    read_manifest,
    write_manifest,
    write_shard,
)
from torchmoe.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["DEFAULT_SHARD_TOKENS", "Source", "encode_documents", "open_source", "prepare", "prepare_main"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 ids per shard
BATCH_CHARS = 1 << 20  # text per task: large enough that a task's overhead is small, small enough to balance
BATCH_DOCS = 4096
IN_FLIGHT_PER_WORKER = 2  # batches queued per worker: it never waits for the reader, memory stays bounded
HUB_PREFIX = "hf:"
_OUT_FIX = "give a folder this user can create and write, with room for the shards"


# ---- the source --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """What prepare-data tokenizes: the documents, their description for the manifest (what
    decides them, so a resumed run can tell that its inputs are the same) and, for local files,
    their total bytes (for the ETA)."""

    documents: Documents
    description: dict[str, Any]
    total_bytes: int | None


def open_source(inputs: Sequence[str], *, text_field: str = "text", split: str = "train") -> Source:
    """The documents of `inputs`: local files, folders and globs, or one `hf:NAME[:CONFIG]`.

    Raises:
        DataConfigError: about `INPUT`: nothing matches, the OS refuses a path, a hub dataset mixed
            with other inputs.
    """
    if any(spec.startswith(HUB_PREFIX) for spec in inputs):
        if len(inputs) > 1:
            raise DataConfigError("INPUT", " ".join(inputs), "a hub dataset is prepared on its own",
                                  "prepare it into an OUT_DIR of its own, and the local files into another")
        spec = inputs[0][len(HUB_PREFIX):]
        hub = HFDocuments.from_spec(spec, split=split, text_field=text_field, key="INPUT")
        description = {"kind": "hf", "dataset": hub.name, "config": hub.config, "split": split,
                       "text_field": text_field}
        return Source(hub, description, None)
    files = [file for spec in inputs for file in local_files(spec, key="INPUT")]
    listing = hashlib.sha256()
    total = 0
    for file in files:
        with path_faults("INPUT", str(file), "fix its permissions, or leave it out", error=DataConfigError):
            stat = file.stat()
        # Size and modification time: a file changed between a run and its resumption is another input.
        listing.update(f"{os.path.abspath(file)}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
        total += stat.st_size
    description = {"kind": "local", "inputs": [os.path.abspath(spec) for spec in inputs], "files": len(files),
                   "bytes": total, "listing_sha256": listing.hexdigest(), "text_field": text_field}
    return Source(FileDocuments(files, text_field=text_field, key="INPUT"), description, total)


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    """`texts` in lists of about BATCH_CHARS characters (at most BATCH_DOCS texts)."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ---- tokenizing --------------------------------------------------------------------------------


def encode_documents(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
    """The ids of `texts` as the packer makes them, for a shard.

    Returns:
        ids: (sum of counts,) of `dtype`, every text's ids concatenated (no BOS/EOS);
        counts: int64 (len(texts),), each text's token count;
        sizes: int64 (len(texts),), each text's UTF-8 bytes.
    """
    encoded = iter(tokenizer.encode_batch([text for text in texts if len(text) <= PIECE_CHARS]))
    parts = [np.asarray(next(encoded), dtype=dtype) if len(text) <= PIECE_CHARS else
             np.concatenate([np.asarray(piece, dtype=dtype) for piece in tokenizer.encode_pieces(text, PIECE_CHARS)])
             for text in texts]
    counts = np.fromiter(map(len, parts), np.int64, len(parts))
    sizes = np.fromiter((len(text.encode("utf-8")) for text in texts), np.int64, len(texts))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return ids, counts, sizes


# One per worker process: its tokenizer, built once by `_start_worker`.
_worker: dict[str, Any] = {}


def _start_worker(tokenizer_path: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    # Ctrl-C reaches the whole process group: the main process reports it and ends the pool (its
    # exit terminates the workers). A worker taking it too printed a KeyboardInterrupt traceback,
    # and one that died in a task left the main process waiting for that task's result for ever.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(tokenizer=build_tokenizer(tokenizer_path, key="--tokenizer"), dtype=np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return encode_documents(_worker["tokenizer"], texts, _worker["dtype"])


def _encoded(batches: Iterator[list[str]], tokenizer: Tokenizer, tokenizer_path: str, dtype: np.dtype,
             workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`encode_documents` of each batch, in order: here for one worker, else in a process pool."""
    if workers == 1:
        yield from (encode_documents(tokenizer, texts, dtype) for texts in batches)
        return
    methods = multiprocessing.get_all_start_methods()
    # Not fork: this process may hold threads (the tokenizers library's, the datasets library's).
    # The fork server imports this module once; each worker forks from it.
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        context.set_forkserver_preload([__name__])
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_path, dtype.str)) as pool:
        pending: deque[Any] = deque()
        for texts in batches:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---- shards ------------------------------------------------------------------------------------


class _ShardWriter:
    """Cuts encoded documents into shards (each closed by the document that brings it to
    `shard_tokens` tokens), writes each when it is full, and records the progress after it."""

    def __init__(self, folder: Path, header: dict[str, Any], shards: list[dict[str, Any]]) -> None:
        self.folder = folder
        self.header = header
        self.dtype = np.dtype(header["dtype"])
        self.shard_tokens: int = header["shard_tokens"]
        self.shards = shards  # the complete ones
        self.ids: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []
        self.tokens = 0  # of the shard being filled

    def add(self, ids: np.ndarray, counts: np.ndarray, sizes: np.ndarray) -> list[dict[str, Any]]:
        """Append documents (`encode_documents`' arrays); returns the entries of the shards written."""
        written = []
        first_doc = first_token = 0
        while first_doc < len(counts):
            ends = np.cumsum(counts[first_doc:])  # token ends of the documents from first_doc on
            last = int(np.searchsorted(ends, self.shard_tokens - self.tokens))  # the first to fill the shard
            end_doc = min(first_doc + last + 1, len(counts))
            end_token = first_token + int(ends[end_doc - first_doc - 1])
            self.ids.append(ids[first_token:end_token])
            self.counts.append(counts[first_doc:end_doc])
            self.sizes.append(sizes[first_doc:end_doc])
            self.tokens = end_token - first_token + self.tokens
            if self.tokens >= self.shard_tokens:
                written.append(self.flush())
            first_doc, first_token = end_doc, end_token
        return written

    def flush(self) -> dict[str, Any]:
        """Write the shard being filled (it must hold a document), then the progress record."""
        entry = write_shard(self.folder, len(self.shards), self.dtype, self.ids, np.concatenate(self.counts),
                            np.concatenate(self.sizes))
        self.ids, self.counts, self.sizes, self.tokens = [], [], [], 0
        self.shards.append(entry)
        write_manifest(self.folder / PROGRESS, self.header, self.shards)
        return entry

    @property
    def pending_documents(self) -> int:
        return sum(len(c) for c in self.counts)


def _own_temporary(name: str) -> bool:
    """A temporary file this module's writes leave when killed mid-write."""
    return name.endswith(".npy.tmp") or name.startswith((f".{MANIFEST}.tmp-", f".{PROGRESS}.tmp-"))


def _resume_point(out_dir: Path, header: dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
    """The complete shards of an earlier run of the same job in `out_dir` (checked against their
    digests), [] for a new run (the folder is created); the manifest when that run finished.

    Raises:
        DataConfigError: `out_dir` holds another job's shards, another dataset, or other files.
    """
    value = str(out_dir)
    fix = "choose another OUT_DIR, or delete this one"
    for name, state in ((MANIFEST, "a finished"), (PROGRESS, "an unfinished")):
        if not (out_dir / name).exists():
            continue
        record = read_manifest(out_dir / name, "OUT_DIR", value)
        differs = [k for k in header if record.get(k) != header[k]]
        if differs:
            raise DataConfigError("OUT_DIR", value, f"holds {state} prepare-data run of other inputs or settings "
                                  f"(another {', '.join(differs)})",
                                  f"run that job's own command to {'use' if name == MANIFEST else 'finish'} it; {fix}")
        if name == MANIFEST:
            return record
        for shard in record["shards"]:  # each as written: a resumed run appends to them
            for file, digest in shard["files"].items():
                check_digest(out_dir, file, digest, "OUT_DIR")
            # Of the dtype and lengths recorded, never unpickled: a shard that is not (a pickle
            # whose digest was recorded with it) is refused here, not by the run that reads it.
            load_shard(out_dir, shard, np.dtype(record["dtype"]), "OUT_DIR")
        return record["shards"]
    out_dir.mkdir(parents=True, exist_ok=True)
    others = sorted(name for name in os.listdir(out_dir) if not _own_temporary(name))
    if others:
        raise DataConfigError("OUT_DIR", value, f"is not empty (holds {', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}) and is no prepare-data run", fix)
    write_manifest(out_dir / PROGRESS, header, [])
    return []


def _remove_temporaries(out_dir: Path) -> None:
    for name in os.listdir(out_dir):
        if _own_temporary(name):
            (out_dir / name).unlink()


# ---- progress ----------------------------------------------------------------------------------


class _TokenRate(ProgressColumn):
    """Tokens this run / its elapsed time."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        rate = task.fields["new_tokens"] / elapsed if elapsed > 0 else 0.0
        return Text(f"{task.fields['tokens']:,} tokens, {rate / 1e6:.2f} M tokens/s")


@contextmanager
def _progress(show: bool, total_bytes: int | None, done_bytes: int) -> Iterator[tuple[Progress, Any]]:
    """A progress bar of the bytes tokenized (its ETA; none without `total_bytes`) on stderr; off
    when `show` is false or stderr is not a terminal."""
    console = Console(stderr=True)
    columns = (TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"), _TokenRate(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not (show and console.is_terminal)) as bar:
        task = bar.add_task("tokenizing", total=total_bytes, completed=done_bytes, tokens=0, new_tokens=0)
        yield bar, task


# ---- the job -----------------------------------------------------------------------------------


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(inputs: Sequence[str], out_dir: str | os.PathLike, *, tokenizer_path: str = "",
            workers: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text",
            split: str = "train", show_progress: bool = True) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out_dir` (module docstring), resuming an earlier run of the
    same job there; returns the manifest.

    Raises:
        DataConfigError: bad inputs, tokenizer or OUT_DIR (what the OS refuses about it too), or a
            corpus without text.
        ConfigError: OUT_DIR is a folder a live run holds, or inside one.
    """
    source = open_source(inputs, text_field=text_field, split=split)
    tokenizer = build_tokenizer(tokenizer_path, key="--tokenizer")
    header = manifest_header(tokenizer, source.description, shard_tokens)
    out = Path(out_dir)
    with path_faults("OUT_DIR", str(out_dir), _OUT_FIX, error=DataConfigError):
        refuse_held("OUT_DIR", str(out_dir), out)  # a live run's folders, or inside one, are its own
        resumed = _resume_point(out, header)
        if isinstance(resumed, dict):
            print(f"{out_dir} already holds these shards: {resumed['documents']:,} documents, "
                  f"{resumed['tokens']:,} tokens")
            return resumed
        writer = _ShardWriter(out, header, resumed)
        start = time.perf_counter()
        try:
            new_tokens = _write_shards(source, tokenizer, tokenizer_path, writer, workers or default_workers(),
                                       show_progress, resumed)
        except DataConfigError:
            if not writer.shards:
                # An input error before any shard was complete: nothing to resume, and the fixed
                # command (other inputs) would be refused as another job's unfinished run.
                (out / PROGRESS).unlink()
                _remove_temporaries(out)
            raise
        if sum(s["tokens"] for s in writer.shards) == 0:
            (out / PROGRESS).unlink()
            _remove_shards(out, writer.shards)
            documents = sum(s["documents"] for s in writer.shards)
            raise DataConfigError("INPUT", " ".join(inputs), f"holds no text ({documents} documents, all empty)",
                                  "give files or a dataset with text (check --text-field)")
        manifest = write_manifest(out / MANIFEST, header, writer.shards)
        (out / PROGRESS).unlink()
        _remove_temporaries(out)
    elapsed = time.perf_counter() - start
    print(f"wrote {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in {len(manifest['shards'])} "
          f"shards to {out_dir} ({new_tokens / elapsed / 1e6:.2f} M tokens/s)")
    return manifest


def _write_shards(source: Any, tokenizer: Tokenizer, tokenizer_path: str, writer: _ShardWriter, workers: int,
                  show_progress: bool, resumed: list[dict[str, Any]]) -> int:
    """Tokenize `source`'s documents after those of the `resumed` shards into `writer`'s shards,
    with a progress bar; returns the tokens added."""
    done_documents = sum(s["documents"] for s in resumed)
    new_tokens = 0
    start = time.perf_counter()
    with _progress(show_progress, source.total_bytes, sum(s["text_bytes"] for s in resumed)) as (bar, task):
        batches = _batches(source.documents.iter_from(done_documents))
        # Files record each document's size as their rows measure it (a .jsonl line's bytes):
        # the shards then split into the rows the raw files do. A hub stream has no sizes.
        measured = source.documents.sizes() if isinstance(source.documents, SizedDocuments) else None
        cursor = done_documents
        for ids, counts, sizes in _encoded(batches, tokenizer, tokenizer_path, writer.dtype, workers):
            if measured is not None:
                sizes, cursor = measured[cursor:cursor + len(sizes)], cursor + len(sizes)
            new_tokens += len(ids)
            bar.update(task, advance=int(sizes.sum()), new_tokens=new_tokens,
                       tokens=sum(s["tokens"] for s in writer.shards) + writer.tokens + len(ids))
            for entry in writer.add(ids, counts, sizes):
                if bar.disable:
                    rate = new_tokens / (time.perf_counter() - start)
                    print(f"{entry['name']}: {entry['documents']:,} documents, {entry['tokens']:,} tokens "
                          f"({rate / 1e6:.2f} M tokens/s)", file=sys.stderr)
        if writer.pending_documents:
            writer.flush()
        if source.total_bytes is not None:
            bar.update(task, completed=source.total_bytes)
    return new_tokens


def _remove_shards(out_dir: Path, shards: list[dict[str, Any]]) -> None:
    for shard in shards:
        for file in shard["files"]:
            (out_dir / file).unlink()
