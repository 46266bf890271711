"""A peer or the launcher killed, or a signal before training: the processes left end quietly and
quickly, each with one line and no traceback (`torchmoe.distributed.failure`,
`torchmoe.distributed.launcher`, `torchmoe.distributed.interruption`).

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
from tests.launch import cli_command, cli_env, free_port, read_metrics

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
    """The output's only line besides the run's opening (its description, the "training ..."
    line and the CPU threads it computes with), the progress lines of training steps and the
    run's own INFO log (the attention kernel it runs, ...)."""
    all_lines = text.splitlines()
    opening = next((i + 1 for i, line in enumerate(all_lines) if line.startswith("training ")), 0)
    lines = [line for line in all_lines[opening:] if line.strip() and not line.startswith(("step ", "CPU threads: "))
             and " INFO torchmoe." not in line]
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


def test_a_killed_launcher_stops_its_worker_without_half_a_state(tmp_path: Path) -> None:
    """Two torchrun "nodes" of one rank each, meeting at a c10d rendezvous that node 0's launcher
    hosts. `kill -9` of node 1's launcher process group: its worker (in a session of its own, and
    still holding a live store on node 0) notices its launcher is gone within 2 s and leaves with
    one line (before: orphaned workers trained 16 more steps and wrote 4 checkpoints), every
    checkpoint on disk complete. Node 0's worker then finds its peer gone."""
    port, dump = free_port(), str(tmp_path)

    def node() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "killed-launcher",
             "-m", "torchmoe", "train", *JOB, "--checkpoint.interval", "2", "--job.dump_folder", dump],
            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    host = node()  # started first, it binds the rendezvous store
    time.sleep(1.0)
    nodes = [host, node()]
    _until(_trained(tmp_path, 3), nodes, "training did not start")
    marker = f"--job.dump_folder {dump}"
    workers = _rank_pids(marker)
    assert sorted(workers) == [0, 1]
    # The worker whose launcher is killed: node 1's (its rank is the rendezvous' choice).
    rank = next(r for r, pid in workers.items() if Path(f"/proc/{pid}/stat").read_text().split()[3] == str(nodes[1].pid))
    os.killpg(nodes[1].pid, signal.SIGKILL)
    killed_at = time.time()
    _until(lambda: not _rank_pids(marker), [], "the workers outlived the launcher by 30 s", timeout=30)
    assert time.time() - killed_at < 2.0 + SURVIVOR_S  # the orphan within 2 s, its peer right after
    # No half-state: whatever the workers saved before they left is complete (a save in flight
    # stays a temporary folder, never loaded, removed by the next run).
    saved = [p for p in (tmp_path / "checkpoint").glob("step-*") if ".tmp-" not in p.name]
    assert saved and all((p / ".complete").is_file() for p in saved), saved
    (survivor,), _ = wait_all([host], timeout=30)
    orphan = nodes[1].stdout.read()  # the orphan wrote into its dead launcher's pipe
    assert _one_line(orphan) == \
        f"[rank {rank}] stopped: its launcher (torchrun, pid {nodes[1].pid}) is gone; leaving without saving", orphan
    assert f"[rank {1 - rank}] {LOST.format(rank=1 - rank)}" in survivor, survivor
    assert f"[rank{1 - rank}]: Traceback" not in survivor, survivor


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
