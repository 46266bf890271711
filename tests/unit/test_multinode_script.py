"""`scripts/multinode.slurm` as docs/multinode.md shows it, with an `srun` that prints what each node
would run instead of running it: the torchrun command line per node, checked argument by argument.
(Training through the script on two torchrun "nodes" is `tests/distributed/test_layout_parity.py`.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import fake_slurm
from tests.launch import free_port

# srun's stand-in: one line per node with the command it would start there.
PRINTING_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do echo "node $node: $*"; done
"""

SCOUT = "configs/llama4_16e.toml"


def _torchrun_lines(root: Path, args: list[str], job_id: int, **env: str) -> tuple[list[str], str]:
    """(the command each node starts, the script's banner) for `sbatch --nodes 4 ... multinode.slurm ARGS`
    on nodes of 8 GPUs, the variables the docs leave out unset."""
    proc = fake_slurm.sbatch(root, args, job_id=job_id, srun=PRINTING_SRUN,
                             env={"SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8", "NPROC_PER_NODE": "",
                                  "MASTER_PORT": "", **env})
    lines = proc.stdout.splitlines()
    return [line.split(": ", 1)[1] for line in lines if line.startswith("node ")], lines[0]


def _expected(root: Path, job_id: int, folder: str, overrides: list[str]) -> str:
    port = 29500 + job_id % 1000
    return " ".join([
        "python -m torch.distributed.run --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d",
        f"--rdzv_endpoint localhost:{port} --rdzv_id torchmoe-{job_id} --max_restarts 0 --shutdown_timeout 110",
        f"-m torchmoe train --config {SCOUT} --checkpoint.enable true",
        f"--job.dump_folder {root / 'outputs' / folder}", *overrides])


def test_sbatch_starts_one_torchrun_per_node_with_the_config_and_overrides(tmp_path: Path) -> None:
    # sbatch --nodes 4 scripts/multinode.slurm configs/llama4_16e.toml --parallelism.tensor_parallel_degree 8
    commands, banner = _torchrun_lines(tmp_path, [SCOUT, "--parallelism.tensor_parallel_degree", "8"], job_id=1234)
    assert banner == (f"torchmoe: 4 nodes x 8 ranks, rendezvous localhost:29734, "
                      f"dump folder {tmp_path / 'outputs' / 'torchmoe-1234'}")
    assert commands == [_expected(tmp_path, 1234, "torchmoe-1234", ["--parallelism.tensor_parallel_degree", "8"])] * 4


def test_run_name_names_the_dump_folder_a_new_job_continues(tmp_path: Path) -> None:
    # RUN_NAME=scout-pretrain sbatch --nodes 4 scripts/multinode.slurm configs/llama4_16e.toml
    commands, _ = _torchrun_lines(tmp_path, [SCOUT], job_id=98765, RUN_NAME="scout-pretrain")
    assert commands == [_expected(tmp_path, 98765, "scout-pretrain", [])] * 4


def test_the_head_node_of_a_large_allocation_is_read_without_a_broken_pipe(tmp_path: Path) -> None:
    # On 2,048 nodes `scontrol show hostnames` writes more than a pipe holds; `| head -n 1` under
    # pipefail then killed the script silently (SIGPIPE), and at random with fewer nodes.
    commands, banner = _torchrun_lines(tmp_path, [SCOUT], job_id=7, SLURM_NNODES="2048")
    assert banner.startswith("torchmoe: 2048 nodes x 8 ranks, rendezvous localhost:29507,")
    assert len(commands) == 2048 and all("--nnodes 2048 " in command for command in commands)


# srun's stand-in for a job step on part of the allocation: one line per node of the step
# (`--nodes N --relative FIRST`) with the command it would start there.
STEP_PRINTING_SRUN = """#!/bin/bash
nodes=$SLURM_NNODES; first=0
while [[ $1 == --* ]]; do
    case $1 in --nodes) nodes=$2; shift;; --relative) first=$2; shift;; --ntasks) shift;; esac
    shift
done
for ((node = first; node < first + nodes; node++)); do echo "node $node: $*"; done
"""


def test_ft_groups_split_the_nodes_into_replica_groups_with_a_lighthouse(tmp_path: Path) -> None:
    # FT_GROUPS=2 sbatch --nodes 4 scripts/multinode.slurm configs/llama4_16e.toml
    lighthouse_port = free_port()
    proc = fake_slurm.sbatch(tmp_path, [SCOUT], job_id=777, srun=STEP_PRINTING_SRUN,
                             env={"SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "8", "NPROC_PER_NODE": "",
                                  "MASTER_PORT": "", "FT_GROUPS": "2", "LIGHTHOUSE_PORT": str(lighthouse_port)})
    lines = proc.stdout.splitlines()
    assert f"torchmoe: 2 replica groups of 2 nodes, lighthouse http://localhost:{lighthouse_port}" in lines
    nodes = {int(line.split(":")[0].split()[1]): line.split(": ", 1)[1] for line in lines if line.startswith("node ")}
    assert sorted(nodes) == [0, 1, 2, 3]
    port = 29500 + 777 % 1000
    for node, command in nodes.items():
        group = node // 2
        assert command == " ".join([
            "python -m torch.distributed.run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d",
            f"--rdzv_endpoint localhost:{port + 2 + group} --rdzv_id torchmoe-777-group{group} --max_restarts 0",
            f"--shutdown_timeout 110 -m torchmoe train --config {SCOUT} --checkpoint.enable true",
            f"--job.dump_folder {tmp_path / 'outputs' / 'torchmoe-777'} --fault_tolerance.enable true",
            f"--fault_tolerance.group_size 2 --fault_tolerance.replica_id {group} --fault_tolerance.min_replica_size 1"])


def test_ft_groups_must_divide_the_nodes(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="FT_GROUPS=3 does not divide the 4 nodes"):
        fake_slurm.sbatch(tmp_path, [SCOUT], job_id=778, srun=STEP_PRINTING_SRUN,
                          env={"SLURM_NNODES": "4", "FT_GROUPS": "3"})
