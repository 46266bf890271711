"""Nothing lost: a run owns every folder it writes into, and writes nothing before it knows it goes
ahead (no empty paths, no history it did not continue, no symbolic links it did not make).

    python -m pytest -q -m integration tests/integration/test_run_safety.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, HF_EXPORT, REPO, assert_user_error
from tests.launch import read_metrics, run_train
from torchmoe.commands import cli
from torchmoe.run_folders.run_lock import LOCK_NAME, OWNER_NAME

pytestmark = pytest.mark.integration

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "1", "--checkpoint.enable", "true"]

# A process that holds a dump folder the way a run does (with the lock `job.folder_lock` names),
# until killed.
_HOLDER = """
import sys, time
from pathlib import Path
from torchmoe.run_folders import run_lock
from torchmoe.config.files import folder_owners
from torchmoe.config.files.paths import UserPath
folder_owners.HEARTBEAT_S = float(sys.argv[3])
lock = run_lock.lock_folders([UserPath("job.dump_folder", sys.argv[1], sys.argv[1], "")], sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""
NO_FLOCK = Path(__file__).parent / "no_flock"


def _file_system(monkeypatch, flock: str) -> None:
    """This test's processes on a file system whose flock fails with `flock` (an errno's name:
    `no_flock/sitecustomize.py`), or works ("flock")."""
    if flock != "flock":
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NO_FLOCK), *filter(None, [os.environ.get("PYTHONPATH")])]))
        monkeypatch.setenv("TORCHMOE_FLOCK_ERRNO", flock)


def _hold(folder: Path, kind: str = "auto", heartbeat_s: float = 2.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), kind, str(heartbeat_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


@pytest.mark.parametrize(("flock", "nproc"), [("flock", 1), ("flock", 2), ("ENOSYS", 1), ("ENOLCK", 2)])
def test_a_second_run_on_a_held_dump_folder_is_refused(monkeypatch, tmp_path, flock, nproc):
    """With flock, and where the file system refuses it (Lustre without `flock`: ENOSYS; NFSv3
    without a lock daemon: ENOLCK; the holder then holds an owner file with a heartbeat)."""
    _file_system(monkeypatch, flock)
    holder = _hold(tmp_path / "run")
    try:
        proc = run_train(TINY, dump_folder=tmp_path / "run", nproc=nproc, timeout=120, expect=None)
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid} on " in proc.stderr and "in use by another run" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoint").exists()  # refused before writing anything
    assert (tmp_path / "run" / OWNER_NAME).is_file() == (flock != "flock")
    # How to clear a lock no live run holds: the owner file to delete; a flock goes with its process.
    clear = f"a lock that no live run holds is cleared by deleting {tmp_path / 'run' / OWNER_NAME}, once you are " \
        f"sure no run uses {tmp_path / 'run'}" if flock != "flock" else "the kernel keeps this lock only while its " \
        f"process lives: it goes when that process ends (deleting {tmp_path / 'run' / LOCK_NAME} would not stop it)"
    assert clear in " ".join(proc.stderr.split()), proc.stderr[-3000:]
    if nproc == 1:
        assert_user_error(proc, 'job.dump_folder = "', "fix: wait for it to end")
    else:  # every rank learns it from rank 0 and exits 2 (torchrun itself then exits 1)
        assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]


@pytest.mark.parametrize("flock", ["flock", "ENOSYS"])
def test_a_killed_holder_leaves_no_stuck_lock(monkeypatch, tmp_path, flock):
    """flock: the kernel dropped it. A heartbeat's owner file, left behind by the killed holder
    on this host, is taken over at once (its pid is gone) and removed when the run ends."""
    _file_system(monkeypatch, flock)
    holder = _hold(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    proc = run_train(TINY, dump_folder=tmp_path / "run", timeout=120)
    assert (tmp_path / "run" / "checkpoint" / "step-1" / ".complete").is_file()
    if flock != "flock":
        assert f"took over {tmp_path / 'run'} from pid {holder.pid} on " in proc.stderr, proc.stderr[-3000:]
        assert "folder locks: owner files with a heartbeat" in proc.stderr and "Function not implemented" in proc.stderr
        assert not (tmp_path / "run" / OWNER_NAME).exists()


def test_a_holder_whose_lock_was_taken_over_stops_at_once(tmp_path):
    """A heartbeat holder that finds its owner file another run's (it was suspended past the
    stale time, say) ends at its next beat, exit 2, one line naming the new holder."""
    holder = _hold(tmp_path / "run", "heartbeat", heartbeat_s=0.2)
    owner = tmp_path / "run" / OWNER_NAME
    record = json.loads(owner.read_text())
    # Replaced whole, as a taking-over run's file appears: a truncate-and-write could be read
    # empty by a beat between the two (a new holder that has not yet said who it is).
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps({**record, "pid": 4242, "host": "node-b", "token": "theirs"}))
    os.replace(theirs, owner)
    _, err = holder.communicate(timeout=60)
    assert holder.returncode == 2 and "Traceback" not in err, err
    assert err.count("error:") == 1 and "the lock of" in err and "was taken over by another run, now held by " \
        "pid 4242 on node-b" in err, err
    assert json.loads(owner.read_text())["token"] == "theirs"  # the new holder's file is left alone


