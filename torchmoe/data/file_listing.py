"""The files a dataset path names: a file, a folder or a glob, each real file once, only regular files.

    files = local_files("data/**/*.jsonl", key="training.dataset_path", extensions=[".jsonl"])

Every text corpus (`training.dataset = "local"`), chat file set, mixture source, validation set and
`prepare-data` input is listed here ([data.md](../../docs/data.md), "Files"). A glob's ``**``
follows links to folders as glob does, through each real folder once (a link back up the tree is a
loop: glob's own listed a file once per turn, 41 times, or never ended); a file reached by two
paths is listed once; a named pipe, socket or device is refused unopened (opened to read, a named
pipe waits for a writer for ever).
"""

from __future__ import annotations

import glob
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from torchmoe.config.errors import show_value
from torchmoe.config.files.file_kinds import file_kind
from torchmoe.config.files.paths import path_faults
from torchmoe.config.wording import counted
from torchmoe.data.dataset_kinds import ALWAYS_READ, is_text_file
from torchmoe.data.errors import DataConfigError

__all__ = ["LOCAL_FILES", "local_files"]

logger = logging.getLogger(__name__)

LOCAL_FILES = "a .jsonl/.json/.parquet file of rows, or text files (.txt, code, any UTF-8 text)"


def local_files(dataset_path: str, *, key: str = "training.dataset_path",
                extensions: Sequence[str] = ()) -> list[Path]:
    """The corpus files named by `dataset_path` (the setting `key`), sorted: `.jsonl`, `.json`,
    `.parquet` and `.txt` files, and every other file that is text (`is_text_file`).

    `dataset_path` is a file, a folder (searched recursively, hidden files and folders left out)
    or a glob (`**` allowed). In a folder or a glob, only files whose names end in one of
    `extensions` (training.dataset_extensions, without case; empty: any) are kept, and files that
    are not text (images, compiled code) are passed over, and how many is logged; a file named
    alone must be text. Each file is listed once, however many links reach it (the first of its
    paths, sorted), and a glob's ``**`` goes through each folder once (a symbolic link back to a
    folder above it is a loop, not more files).

    Raises:
        DataConfigError: nothing usable matches, a match is a named pipe, device or socket (never
            opened: a named pipe would wait for a writer), or the OS refuses the path or a file
            or folder under it (missing, a path through a file, a name too long, a symbolic link
            to nothing, no permission: its reason); the message names the path and what to give.
    """
    fix = f"point it at {LOCAL_FILES}, a folder holding such files, or a glob like 'data/*.jsonl'"
    if not dataset_path:
        raise DataConfigError(key, dataset_path, 'dataset = "local" needs files', fix)
    path = Path(dataset_path)
    with path_faults(key, dataset_path, fix, error=DataConfigError):
        if glob.has_magic(dataset_path):  # glob passes over what it cannot read: its matches are stat'ed below
            candidates, what = _glob(dataset_path), "this glob matches"
        elif stat.S_ISDIR(os.stat(path).st_mode):
            candidates, what = _files_under(path), "this folder holds"
        else:
            _check_regular_file(path, os.stat(path), key, dataset_path)
            if path.suffix in ALWAYS_READ or is_text_file(path):
                return [path]
            raise DataConfigError(key, dataset_path, "is not a text file (a NUL byte or bytes that are not UTF-8 in "
                                  "its first 8 KiB)", fix)
        found = {p: os.stat(p) for p in candidates}
        files = [p for p, st in found.items() if not stat.S_ISDIR(st.st_mode)]
        if extensions:
            kept = [p for p in files if p.name.lower().endswith(tuple(e.lower() for e in extensions))]
            what += f" {counted(len(files) - len(kept), 'file')} of other extensions (training.dataset_extensions = " \
                f"{show_value(list(extensions))}) and"
            fix = "name the corpus's extensions in training.dataset_extensions (empty: every text file), or " + fix
            files = kept
        files = _each_file_once(sorted(files, key=lambda p: p.as_posix()), found)
        for p in files:
            _check_regular_file(p, found[p], key, dataset_path)
        binary = [p for p in files if p.suffix not in ALWAYS_READ and not is_text_file(p)]
        files = [p for p in files if p not in set(binary)]
    if not files:
        raise DataConfigError(key, dataset_path, f"{what} no corpus files" +
                              (f" ({len(binary)} not text, e.g. {binary[0]})" if binary else ""), fix)
    if binary:
        logger.info("%s: passed over %s that are not text (e.g. %s)", key, counted(len(binary), "file"), binary[0])
    return files


def _check_regular_file(path: Path, st: os.stat_result, key: str, value: str) -> None:
    """A corpus file is a regular file: a named pipe, device or socket is never opened."""
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise DataConfigError(key, value, f"{path} is a {kind}, not a regular file: it is never read (a named pipe "
                              "would wait for a writer, a device never end)",
                              "remove it, or leave it out with a glob or training.dataset_extensions")


def _each_file_once(files: list[Path], found: dict[Path, os.stat_result]) -> list[Path]:
    """`files` without the later paths of a file reached twice (a link to it, a linked folder)."""
    seen: set[tuple[int, int]] = set()
    once = []
    for p in files:
        ident = (found[p].st_dev, found[p].st_ino)
        if ident not in seen:
            seen.add(ident)
            once.append(p)
    return once


def _glob(pattern: str) -> list[Path]:
    """`glob.glob(pattern, recursive=True)`, whose ``**`` follows symbolic links to folders, but
    through each folder once: a link to a folder it has been through (a loop) is not followed
    again (glob's own listed a file once per turn of a loop, 41 times, or never ended)."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return [Path(p) for p in glob.glob(pattern)]
    at = parts.index("**")
    visited: set[tuple[int, int]] = set()
    found: list[Path] = []
    heads = [Path(p) for p in glob.glob(str(Path(*parts[:at])))] if at else [Path(".")]
    for head in heads:
        for folder in _folders_once(head, visited):
            rest = parts[at + 1:]
            if rest:  # the folder's name is matched as it is, not as a pattern
                found += _glob(os.path.join(glob.escape(str(folder)), *rest))
            else:  # a last "**" matches every file and folder under the head
                found += [folder / name for name in _names(folder) if not name.startswith(".")]
    return found


def _folders_once(top: Path, visited: set[tuple[int, int]]) -> Iterator[Path]:
    """`top` (if it is a folder) and the folders under it, as glob's ``**`` finds them (links to
    folders followed, hidden names left out), each real folder once (`visited`: their device and
    inode); a folder that cannot be listed is passed over, as glob passes it over."""
    stack = [top]
    while stack:
        folder = stack.pop()
        try:
            st = os.stat(folder)
        except OSError:
            continue
        ident = (st.st_dev, st.st_ino)
        if not stat.S_ISDIR(st.st_mode) or ident in visited:
            continue
        visited.add(ident)
        yield folder
        stack += [folder / name for name in sorted(_names(folder), reverse=True) if not name.startswith(".")]


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _files_under(folder: Path) -> list[Path]:
    """Every entry under `folder` that is not a folder, recursively, without following links to
    folders, leaving out hidden ones (names starting with "."; their folders unread); a folder
    that cannot be listed raises (os.walk and Path.rglob would pass over it)."""

    def fail(err: OSError) -> None:
        raise err

    found = []
    for parent, folders, names in os.walk(folder, onerror=fail):
        folders[:] = [name for name in folders if not name.startswith(".")]  # .git, .cache, ...
        found += [Path(parent) / name for name in names if not name.startswith(".")]
    return found
