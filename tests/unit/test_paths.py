"""`torchmoe.config.files.paths`: the OS's reason for a path, and which key a path belongs to.

    python -m pytest -q tests/unit/test_paths.py

What the CLI prints for each key and fault is `tests/integration/test_path_faults.py`; here the
parts it is built from, including the net's choice of key for a path no check looked at.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from torchmoe.config import ConfigError, load_job_config
from torchmoe.config.files.paths import describe_os_error, job_paths, user_path_faults, writable_file, writable_folder


def _raised_in(argv: list[str], err: OSError) -> ConfigError:
    """The `ConfigError` the net of a job with the flags `argv` makes of `err`."""
    with pytest.raises(ConfigError) as info, user_path_faults(job_paths(load_job_config(argv))):
        raise err
    return info.value


def _enoent(path: str | Path) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))


@pytest.mark.parametrize(("argv", "filename", "key", "value"), [
    # The innermost path that holds the file names it: the checkpoint folder, not the dump folder.
    (["--job.dump_folder", "/runs/a"], "/runs/a/checkpoint/step-2/.metadata", "checkpoint.folder", "checkpoint"),
    (["--job.dump_folder", "/runs/a"], "/runs/a/metrics.jsonl", "job.dump_folder", "/runs/a"),
    # hf_assets_path filled the tokenizer: the key the user set.
    (["--model.hf_assets_path", "/hf/scout"], "/hf/scout/tokenizer.json", "model.hf_assets_path", "/hf/scout"),
    (["--model.tokenizer_path", "/tok"], "/tok/tokenizer.json", "model.tokenizer_path", "/tok"),
    # A glob holds what is under its folder part.
    (["--validation.enable", "true", "--validation.dataset_path", "/data/val/*.jsonl"], "/data/val/b.jsonl",
     "validation.dataset_path",
     "/data/val/*.jsonl"),
    # No key names it: the path itself.
    ([], "/elsewhere/file", "path", "/elsewhere/file"),
], ids=["checkpoint", "dump", "hf_assets", "tokenizer", "glob", "unnamed"])
def test_the_net_names_the_key_whose_path_holds_the_file(argv, filename, key, value) -> None:
    err = _raised_in(argv, _enoent(filename))
    assert (err.key, err.value) == (key, value)
    assert "No such file or directory" in err.problem and (filename in err.problem or filename == value)


def test_the_net_lets_other_os_errors_through() -> None:
    """An OSError about no file (a socket, a store) is no path fault: it keeps its traceback."""
    with pytest.raises(ConnectionResetError), user_path_faults(job_paths(load_job_config([]))):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")


def test_the_reason_names_what_is_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(OSError) as through:
        os.stat(tmp_path / "file" / "sub")
    assert describe_os_error(through.value, str(tmp_path / "file" / "sub")) == \
        f"Not a directory ({tmp_path / 'file'} is a file)"
    with pytest.raises(OSError) as dangling:
        os.stat(tmp_path / "link")
    # A file under the value: named, with the OS's reason and what it leaves out.
    assert describe_os_error(dangling.value, str(tmp_path)) == (
        f"{tmp_path / 'link'}: No such file or directory ({tmp_path / 'link'} is a symbolic link to "
        f"{tmp_path / 'gone'}, which does not exist)")


def test_path_methods_hide_some_faults(tmp_path: Path) -> None:
    """Why the checks make the OS call themselves (Python 3.11): `Path.exists()` answers False for
    a path through a file, raises for a name too long."""
    (tmp_path / "file").write_text("x")
    assert not (tmp_path / "file" / "sub").exists()
    with pytest.raises(OSError, match="File name too long"):
        (tmp_path / ("n" * 300)).exists()


def test_looking_before_writing_creates_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "kept").write_text("data")
    assert writable_folder(tmp_path / "new" / "deeper") == tmp_path
    writable_file(tmp_path / "kept")
    writable_file(tmp_path / "absent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and (tmp_path / "kept").read_text() == "data"
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        writable_file(tmp_path / "dir")
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "target")
    for check in (writable_file, writable_folder):
        with pytest.raises(FileNotFoundError):
            check(tmp_path / "link")


def test_ranks_sharing_a_pid_check_one_folder_at_once(tmp_path: Path, monkeypatch) -> None:
    """Ranks on two nodes (or in two pid namespaces) share pids: one rank's write probe, still
    there, never fails another's check of the same shared folder."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    (tmp_path / ".torchmoe-write-check-4242").write_text("")  # the old name, pid alone
    seen = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: seen.append(Path(path).name) or real_open(path, *a, **k))
    assert writable_folder(tmp_path) == writable_folder(tmp_path) == tmp_path
    assert len(set(seen)) == 2 and all("4242" in name for name in seen)  # a name of its own each time
    assert sorted(p.name for p in tmp_path.iterdir()) == [".torchmoe-write-check-4242"]


def test_a_nodes_other_ranks_ask_the_kernel_instead_of_creating_a_probe(tmp_path: Path, monkeypatch) -> None:
    """Under a launcher only LOCAL_RANK 0 creates a probe file (N ranks creating and deleting one
    each in a shared folder were 2N writes under its lock); the others refuse the usual cases
    alike, from `access` and a stat."""
    from torchmoe.config.errors import ConfigError
    from torchmoe.preflight.files import _check_folder

    created = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: created.append(Path(path).name) or real_open(path, *a, **k))
    for local_rank, probes in (("0", 1), ("3", 0)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        created.clear()
        _check_folder("job.dump_folder", str(tmp_path / "run"), tmp_path / "run")
        assert len([name for name in created if name.startswith(".torchmoe-write-check-")]) == probes
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"Not a directory"):
        _check_folder("job.dump_folder", str(tmp_path / "file" / "run"), tmp_path / "file" / "run")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only mount, or no permission
    with pytest.raises(ConfigError, match=r"cannot create files in it: Permission denied"):
        _check_folder("job.dump_folder", str(tmp_path / "run"), tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