def test_another_flavor_on_a_runs_checkpoints_names_the_flavor(tmp_path):
    """The run's checkpoints are valid: the message points at the flavor, never at deleting them."""
    run_train(TINY, dump_folder=tmp_path, timeout=120)
    proc = run_train([*TINY, "--model.flavor", "bench256", "--training.steps", "2"], dump_folder=tmp_path,
                     timeout=120, expect=None)
    # docs/checkpoints.md promises the flavor that fits: the flavor the checkpoints' shapes are of.
    assert_user_error(proc, 'model.flavor = "bench256": does not match the run\'s checkpoints: this model\'s '
                      "tok_embeddings.weight is (2048, 256), the checkpoint holds it as (512, 128)\n"
                      "  fix: pass --model.flavor tiny; or give this run its own job.dump_folder\n")
    assert "delete" not in proc.stderr
    assert (tmp_path / "checkpoint" / "step-1" / ".complete").is_file()


# ---- every folder a run writes into --------------------------------------------------------------

# A live run: a Trainer built from the flags (it holds every folder it writes into), until killed.
_RUN = """
import sys, time
from torchmoe.config import load_job_config
from torchmoe.training.loop import Trainer
trainer = Trainer(load_job_config(sys.argv[1:]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def live_run():
    """Starts `_RUN` with the given flags; every one started is killed at the end."""
    procs = []

    def start(*flags: str | os.PathLike) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _RUN, *TINY, *map(str, flags)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _main(capsys, *argv: str | os.PathLike) -> tuple[int, str]:
    """`torchmoe ARGV` in this process; returns (exit status, stderr)."""
    status = cli.main([str(a) for a in argv])
    return status, capsys.readouterr().err


def _one_error(status: int, err: str, *expected: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    for text in expected:
        assert text in err, err


# (the live run's flags, this run's flags, the key refused, its value); a: the live run's dump folder.
SHARED = {
    "absolute_checkpoint_folder": (["--checkpoint.folder", "{t}/ckpt"], ["--checkpoint.folder", "{t}/ckpt"],
                                   "checkpoint.folder", "{t}/ckpt"),
    "checkpoint_folder_through_dotdot": (["--checkpoint.folder", "{t}/ckpt"], ["--checkpoint.folder", "../ckpt"],
                                         "checkpoint.folder", "../ckpt"),
    "checkpoint_folder_through_a_link": (["--checkpoint.folder", "{t}/ckpt"], ["--checkpoint.folder", "{t}/link"],
                                         "checkpoint.folder", "{t}/link"),
    "dump_folder_is_its_checkpoint_folder": ([], ["--job.dump_folder", "{t}/a/checkpoint"], "job.dump_folder",
                                             "{t}/a/checkpoint"),
    "trace_folder": (["--profiling.enable_profiling", "true", "--profiling.save_traces_folder", "{t}/traces"],
                     ["--profiling.enable_profiling", "true", "--profiling.save_traces_folder", "{t}/traces"],
                     "profiling.save_traces_folder", "{t}/traces"),
}


@pytest.mark.parametrize("case", list(SHARED))
def test_a_folder_a_live_run_writes_into_is_refused_under_any_name(capsys, tmp_path, live_run, case) -> None:
    """Two runs with their own dump folders and one checkpoint (or trace) folder: the second is refused
    before it resumes from, prunes or writes into the first one's."""
    live_flags, flags = ([x.format(t=tmp_path) for x in xs] for xs in SHARED[case][:2])
    key, value = SHARED[case][2], SHARED[case][3].format(t=tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "ckpt", target_is_directory=True)
    live = live_run("--job.dump_folder", tmp_path / "a", *live_flags)
    status, err = _main(capsys, "train", *TINY, "--job.dump_folder", tmp_path / "b", *flags)
    _one_error(status, err, f'{key} = "{value}": is in use by another run: pid {live.pid} on ',
               f"fix: wait for it to end or stop it, or give this run a folder of its own for {key}")
    assert not list(tmp_path.glob("*/step-*")) and not list(tmp_path.glob("*/config.toml"))


