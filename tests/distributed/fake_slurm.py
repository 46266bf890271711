"""`scripts/multinode.slurm` run as SLURM would run it, on this machine: two "nodes", both localhost.

    proc = sbatch(tmp_path, [CONFIG, *overrides], job_id=4242)   # dump folder: tmp_path/outputs/torchmoe-4242

SLURM itself is replaced by two small shell stand-ins on PATH: `scontrol show hostnames` names the
job's nodes, all localhost, and `srun` starts its command once per node (as `--ntasks-per-node=1`
does) and returns the first failure. Everything else (the script's rendezvous endpoint, node
count, ranks per node, per-job dump folder) is the script as users run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.launch import cli_env, free_port

# `scontrol show hostnames`: one localhost per node of the job, in one write (the script reads
# the first with `| head -n 1` under pipefail: a later write into the closed pipe would fail it).
SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then printf 'localhost\\n%.0s' $(seq 1 "$SLURM_NNODES"); fi
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


def dump_folder(root: Path, job_id: int) -> Path:
    """Where the script puts job `job_id`'s dump folder (job name torchmoe, DUMP_ROOT root/outputs)."""
    return root / "outputs" / f"torchmoe-{job_id}"


def sbatch(root: Path, args: list[str], *, job_id: int, srun: str = SRUN,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`scripts/multinode.slurm ARGS` as SLURM runs it for job `job_id` on two nodes of 2 CPU ranks
    each (`env` overrides the variables SLURM and the user set; `srun` replaces the srun stand-in);
    fails on a nonzero exit status."""
    bin_dir = root / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir(parents=True)
        for name, text in (("scontrol", SCONTROL), ("srun", srun)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    env = {**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": str(job_id),
           "SLURM_JOB_NAME": "torchmoe", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
           "DUMP_ROOT": str(root / "outputs"), **(env or {})}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "multinode.slurm"), *args], env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
