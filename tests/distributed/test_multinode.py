"""Multi-node launch for real on one machine: `scripts/multinode.slurm` starts two torchrun "nodes"
(`--nnodes 2`, c10d rendezvous on localhost, 2 CPU ranks each) that train exactly what one
4-process torchrun trains.

SLURM itself is replaced by two small shell stand-ins on PATH: `scontrol show hostnames` names two
nodes, both localhost, and `srun` starts its command once per node (as `--ntasks-per-node=1`
does) and returns the first failure. Everything else (the script's rendezvous endpoint, node
count, ranks per node, per-job dump folder and resume) is the script as users run it.

The layout is HSDP, the usual multi-node shape: FSDP shards inside a node, replicas across nodes; the two worlds hold the same global ranks doing the same work, so losses and gradient norms
are equal bit for bit, and a second submission of the same run resumes from its checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, TINY_JOB, start_from, train_tiny
from torchmoe.launch import cli_env, free_port, metrics_by_step, read_metrics

pytestmark = pytest.mark.distributed

LAYOUT = ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"]

SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && printf 'localhost\\nlocalhost\\n'
"""

# One task per node: run the command (after srun's own options) once per node, in parallel.
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _sbatch(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`scripts/multinode.slurm` as SLURM runs it for job 4242 on two nodes of 2 ranks each."""
    env = {**cli_env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                               f"{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "torchmoe", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
           "DUMP_ROOT": str(tmp_path / "outputs")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "multinode.slurm"), DEBUG_CONFIG, *args], env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def two_nodes(seed, tmp_path_factory) -> Path:
    """The dump folder of the two-node run (job 4242), started from the seed checkpoint."""
    tmp_path = tmp_path_factory.mktemp("multinode")
    _fake_slurm(tmp_path / "bin")
    folder = start_from(seed, tmp_path / "outputs" / "torchmoe-4242")
    proc = _sbatch(tmp_path, [*TINY_JOB[2:], *LAYOUT])
    assert "2 nodes x 2 ranks, rendezvous localhost:" in proc.stdout
    return folder


def test_two_nodes_train_what_one_node_of_four_trains(two_nodes, seed, tmp_path):
    one_node = start_from(seed, tmp_path / "one_node")
    train_tiny(one_node, LAYOUT, nproc=4)
    got, ref = metrics_by_step(two_nodes), metrics_by_step(one_node)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        for key in ("loss", "grad_norm", "moe_imbalance", "tokens_per_expert"):
            assert got[step][key] == ref[step][key], (step, key)


def test_a_resubmitted_job_resumes_from_its_checkpoint(two_nodes):
    """SLURM requeues a job under its id: the same dump folder, so training continues at step 6."""
    _sbatch(two_nodes.parents[1], [*TINY_JOB[2:], *LAYOUT, "--training.steps", "7"])
    steps = [r["step"] for r in read_metrics(two_nodes)]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(p.name for p in (two_nodes / "checkpoint").iterdir()) == ["step-0", "step-5", "step-7"]
