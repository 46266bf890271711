"""The machine calibration on 2 CPU ranks (gloo): every collective fitted, the overlap measured,
one profile for all ranks, written once (by rank 0), and the process group it created gone.

    python -m pytest -q tests/distributed/test_calibrate_world.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_rank_script
from tests.launch import cli_env, free_port

WORLD = 2


def _worker(out_dir: Path) -> None:
    """Runs on every rank: calibrate the debug job, counting this rank's file writes."""
    import torch.distributed as dist

    import torchmoe.commands.calibrate as calibration
    from torchmoe.config.loader import load_job_config

    writes = []
    write_output = calibration.write_output

    def counted(key, path, data, fix):
        writes.append(str(path))
        write_output(key, path, data, fix)

    calibration.write_output = counted
    cfg = load_job_config(["--config", str(REPO / "configs" / "debug_model.toml")])
    doc = calibration.calibrate(cfg, out_dir / "profile.json", budget_s=4.0)
    record = {"doc": doc, "writes": writes, "group_left": not dist.is_initialized()}
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[dict[int, dict], Path]:
    out = tmp_path_factory.mktemp("calibrate")
    return run_rank_script(__file__, out, world=WORLD, timeout=180), out


@pytest.mark.distributed
def test_every_rank_returns_the_profile_rank_0_wrote_once(records):
    by_rank, out = records
    written = out / "profile.json"
    assert by_rank[0]["writes"] == [str(written)] and by_rank[1]["writes"] == []
    assert by_rank[0]["doc"] == by_rank[1]["doc"] == json.loads(written.read_text())
    assert by_rank[0]["group_left"] and by_rank[1]["group_left"]


@pytest.mark.distributed
def test_collectives_are_fitted_and_the_overlap_measured(records):
    from torchmoe.plan.hardware import COLLECTIVES, load_profile

    by_rank, out = records
    profile = load_profile(str(out / "profile.json"))
    assert set(profile.collectives) == set(COLLECTIVES)
    for link in profile.collectives.values():
        assert link.bandwidth_gbs > 0 and link.latency_us >= 0
    assert profile.intra_node == profile.inter_node == profile.collectives["all_gather"]
    tables = profile.measurements["collectives"]
    assert set(tables) == set(COLLECTIVES)
    for table in tables.values():
        assert [size for size, _ in table] == [4096 * 4**i for i in range(6)]  # divisible by 2 ranks
        assert all(seconds > 0 for _, seconds in table)
    assert 0.0 <= profile.overlap <= 1.0
    overlap = profile.measurements["overlap"]
    assert overlap["compute_s"] > 0 and overlap["comm_s"] > 0 and overlap["both_s"] > 0
    assert profile.gpus_per_node == WORLD and profile.measurements["world_size"] == WORLD
    for op in ("matmul", "attention", "grouped_mm"):
        assert all(rate > 0 for rate in profile.achieved_tflops[op].values())
    assert "one node measured" in profile.source


# Ranks whose measurement fails unexpectedly, run as `python -m torchmoe` runs (`cli.run`).
_FAILING_RANK = """
import os, sys
import torchmoe.commands.calibrate

def calibrate(*args, **kwargs):
    raise RuntimeError(f"rank {os.environ['RANK']} measured nothing")

torchmoe.commands.calibrate.calibrate = calibrate  # on both: a peer left waiting would take torchrun 30 s to stop
sys.argv = ["torchmoe", "plan", "--calibrate", sys.argv[1], "--config", sys.argv[2], "--budget", "1"]
from torchmoe.commands.cli import run
run()
"""


@pytest.mark.distributed
def test_an_unexpected_error_on_one_rank_is_named_in_torchruns_summary(tmp_path: Path) -> None:
    """Under torchrun, a rank's unexpected error (not a user's mistake) reaches the failure
    summary torchrun prints last, with its traceback (before: "error_file: <N/A>" there, and the
    traceback somewhere above among every rank's output)."""
    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         str(script), str(tmp_path / "profile.json"), str(REPO / "configs" / "debug_model.toml")],
        env={**cli_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    rank = re.search(r"rank      : (\d) \(local_rank: \d\)", summary).group(1)
    assert "error_file: <N/A>" not in summary, proc.stderr
    assert summary.rstrip("= \n").endswith(f"RuntimeError: rank {rank} measured nothing"), summary
    assert not (tmp_path / "profile.json").exists()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
