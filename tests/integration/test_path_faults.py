"""Any fault of a file or folder the job reads or writes is one message, by class: exit 2, one
`error:` line naming the key, the path and the OS's reason, no traceback (`config/files/paths.py`).

    python -m pytest -q -m integration tests/integration/test_path_faults.py

Every path-valued key of the config, and the paths `torchmoe report` and `torchmoe convert`
take, meets each fault the OS reports about a path: missing, a folder where a file is expected
(the key's own file, or one a folder it names must hold), a file where a folder is expected, a
path through a file, a name too long, a symbolic link to nothing, and no permission (the path,
and a file inside it, as a non-root user). A fault that is none for a key is left out of its
row: an output folder that is missing is created, a dataset or tokenizer path may be a file or
a folder. The cases run `torchmoe.commands.cli.main` in this process, the permission cases all in one
subprocess of a non-root user (`setpriv`, else a user namespace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG, REPO
from torchmoe.commands import cli
from torchmoe.config import ConfigError, JobConfig, load_job_config, write_config_toml
from torchmoe.config.errors import show_value
from torchmoe.config.files.paths import job_paths
from torchmoe.preflight.files import check_outputs

pytestmark = pytest.mark.integration

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "1"]

# What the OS says of each fault (its strerror), which the message must carry.
REASONS = {
    "missing": "No such file or directory",
    "folder_for_file": "Is a directory",
    "file_for_folder": "Not a directory",
    "through_file": "Not a directory",
    "name_too_long": "File name too long",
    "dangling_symlink": "No such file or directory",
    "permission_denied": "Permission denied",
    "permission_denied_inside": "Permission denied",
}
NON_ROOT = ("permission_denied", "permission_denied_inside")  # root reads and writes anything


@dataclasses.dataclass(frozen=True)
class Fixtures:
    """What a command needs besides the faulty path: a folder of its own, a run's dump folder
    (`report --out`), a Hugging Face folder (`convert ... OUT_DIR`)."""

    work: Path
    run: Path
    hf: Path


@dataclasses.dataclass(frozen=True)
class PathKey:
    """A path-valued key: how a command line sets it, and what it expects there.

    Attributes:
        key: as messages name it.
        argv: the `torchmoe` arguments that set the key to a path.
        expects: "file" or "folder" (read), "out-folder" or "out-file" (written).
        member: a file a folder must hold, or the run writes into one: a folder in its place is
            the "folder where a file is expected" fault of a folder key.
        extras: files the folder also holds, so that the member is what is read.
        suffix: the file name's ending the command requires.
        skip: faults that are none for this key.
        packages: optional packages the command must find (a fault is found before it uses them).
        label: tells rows of the same key apart in test ids.
    """

    key: str
    argv: Callable[[Path, Fixtures], list[str]]
    expects: str
    member: str = ""
    extras: tuple[str, ...] = ()
    suffix: str = ""
    skip: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    label: str = ""

    def faults(self) -> list[str]:
        """The fault kinds this key meets."""
        none = set(self.skip)
        if self.expects.startswith("out-"):
            none.add("missing")  # a missing output is created
        if self.expects in ("file", "out-file"):
            none.update(("file_for_folder", "permission_denied_inside"))
        elif not self.member:
            none.update(("folder_for_file", "permission_denied_inside"))
        return [kind for kind in REASONS if kind not in none]

    def id(self, kind: str) -> str:
        """The test id of this key's `kind` case."""
        return f"{self.key}{self.label}:{kind}"


def _train(*flags: str) -> Callable[[Path, Fixtures], list[str]]:
    """`torchmoe train TINY` with `flags`, where "{}" is the faulty path."""
    return lambda path, fx: ["train", *TINY, "--job.dump_folder", str(fx.work / "run"),
                             *(str(path) if f == "{}" else f for f in flags)]