@pytest.mark.parametrize("direction", ["hf-to-dcp", "dcp-to-hf"])
def test_convert_into_a_live_runs_folder_is_refused(capsys, tmp_path, live_run, hf_dir, direction) -> None:
    live = live_run("--job.dump_folder", tmp_path / "a", "--checkpoint.folder", tmp_path / "ckpt")
    source = [hf_dir] if direction == "hf-to-dcp" else [_dcp_of(hf_dir, tmp_path / "dcp"), "--flavor", "tiny"]
    out = tmp_path / "ckpt"
    status, err = _main(capsys, "convert", direction, source[0], out, *source[1:])
    _one_error(status, err, f'OUT_DIR = "{out}": is in use by another run: pid {live.pid} on ')
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # the live run's lock, and nothing else


def _dcp_of(hf_dir: Path, out: Path) -> Path:
    from torchmoe.commands.convert import hf_to_dcp

    hf_to_dcp(hf_dir, out)
    assert LOCK_NAME not in os.listdir(out)  # a finished conversion leaves only what it converted
    return out


# ---- history and files are never cut or rewritten by a run that does not go ahead --------------


def test_a_new_run_never_cuts_another_runs_metrics(capsys, tmp_path) -> None:
    """A run with checkpoints, then a new run in its folder without them: refused, not cutting
    metrics.jsonl from 3 records to 1 nor rewriting config.toml; a resume continues 1..5."""
    run = tmp_path / "run"
    base = ["train", *TINY, "--job.dump_folder", run, "--metrics.log_freq", "1"]
    assert _main(capsys, *base, "--training.steps", "3")[0] == 0
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.toml", "run_info.json")}
    status, err = _main(capsys, *base, "--training.steps", "1", "--checkpoint.enable", "false")
    _one_error(status, err, f'job.dump_folder = "{run}": holds the metrics.jsonl of another run (steps 1-3; its '
               "config differs in training.steps, checkpoint.enable), which this run, starting at step 1 without a "
               "checkpoint to resume, would cut", f"fix: give this run its own folder (--job.dump_folder {run}-2), "
               "or pass --job.overwrite true to replace that history")
    assert {name: (run / name).read_bytes() for name in before} == before
    assert _main(capsys, *base, "--training.steps", "5")[0] == 0  # resumes step-3 of the same history
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]


def test_a_restart_before_the_first_checkpoint_logs_its_steps_again(capsys, tmp_path) -> None:
    """The same run again (its config.toml equal) after it was killed before its first checkpoint
    and its last step: its records are its own, logged again."""
    argv = ["train", *TINY, "--job.dump_folder", tmp_path, "--training.steps", "2", "--checkpoint.enable", "false",
            "--metrics.log_freq", "1"]
    assert _main(capsys, *argv)[0] == 0
    records = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text(records[0])  # killed after step 1: step 2 was never logged
    assert _main(capsys, *argv)[0] == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


# A finished run's history, rerun with the same config (the README's first command, twice): no
# checkpoint at all, or only a last save that holds weights (nothing to resume).
FINISHED = {"no_checkpoint": ["--checkpoint.enable", "false"],
            "model_only_last_save": ["--checkpoint.interval", "10", "--checkpoint.last_save_model_only", "true"]}


@pytest.mark.parametrize("case", list(FINISHED))
def test_rerunning_a_finished_run_is_refused_unless_overwrite_is_asked_for(capsys, tmp_path, case) -> None:
    run = tmp_path / "run"
    argv = ["train", *TINY, "--job.dump_folder", run, "--training.steps", "2", "--metrics.log_freq", "1",
            *FINISHED[case]]
    assert _main(capsys, *argv)[0] == 0
    (tmp_path / "run-2").mkdir()  # taken: the fix names the next free name
    before = _files(run)
    log = (run / "logs" / "rank0.log").read_text()
    _one_error(*_main(capsys, *argv), f'job.dump_folder = "{run}": holds a finished run of this config '
               "(metrics.jsonl: steps 1-2 of 2), whose history this run, starting again at step 1 without a "
               "checkpoint to resume (checkpoint.enable), would replace",
               f"fix: give this run its own folder (--job.dump_folder {run}-3), or pass --job.overwrite true")
    assert _files(run) == before and (run / "logs" / "rank0.log").read_text() == log
    # Asked for by name: the history is this run's, the earlier log kept above the new one's.
    status, err = _main(capsys, *argv, "--job.overwrite", "true")
    assert status == 0 and f"job.overwrite is true: the history in {run / 'metrics.jsonl'} (steps 1-2) is " \
        "replaced by this run's" in err, err
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and read_metrics(run) != before["metrics.jsonl"]
    assert (run / "logs" / "rank0.log").read_text().startswith(log)
    # ... and the next rerun of the run that overwrote is refused alike (job.overwrite is no difference).
    _one_error(*_main(capsys, *argv), "holds a finished run of this config")


