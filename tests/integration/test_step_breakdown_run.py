"""`[profiling] enable_step_breakdown` in a real run: FSDP over 2 gloo ranks writes every rank's
breakdown next to the traces and logs rank 0's table, communication included.

    python -m pytest -q -m integration tests/integration/test_step_breakdown_run.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import train_tiny

pytestmark = pytest.mark.integration


def test_fsdp_run_writes_and_logs_the_breakdown(tmp_path: Path) -> None:
    proc = train_tiny(tmp_path, ["--training.steps", "2", "--training.local_batch_size", "4",
                                 "--parallelism.data_parallel_shard_degree", "2",
                                 "--profiling.enable_step_breakdown", "true", "--profiling.profile_freq", "2"],
                      nproc=2)
    folder = tmp_path / "profile_traces" / "iteration_2"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_breakdown.json", "rank1_breakdown.json"]  # no traces
    for rank in (0, 1):
        table = json.loads((folder / f"rank{rank}_breakdown.json").read_text())
        assert (table["rank"], table["step"], table["steps"]) == (rank, 2, 1)
        shares = {key: row["share"] for key, row in table["categories"].items()}
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        for key in ("attention", "routed_experts", "ffn", "router", "communication", "optimizer", "data"):
            assert shares[key] > 0, (rank, key)
    assert "Traceback" not in proc.stderr
    log = proc.stderr[proc.stderr.index("rank 0, traced steps to step 2"):]
    assert "step-time breakdown over 1 step: " in log
    for name in ("attention", "routed experts", "shared/dense FFN", "router + dispatch/combine", "communication",
                 "optimizer", "embedding/norms/loss/other"):
        assert f"\n  {name} " in log, name
