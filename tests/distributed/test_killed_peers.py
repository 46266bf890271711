"""A peer or the launcher killed, or a signal before training: the processes left end quietly and
quickly, each with one line and no traceback (`torchmoe.distributed.failure`,
`torchmoe.distributed.launcher`, `torchmoe.interruption`).

    python -m pytest -q tests/distributed/test_killed_peers.py

Every survivor must be gone within `SURVIVOR_S` of the fault (the collectives' timeouts are
600 s, so no timeout ends a run), every test within 30 s of its start of training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.rank_processes import start_ranks, torchrun, wait_all
from tests.helpers import DEBUG_CONFIG, TINY_JOB
from torchmoe.launch import cli_command, cli_env, read_metrics

pytestmark = pytest.mark.distributed

SURVIVOR_S = 3.0
JOB = [*TINY_JOB, "--training.local_batch_size", "4", "--training.steps", "200", "--metrics.log_freq", "1",
       "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
LOST = ("stopped: a rank died without reporting an error (killed, out of memory, or its node failed; the "
        "launcher's log names it): rank {rank} lost its connection to 127.0.0.1:")


def _until(predicate, procs: list[subprocess.Popen], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), what
        time.sleep(0.05)


def _trained(folder: Path, steps: int = 2):
    return lambda: (folder / "metrics.jsonl").is_file() and len(read_metrics(folder)) >= steps


def _one_line(text: str) -> str:
    """The output's only line besides the progress lines of training steps."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("step ")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def _rank_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the running processes whose command line holds `marker`."""
    found = {}
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit() or marker not in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                continue
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except OSError:  # gone meanwhile
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:  # a worker, not the launcher
            found[int(env["RANK"])] = int(pid)
    return found


@pytest.mark.parametrize("layout", [
    [],  # FSDP 2: the all-gathers and reduce-scatters
    ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
     "--training.local_batch_size", "8"],  # PP 2: point-to-point activations
], ids=["fsdp2", "pp2"])
def test_a_peer_killed_without_torchrun_ends_the_store_host_in_one_line(tmp_path: Path, layout: list[str]) -> None:
    """Ranks started by hand (srun): `kill -9` of rank 1 while training. Rank 0 (hosting the store)
    finds its collective's peer gone: one line saying so, exit 1 (before: a 40-line "Connection
    reset by peer" traceback after 6 s, waiting for an ack the dead rank never sends)."""
    procs = start_ranks(JOB, "none", tmp_path, layout)
    _until(_trained(tmp_path), procs, "training did not start")
    killed_at = time.time()
    procs[1].send_signal(signal.SIGKILL)
    outs, ends = wait_all(procs, timeout=30)
    assert procs[0].returncode == 1 and ends[0] - killed_at < SURVIVOR_S, (ends[0] - killed_at, outs[0])
    assert _one_line(outs[0]).startswith("[rank 0] " + LOST.format(rank=0)), outs[0]


def test_a_rank_killed_during_a_save_under_torchrun_ends_the_other_in_one_line(tmp_path: Path) -> None:
    """torchrun: rank 0 is killed while writing a checkpoint (its write hangs), rank 1 waits in
    the save's gather. Rank 1 says the peer is gone, in one line, neither taking torchrun's
    SIGTERM for a preemption nor trying to save again (before: a gloo traceback after 7 s)."""
    proc = torchrun([*JOB, "--training.steps", "6", "--checkpoint.interval", "2"], "hang_save", tmp_path, [],
                    FAIL_RANK="0")
    _until(lambda: (tmp_path / "blocked").exists(), [proc], "rank 0 never reached its save")
    marker = f"hang_save {tmp_path}"
    _until(lambda: len(_rank_pids(marker)) == 2, [proc], "the workers are not listed")
    killed_at = time.time()
    os.kill(_rank_pids(marker)[0], signal.SIGKILL)
    _until(lambda: 1 not in _rank_pids(marker), [proc], "rank 1 is still running", timeout=30)
    assert time.time() - killed_at < SURVIVOR_S
    (out,), _ = wait_all([proc], timeout=30)
    worker_lines = [line for line in out.splitlines() if line.startswith("[rank 1]")]
    assert len(worker_lines) == 1 and worker_lines[0].startswith("[rank 1] " + LOST.format(rank=1)), out
    assert "[rank1]: Traceback" not in out and "received SIGTERM" not in out, out
    assert not (tmp_path / "checkpoint" / "step-2").exists()