def test_rerunning_a_finished_run_with_a_checkpoint_trains_nothing_and_says_so(capsys, tmp_path) -> None:
    argv = ["train", *TINY, "--job.dump_folder", tmp_path, "--training.steps", "2", "--checkpoint.interval", "2"]
    assert _main(capsys, *argv)[0] == 0
    before = (tmp_path / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "training llama4 tiny (" in out and ": finished at step 2 already, nothing to train (raise " \
        "training.steps to train on)" in out, out
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


REFUSED_AT_LOAD = {
    "another_flavor": (["--model.flavor", "bench256"], 'model.flavor = "bench256"'),
    "a_load_step_not_saved": (["--checkpoint.load_step", "7"], "checkpoint.load_step = 7"),
    "a_seed_run_over_a_history": (["--checkpoint.create_seed_checkpoint", "true"], "holds the metrics.jsonl of "
                                  "another run (steps 1-1; its config differs in checkpoint.create_seed_checkpoint)"),
}


@pytest.mark.parametrize("case", list(REFUSED_AT_LOAD))
def test_a_refused_run_leaves_the_folder_as_it_found_it(capsys, tmp_path, case) -> None:
    """Refused once it has read the folder (exit 2): config.toml, run_info.json and metrics.jsonl
    are the earlier run's, and `torchmoe report` still reads the folder."""
    flags, expected = REFUSED_AT_LOAD[case]
    assert _main(capsys, "train", *TINY, "--job.dump_folder", tmp_path)[0] == 0
    before = _files(tmp_path)
    _one_error(*_main(capsys, "train", *TINY, "--job.dump_folder", tmp_path, *flags), expected)
    assert _files(tmp_path) == before
    assert _main(capsys, "report", tmp_path, "--out", tmp_path / "r.png")[0] == 0


def _files(folder: Path) -> dict[str, bytes]:
    """The files of `folder` and their bytes, but the lock's (whoever holds it says so there)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != LOCK_NAME}


# ---- empty paths ------------------------------------------------------------------------------

EMPTY = {  # flag, value, the key named, what it would have meant
    "dump_folder": ("--job.dump_folder", "", "job.dump_folder", "the current directory"),
    "checkpoint_folder": ("--checkpoint.folder", "", "checkpoint.folder", "the dump folder itself"),
    "tb_folder_blank": ("--metrics.save_tb_folder", " ", "metrics.save_tb_folder", "the dump folder itself"),
    "trace_folder": ("--profiling.save_traces_folder", "", "profiling.save_traces_folder", "the dump folder itself"),
    "snapshot_folder": ("--profiling.save_memory_snapshot_folder", "", "profiling.save_memory_snapshot_folder",
                        "the dump folder itself"),
    "comm_trace_folder": ("--comm.save_traces_folder", "", "comm.save_traces_folder", "the dump folder itself"),
    "tokenizer": ("--model.tokenizer_path", "", "--model.tokenizer_path",
                  "model.tokenizer_path not set (the byte tokenizer)"),
    "initial_load_path": ("--checkpoint.initial_load_path", "", "--checkpoint.initial_load_path",
                          "checkpoint.initial_load_path not set (random initial weights)"),
    "dataset_blank": ("--training.dataset_path", "  ", "--training.dataset_path",
                      "training.dataset_path not set (no dataset files)"),
    "config_file": ("--config", "", "--config", "the current directory"),
}


_WRITES = {"--metrics.save_tb_folder": ["--metrics.enable_tensorboard", "true"],
           "--profiling.save_traces_folder": ["--profiling.enable_profiling", "true"],
           "--profiling.save_memory_snapshot_folder": ["--profiling.enable_memory_snapshot", "true"]}


@pytest.mark.parametrize("case", list(EMPTY))
def test_an_empty_path_is_refused_before_anything_is_written(capsys, tmp_path, monkeypatch, case) -> None:
    """What an unset shell variable gives: never the current directory (here the user's own files)."""
    flag, value, key, means = EMPTY[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.toml").write_text("# the user's own\n")
    job = TINY[2:] if flag == "--config" else TINY  # --config once
    switch = _WRITES.get(flag, [])  # the folder is written (else the flag would have no effect: `dependent_keys`)
    status, err = _main(capsys, "train", *job, *switch, "--job.dump_folder", tmp_path / "run", flag, value)
    _one_error(status, err, f'{key} = "{value}": an empty path (an unset shell variable?), which would mean {means}')
    assert sorted(os.listdir(tmp_path)) == ["config.toml"]
    assert (tmp_path / "config.toml").read_text() == "# the user's own\n"


def test_an_empty_path_in_the_job_file_and_in_other_commands_is_refused(capsys, tmp_path) -> None:
    (tmp_path / "job.toml").write_text(f'[job]\ndump_folder = "{tmp_path / "run"}"\n[checkpoint]\nfolder = ""\n')
    _one_error(*_main(capsys, "train", "--config", tmp_path / "job.toml"), 'checkpoint.folder = "": an empty path')
    _one_error(*_main(capsys, "report", ""), 'DUMP_FOLDER = "": an empty path')
    _one_error(*_main(capsys, "report", tmp_path, "--out", ""), '--out = "": an empty path')
    _one_error(*_main(capsys, "convert", "hf-to-dcp", tmp_path, ""), 'OUT_DIR = "": an empty path')
    _one_error(*_main(capsys, "convert", "dcp-to-hf", "", tmp_path / "o", "--flavor", "tiny"),
               'CKPT_DIR = "": an empty path')
    assert sorted(os.listdir(tmp_path)) == ["job.toml"]


# ---- symbolic links ------------------------------------------------------------------------------

LINKS = {  # the link, under tmp/run; the key named; flags; whether the target is a folder
    "config_toml": ("config.toml", "job.dump_folder", [], False),
    "run_info": ("run_info.json", "job.dump_folder", [], False),
    "lock_file": (LOCK_NAME, "job.dump_folder", [], False),
    "metrics": ("metrics.jsonl", "job.dump_folder", [], False),
    "wandb_run_id": ("wandb_run_id", "job.dump_folder", ["--metrics.enable_wandb", "true"], False),
    "shared_checkpoint": ("checkpoint/step-1", "checkpoint.folder", [], True),
    "stale_temporary": ("checkpoint/step-1.tmp-0123abcd", "checkpoint.folder", [], True),
    "hf_export": ("checkpoint/step-1-hf", "checkpoint.folder", ["--checkpoint.last_save_in_hf", "true", *HF_EXPORT],
                  True),
    "trace_iteration": ("profile_traces/iteration_1", "profiling.save_traces_folder",
                        ["--profiling.enable_profiling", "true"], True),
    "dry_run_json": ("dry_run.json", "job.dump_folder", ["--dry-run"], False),
    "data_index": ("data_index", "job.dump_folder", [], True),  # the data files' line indexes
    "log_folder": ("logs", "job.dump_folder", [], True),  # each rank's log file
    "log_file": ("logs/rank0.log", "job.dump_folder", [], False),
}


@pytest.mark.parametrize("case", list(LINKS))
def test_a_link_where_the_run_writes_is_refused_at_start(capsys, tmp_path, monkeypatch, case) -> None:
    """A link the run did not make is never written or pruned through: the target (another run's
    file, a shared checkpoint's marker) is untouched, one message names the link."""
    name, key, flags, folder = LINKS[case]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    target = tmp_path / "precious"
    if folder:
        target.mkdir()
        (target / ".complete").write_text("kept")
    else:
        target.write_text("kept")
    link = tmp_path / "run" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    status, err = _main(capsys, "train", *TINY, "--job.dump_folder", tmp_path / "run", *flags)
    _one_error(status, err, f"{key} = ", f"{link} is a symbolic link (to {target}): a run never writes or deletes "
               "through a link it did not make", "fix: remove the link")
    assert (target / ".complete" if folder else target).read_text() == "kept"
    assert link.is_symlink()


def test_a_dump_folder_that_is_a_link_is_the_folder_it_names(capsys, tmp_path) -> None:
    """The folders the keys name may be links (a scratch disk): each is locked where it really is."""
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real", target_is_directory=True)
    assert _main(capsys, "train", *TINY, "--job.dump_folder", tmp_path / "run")[0] == 0
    assert (tmp_path / "real" / "checkpoint" / "step-1" / ".complete").is_file()
    (tmp_path / "precious.png").write_text("kept")
    (tmp_path / "real" / "elsewhere.png").symlink_to(tmp_path / "precious.png")
    _one_error(*_main(capsys, "report", tmp_path / "run", "--out", tmp_path / "real" / "elsewhere.png"),
               f"elsewhere.png\": is a symbolic link (to {tmp_path / 'precious.png'}): an output never replaces a link "
               "nor writes through one")
    assert (tmp_path / "precious.png").read_text() == "kept"