# A tokenizer or dataset path may be a file or a folder: neither is a fault.
EITHER = ("folder_for_file", "file_for_folder")
KEYS = [
    PathKey("--config", lambda p, fx: ["train", "--config", str(p), "--job.dump_folder", str(fx.work / "run")],
            "file", suffix=".toml"),
    PathKey("job.dump_folder", lambda p, fx: ["train", *TINY, "--job.dump_folder", str(p)], "out-folder",
            member="config.toml"),
    PathKey("job.dump_folder", lambda p, fx: ["train", *TINY, "--dry-run", "--job.dump_folder", str(p)],
            "out-folder", member="dry_run.json", label="(dry run)"),
    PathKey("checkpoint.folder", _train("--checkpoint.enable", "true", "--checkpoint.folder", "{}"), "out-folder"),
    PathKey("metrics.save_tb_folder", _train("--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "{}"),
            "out-folder", packages=("tensorboard",)),
    PathKey("profiling.save_traces_folder",
            _train("--profiling.enable_profiling", "true", "--profiling.save_traces_folder", "{}"), "out-folder"),
    PathKey("profiling.save_memory_snapshot_folder",
            _train("--profiling.enable_memory_snapshot", "true", "--profiling.save_memory_snapshot_folder", "{}"),
            "out-folder"),
    PathKey("model.tokenizer_path", _train("--model.tokenizer_path", "{}"), "folder", member="tokenizer.json",
            skip=("file_for_folder",)),
    # A folder, unlike tokenizer_path: a file there is refused, not read as the tokenizer.
    PathKey("model.hf_assets_path", _train("--model.hf_assets_path", "{}"), "folder", member="tokenizer.json",
            label="(tokenizer)"),
    # The weights from hf_assets_path: its tokenizer is read first, so only faults of the folder.
    PathKey("model.hf_assets_path", _train("--checkpoint.initial_load_in_hf", "true", "--model.hf_assets_path", "{}"),
            "folder", label="(weights)"),
    PathKey("checkpoint.initial_load_path", _train("--checkpoint.initial_load_path", "{}"), "folder",
            member=".metadata", label="(DCP)"),
    PathKey("checkpoint.initial_load_path",
            _train("--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", "{}"), "folder",
            member="config.json", extras=("model.safetensors",), label="(HF)"),
    PathKey("training.dataset_path", _train("--training.dataset", "local", "--training.dataset_path", "{}"), "folder",
            member="a.txt", skip=EITHER),
    PathKey("validation.dataset_path",
            _train("--validation.enable", "true", "--validation.dataset", "local", "--validation.local_batch_size",
                   "1", "--validation.seq_len", "32", "--validation.dataset_path", "{}"),
            "folder", member="a.txt", skip=EITHER),
    PathKey("DUMP_FOLDER", lambda p, fx: ["report", str(p)], "folder", member="metrics.jsonl",
            extras=("config.toml",)),
    # A link there, to nothing or not, is refused as a link (tests/integration/test_output_safety.py).
    PathKey("--out", lambda p, fx: ["report", str(fx.run), "--out", str(p)], "out-file", suffix=".png",
            skip=("dangling_symlink",)),
    PathKey("HF_DIR", lambda p, fx: ["convert", "hf-to-dcp", str(p), str(fx.work / "out")], "folder",
            member="config.json"),
    PathKey("CKPT_DIR", lambda p, fx: ["convert", "dcp-to-hf", str(p), str(fx.work / "out"), "--flavor", "tiny"],
            "folder", member=".metadata"),
    PathKey("OUT_DIR", lambda p, fx: ["convert", "hf-to-dcp", str(fx.hf), str(p)], "out-folder"),
]
# Written only by a multi-rank CUDA run: its check is run directly (`test_comm_traces_folder`).
COMM = PathKey("comm.save_traces_folder", lambda p, fx: [], "out-folder")

CASES = [(spec, kind) for spec in KEYS for kind in spec.faults()]
AS_ROOT = [(spec, kind) for spec, kind in CASES if kind not in NON_ROOT]
AS_NON_ROOT = [(spec, kind) for spec, kind in CASES if kind in NON_ROOT]


# ---- the faults ---------------------------------------------------------------------------------


def make_fault(kind: str, spec: PathKey, where: Path) -> Path:
    """Build the fault `kind` for `spec` in the folder `where`; returns the path to give."""
    path = where / ("x" + spec.suffix)
    if kind == "through_file":
        (where / "a-file").write_text("x")
        return where / "a-file" / path.name
    if kind == "name_too_long":
        return where / ("n" * 300 + spec.suffix)
    if kind == "file_for_folder":
        path.write_text("x")
    elif kind == "dangling_symlink":
        path.symlink_to(where / "gone" / path.name)  # its target's folder is missing too
    elif kind != "missing":  # a folder for a file, no permission (on the path or inside)
        _occupy(kind, spec, path)
    return path


def _occupy(kind: str, spec: PathKey, path: Path) -> None:
    """Put at `path` a folder where a file is expected (`spec`'s own file or its member), or what
    a non-root user may not read (a file; a folder, or the member in it) or write (a folder)."""
    if spec.expects in ("file", "out-file"):
        if kind == "folder_for_file":
            path.mkdir()
        else:
            path.write_text("x")
            path.chmod(0)
        return
    path.mkdir()
    for extra in spec.extras:
        (path / extra).write_text("x")
    if kind == "folder_for_file":
        (path / spec.member).mkdir()
        return
    if spec.member:
        (path / spec.member).write_text("x")
    writes = spec.expects == "out-folder"
    if kind == "permission_denied_inside":
        (path / spec.member).chmod(0o444 if writes else 0)
    else:
        path.chmod(0o555 if writes else 0)


@contextlib.contextmanager
def _installed(packages: tuple[str, ...]) -> Iterator[None]:
    """`packages` look installed to the checks (which refuse a switch whose package is missing)."""
    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: (importlib.machinery.ModuleSpec(name, None) if name in packages
                                                 else real(name, *a))
    try:
        yield
    finally:
        importlib.util.find_spec = real


def run_cli(argv: list[str], packages: tuple[str, ...] = ()) -> tuple[int, str]:
    """`torchmoe ARGV` in this process: (exit status, stderr). An exception that escapes is what
    the command would print and exit with (its traceback, 1), so that one case fails alone."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), _installed(packages):
        try:
            status = cli.main(argv)
        except Exception:  # noqa: BLE001 - a bug the assertions report
            traceback.print_exc()
            status = 1
    return status, err.getvalue()


def assert_path_fault(status: int, err: str, spec: PathKey, path: Path, kind: str) -> None:
    """One message, exit 2: the key, the path and the OS's reason, and no traceback."""
    assert status == 2, err
    assert "Traceback" not in err, err
    assert err.count("error:") == 1, err
    assert f"{spec.key} = " in err, err
    assert str(path) in err, err
    assert REASONS[kind] in err, err
    if kind == "dangling_symlink":
        assert "is a symbolic link to" in err, err


# ---- the cases ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixtures(hf_dir: Path) -> Iterator[Fixtures]:
    """A folder any user may enter and write (the permission cases run as another user), with a
    run's dump folder; the Hugging Face folder of a tiny model."""
    base = Path(tempfile.mkdtemp(prefix="torchmoe-path-faults-"))
    base.chmod(0o777)
    run = base / "run"
    run.mkdir()
    write_config_toml(load_job_config(TINY), run / "config.toml")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (run / "run_info.json").write_text('{"world_size": 1}\n')
    # A copy another user can read: the session's own lies under pytest's base folder, which only
    # its owner may enter, so a non-root command met "Permission denied" on it before its OUT_DIR.
    hf = base / "hf"
    shutil.copytree(hf_dir, hf)
    for path in (hf, *hf.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield Fixtures(base, run, hf)
    shutil.rmtree(base)  # root removes it whatever the modes inside


def _case(fx: Fixtures, spec: PathKey, kind: str) -> tuple[list[str], Path]:
    """A case in folders of its own: (its argv, the faulty path). The fault is built in one
    folder, the command's outputs go to another; both writable by any user."""
    work = Path(tempfile.mkdtemp(dir=fx.work))
    (work / "fault").mkdir()
    for folder in (work, work / "fault"):
        folder.chmod(0o777)
    path = make_fault(kind, spec, work / "fault")
    return spec.argv(path, dataclasses.replace(fx, work=work)), path


@pytest.mark.parametrize("spec, kind", AS_ROOT, ids=[spec.id(kind) for spec, kind in AS_ROOT])
def test_path_fault_is_one_message(fixtures: Fixtures, spec: PathKey, kind: str) -> None:
    """Each key meets each fault that root meets too."""
    argv, path = _case(fixtures, spec, kind)
    status, err = run_cli(argv, spec.packages)
    assert_path_fault(status, err, spec, path, kind)


def _as_non_root() -> list[str] | None:
    """A command prefix that runs a command as a non-root user (uid 65534): `setpriv` where that
    user can run this interpreter, else a user namespace (root there is nobody to the host's
    files); [] when this is no root; None when neither works."""
    if os.geteuid() != 0:
        return []
    for prefix in (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], ["unshare", "--user"]):
        if shutil.which(prefix[0]) is None:
            continue
        # Its interpreter must find the same packages (it may not read this one's install).
        probe = subprocess.run([*prefix, sys.executable, "-c", "import os, pytest, torchmoe.commands.cli; print(os.geteuid())"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
        if probe.returncode == 0 and probe.stdout.strip() not in ("", "0"):
            return prefix
    return None


_RUNNER = ("import json, sys; from tests.integration.test_path_faults import run_cli; "
           "cases = json.load(open(sys.argv[1])); "
           "json.dump([run_cli(argv, tuple(packages)) for argv, packages in cases], open(sys.argv[2], 'w'))")


@pytest.fixture(scope="module")
def non_root_results(fixtures: Fixtures) -> dict[str, tuple[int, str, Path]]:
    """The permission cases, all run in one subprocess of a non-root user: case id -> (exit status,
    stderr, the faulty path)."""
    prefix = _as_non_root()
    if prefix is None:
        pytest.skip("no way to run as a non-root user here: neither setpriv (for uid 65534) nor unshare --user")
    cases = {spec.id(kind): (*_case(fixtures, spec, kind), spec.packages) for spec, kind in AS_NON_ROOT}
    todo, done = fixtures.work / "cases.json", fixtures.work / "results.json"
    todo.write_text(json.dumps([(argv, packages) for argv, _, packages in cases.values()]))
    proc = subprocess.run([*prefix, sys.executable, "-c", _RUNNER, str(todo), str(done)], cwd=REPO,
                          env={**os.environ, "HOME": str(fixtures.work), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(done.read_text())
    return {case_id: (status, err, path) for (case_id, (_, path, _)), (status, err) in zip(cases.items(), results)}


@pytest.mark.parametrize("spec, kind", AS_NON_ROOT, ids=[spec.id(kind) for spec, kind in AS_NON_ROOT])
def test_permission_denied_is_one_message(non_root_results, spec: PathKey, kind: str) -> None:
    """Each key meets a path, and a file in its folder, that a non-root user may not read or write."""
    status, err, path = non_root_results[spec.id(kind)]
    assert_path_fault(status, err, spec, path, kind)


def test_a_fault_after_the_checks_is_named_too(fixtures: Fixtures, monkeypatch: pytest.MonkeyPatch) -> None:
    """What no check could foresee (the file changed since) is caught by the net, which names the
    key whose path holds the file: here the run's config.toml, refused as the run writes it."""
    import torchmoe.training.run_files

    def refuse(cfg: JobConfig, path: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(torchmoe.training.run_files, "write_config_toml", refuse)
    dump = Path(tempfile.mkdtemp(dir=fixtures.work)) / "run"
    status, err = run_cli(["train", *TINY, "--job.dump_folder", str(dump)])
    assert_path_fault(status, err, KEYS[1], dump / "config.toml", "permission_denied")


@pytest.mark.parametrize("kind", [kind for kind in COMM.faults() if kind not in NON_ROOT])
def test_comm_traces_folder(tmp_path: Path, kind: str) -> None:
    """The NCCL flight recorder's folder, checked as for a run of 2 CUDA ranks (the check needs
    no GPU): the same message."""
    path = make_fault(kind, COMM, tmp_path)
    cfg = load_job_config([*TINY, "--job.dump_folder", str(tmp_path / "run"), "--comm.save_traces_folder", str(path)])
    with pytest.raises(ConfigError) as err:
        check_outputs(cfg, 2, torch.device("cuda", 0))
    for text in (f"comm.save_traces_folder = {show_value(str(path))}", REASONS[kind]):
        assert text in str(err.value)


def test_every_path_key_is_walked() -> None:
    """The rows above hold every path-valued key of the config (`job_paths` knows them: the net
    names the key by them), so a new one cannot go untested."""
    job = JobConfig()
    keys = [f"{section.name}.{field.name}" for section in dataclasses.fields(job)
            for field in dataclasses.fields(getattr(job, section.name))
            if field.name.endswith(("_path", "_folder")) or field.name == "folder"]
    readers = ["--training.dataset", "local", "--validation.enable", "true", "--checkpoint.enable", "true",
               "--metrics.enable_tensorboard", "true", "--profiling.enable_profiling", "true",
               "--profiling.enable_memory_snapshot", "true"]  # what reads or writes each (`dependent_keys`)
    cfg = load_job_config([*readers, *(arg for key in keys for arg in (f"--{key}", "x"))])
    assert sorted(p.key for p in job_paths(cfg)) == sorted(keys)
    assert set(keys) <= {spec.key for spec in KEYS} | {COMM.key}


def _proc_is_mounted() -> bool:
    try:
        return any(line.split()[1:3] == ["/proc", "proc"] for line in open("/proc/self/mounts"))
    except OSError:
        return False


# Outputs on the kernel's file systems, where the OS's reason misleads: "No such file or directory"
# in /proc (which exists), "Permission denied" to root in /sys.
KERNEL_PATHS = {
    "convert-into-proc": (lambda fx: ["convert", "hf-to-dcp", str(fx.hf), "/proc/x"], "OUT_DIR", "/proc/x",
                          "/proc: cannot create files in it: No such file or directory (it is on a proc file system, "
                          "which the kernel provides: no files can be created there)"),
    "convert-into-sys": (lambda fx: ["convert", "hf-to-dcp", str(fx.hf), "/sys/x/y"], "OUT_DIR", "/sys/x/y",
                         "/sys: cannot create files in it: Permission denied (it is on a sysfs file system, which the "
                         "kernel provides: no files can be created there)"),
    "dump-folder-in-proc": (lambda fx: ["train", *TINY, "--job.dump_folder", "/proc/self/run"], "job.dump_folder",
                            "/proc/self/run", "/proc/self: cannot create files in it: No such file or directory (it "
                            "is on a proc file system"),
    "report-into-sys": (lambda fx: ["report", str(fx.run), "--out", "/sys/report.png"], "--out", "/sys/report.png",
                        "/sys: cannot create files in it: Permission denied (it is on a sysfs file system"),
}


@pytest.mark.skipif(not _proc_is_mounted() or os.path.exists("/proc/x"), reason="no Linux /proc here")
@pytest.mark.parametrize("case", list(KERNEL_PATHS))
def test_output_on_a_kernel_file_system_says_so(fixtures: Fixtures, case: str) -> None:
    argv, key, value, reason = KERNEL_PATHS[case]
    status, err = run_cli(argv(fixtures))
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f'error: {key} = "{value}": {reason}' in err, err