def test_a_killed_launcher_stops_its_workers_without_a_save(tmp_path: Path) -> None:
    """`kill -9` of torchrun's process group: its workers (in sessions of their own) notice their
    launcher is gone within 2 s and leave with one line each, writing nothing more (before: they
    trained 16 more steps and wrote 4 checkpoints)."""
    cmd = cli_command(["train", *JOB, "--checkpoint.interval", "2", "--job.dump_folder", tmp_path], nproc=2)
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _until(_trained(tmp_path, 3), [proc], "training did not start")
    marker = f"--job.dump_folder {tmp_path}"
    workers = _rank_pids(marker)
    assert sorted(workers) == [0, 1]
    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    steps, saved = len(read_metrics(tmp_path)), sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    _until(lambda: not _rank_pids(marker), [], "the workers outlived their launcher by 30 s", timeout=30)
    assert time.time() - killed_at < 2.0 + 0.5  # the watch polls every 0.5 s
    assert len(read_metrics(tmp_path)) <= steps + 1  # at most the step in flight
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if ".tmp-" not in p.name) <= saved + [
        f"step-{2 * (steps // 2 + 1)}"]  # at most a save that was complete before its worker left
    out = proc.stdout.read()  # the workers wrote into the launcher's pipe
    for rank in (0, 1):
        # Whichever notices first: the launcher watch, or the failure watch losing the store the
        # launcher hosted.
        said = [line for line in out.splitlines() if line.startswith(f"[rank {rank}]")]
        assert len(said) == 1 and (
            said[0] == f"[rank {rank}] stopped: its launcher (torchrun, pid {proc.pid}) is gone; leaving without saving"
            or said[0].startswith(f"[rank {rank}] stopped: lost the rendezvous store at ")), out
    assert "Traceback" not in out, out


def _handlers_installed(pid: int) -> bool:
    """SIGTERM and SIGINT are caught (torchmoe's handlers, not Python's start-up defaults)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return all(caught >> (sig - 1) & 1 for sig in (signal.SIGTERM, signal.SIGINT))


@pytest.mark.parametrize(("args", "sig"), [
    (["train", "--config", DEBUG_CONFIG], signal.SIGTERM),  # during the imports and building the job
    (["train", "--config", DEBUG_CONFIG, "--dry-run", "--world-size", "64", "--parallelism.tensor_parallel_degree",
      "8"], signal.SIGINT),  # Ctrl-C in a dry run
], ids=["sigterm_starting", "ctrl_c_dry_run"])
def test_a_signal_before_training_is_one_line_and_128_plus_its_number(tmp_path: Path, args, sig) -> None:
    proc = subprocess.Popen(cli_command([*args, "--job.dump_folder", tmp_path]), env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _until(lambda: _handlers_installed(proc.pid), [proc], "no handlers installed")
    proc.send_signal(sig)
    (out,), _ = wait_all([proc], timeout=30)
    assert proc.returncode == 128 + sig, out
    assert _one_line(out) == f"interrupted by {signal.Signals(sig).name}: stopped", out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_sigterm_to_torchrun_before_training_ends_every_worker_in_one_line(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to its workers; before training (here: while they import and
    build) each says so in one line and exits 143, and the launcher follows."""
    proc = subprocess.Popen(cli_command(["train", *JOB, "--job.dump_folder", tmp_path], nproc=2), env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = f"--job.dump_folder {tmp_path}"
    _until(lambda: len(_rank_pids(marker)) == 2 and all(map(_handlers_installed, _rank_pids(marker).values())), [proc],
           "the workers did not start")
    proc.send_signal(signal.SIGTERM)
    (out,), _ = wait_all([proc], timeout=30)
    # Each worker: its own interruption, or (when the other was first to report one) that one.
    said = {int(line.split("]")[0].removeprefix("[rank ")): line for line in out.splitlines() if line.startswith("[rank ")}
    assert sorted(said) == [0, 1], out
    for rank, line in said.items():
        assert line == f"[rank {rank}] interrupted by SIGTERM: stopped" or line == \
            f"[rank {rank}] stopped because rank {1 - rank} failed (its error is reported by rank {1 - rank})", out
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
