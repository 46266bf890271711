"""Fault tolerance on this machine (CPU, gloo): what torchft replica groups cost and how fast they
recover. 2 groups x 2 ranks (FSDP 2 inside each) of the debugmodel flavor, a lighthouse here.

    python scripts/bench_ft.py                  # ~4 min; writes outputs/bench_ft.json

    overhead        median step seconds of the 2 groups against HSDP 2 x 2 in one torchrun world
                    (same job, same rows), no failure, with the quorum formed before each step
                    (sync) and during its forward (async_quorum); the difference is the exposed
                    cost of crossing groups
    blocked         median seconds per step the training thread waited on work across groups
                    (the metrics' ft_blocked_s: quorum, FSDP's all-reduce hooks, the small
                    collective, the commit)
    traffic         median collectives across groups per step and MB a rank sent into them
                    (the metrics' ft_collectives and ft_bytes)
    failure_to_step seconds from `kill -9` of group 1 (in its step 6) to group 0's next step
                    (the failed step's retry without it)
    recovery        seconds from group 1's new launch to its first step with group 0, and the
                    step it took the live state of

Steps 1-2 are left out of the medians (start-up and warm-up). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/launch.py: test-harness code, not in the installed package
from tests.launch import Lighthouse, ReplicaGroup, read_metrics, run_replica_groups, run_train  # noqa: E402

STEPS = 20
JOB = ["--config", str(REPO / "configs" / "debug_model.toml"), "--model.flavor", "debugmodel",
       "--training.seq_len", "256", "--training.local_batch_size", "4", "--training.steps", str(STEPS),
       "--metrics.log_freq", "1"]
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
      "--fault_tolerance.process_group_timeout_ms", "5000"]


def _step_seconds(records: list[dict], tokens_per_step: int) -> float:
    """Median seconds per step from the records' tokens/s, steps 1-2 left out."""
    return statistics.median(tokens_per_step / r["tokens_per_sec"] for r in records if r["step"] > 2)


def overhead(tmp: Path) -> dict:
    run_train([*JOB, "--parallelism.data_parallel_replicate_degree", "2"], dump_folder=tmp / "hsdp", nproc=4)
    hsdp = _step_seconds(read_metrics(tmp / "hsdp"), 4 * 4 * 256)
    result = {"hsdp_2x2_step_s": hsdp}
    for mode, flags in (("sync", []), ("async", ["--fault_tolerance.async_quorum", "true"])):
        groups = run_replica_groups([*JOB, *FT, *flags], tmp / f"ft_{mode}", "--min-replicas", "2")
        step = statistics.mean(_step_seconds(group.records(), 2 * 4 * 256) for group in groups)
        blocked, collectives, sent = (
            statistics.mean(statistics.median(r[key] for r in group.records() if r["step"] > 2) for group in groups)
            for key in ("ft_blocked_s", "ft_collectives", "ft_bytes"))
        result |= {f"ft_2x2_{mode}_step_s": step, f"ft_{mode}_overhead": step / hsdp - 1,
                   f"ft_{mode}_blocked_s": blocked, f"ft_{mode}_collectives": collectives,
                   f"ft_{mode}_sent_mb": sent / 1e6}
    return result


def failure(tmp: Path) -> dict:
    out = tmp / "failure"
    lighthouse = Lighthouse(tmp / "lighthouse-failure.log", "--min-replicas", "1")
    try:
        survivor, doomed = (ReplicaGroup(g, [*JOB, *FT], out, lighthouse) for g in (0, 1))
        doomed.wait_for(lambda r: bool(r) and r[-1]["step"] >= 5, "group 1 reaches step 5")
        doomed.kill()
        killed = time.monotonic()
        before = survivor.last_step()
        survivor.wait_for(lambda r: bool(r) and r[-1]["step"] > max(before, 5), "group 0 steps without group 1")
        failure_to_step = time.monotonic() - killed
        back = ReplicaGroup(1, [*JOB, *FT], out, lighthouse, tag="-restarted")
        rejoin = back.wait_for(lambda r: bool(r) and r[-1]["step"] > 6, "group 1 steps again")
        survivor.finish()
        back.finish()
    finally:
        lighthouse.close()
    log = back.log.read_text()
    marker = "recovered the live state of step "
    recovered_step = int(log.split(marker, 1)[1].split()[0]) if marker in log else None
    alone = [r["step"] for r in survivor.records() if r["step"] > 5 and r["ft_participants"] == 1]
    return {"failure_to_next_step_s": failure_to_step, "restart_to_first_step_s": rejoin,
            "recovered_step": recovered_step, "survivor_steps_alone": alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/bench_ft.json")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        result = {"date": time.strftime("%Y-%m-%d"), "job": "debugmodel, seq 256, local batch 4, 2 groups x 2 ranks",
                  **overhead(tmp), **failure(tmp)}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
