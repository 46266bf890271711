"""The files a command writes where its user says (`torchmoe plan --out/--json/--calibrate`,
`report --out`, `eval --out`): looked at before the work and again before the write, so that a
command never replaces what is not a plain file of the user's, nor writes into a live run's folders.

    out = check_output_file("--json", value, fix)    # before the work: ConfigError, exit 2
    ...
    write_output("--json", out, text, fix)           # looked at again, then written whole

An output is written as a new file renamed over its name (`file_writes.write_file`): a reader
never sees half of it. A rename over a device (``/dev/stdout``, ``/dev/full``), a named pipe, a
socket or a symbolic link would put a regular file in its place (as root, for every user of
that device), so those are refused, not replaced; so is a path at or below a folder a live run
holds (`folder_owners.refuse_held`): its config.toml, its checkpoints, its data.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_kinds import file_kind
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.files.folder_owners import refuse_held
from torchmoe.config.files.paths import path_faults, writable_file, writable_folder

__all__ = ["check_output_file", "write_output"]


def check_output_file(key: str, value: str, fix: str, path: Path | None = None) -> Path:
    """`value` as the file `key` names for a command to write (or `path`, the file `value` leads
    to: a folder's default file), refused before any work when the write would replace a link or
    something that is not a regular file, land in a live run's folder, or be refused by the OS (a
    folder in its place, no permission, a path through a file).

    Raises:
        ConfigError: naming `key`, `value` and the fault; `fix` is the OS faults' fix.
    """
    path = Path(value) if path is None else path
    with path_faults(key, value, fix):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise ConfigError(key, value, f"is a symbolic link (to {os.readlink(path)}): an output never "
                              "replaces a link nor writes through one", "name the file itself, or another file")
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", value)
        kind = file_kind(st.st_mode) if st is not None else None
        if kind is not None:
            raise ConfigError(key, value, f"is a {kind}, not a regular file: writing the output would replace "
                              "it with one", "name a regular file (a new one, or one this command wrote)")
        # First: the write checks below create (and delete) a probe file in the folder.
        refuse_held(key, value, path)
        writable_folder(path.parent)
        writable_file(path)
    return path


def write_output(key: str, path: Path, data: str | bytes, fix: str, value: str | None = None) -> None:
    """Write `data` to `path` whole, after `check_output_file` again (the work before took
    seconds: a run may have started there, or a link appeared), creating its folder.

    Raises:
        ConfigError: as `check_output_file`'s (for `key` = `value`, default `path`), or the OS's
            refusal of the write (a full disk).
    """
    value = str(path) if value is None else value
    check_output_file(key, value, fix, path)
    with path_faults(key, value, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, data)
