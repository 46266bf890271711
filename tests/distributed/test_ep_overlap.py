"""Expert parallelism overlaps its all-to-alls with the shared expert, and compiles without other
graph breaks than the split-size read, nor recompiles after the first step.

    python -m pytest -q tests/distributed/test_ep_overlap.py

One torchrun world of 2 CPU/gloo ranks trains the tiny flavor on FSDP 2 x EP 2:

- eager, one profiled step read by `scripts/bench_ep.py`'s `overlap_report`: every forward and
  backward interval of the shared expert lies between an all-to-all's launch and its wait, so
  that the exchange can run meanwhile. Before the overlap the shared expert ran after the
  combine: no interval in a window. How much of the exchange it actually hides is a timing (a
  tiny exchange on 2 loaded cores may finish before the shared expert starts: 0 ms was measured
  in CI), so it is `scripts/bench_ep.py --overlap`'s number, not an assertion here.
- compiled, 4 steps whose routing changes every step (at step 3 one rank receives no row in one
  layer): the MoE blocks break their graphs at the split sizes' host read and at the routed
  experts' FSDP hooks only (the byte counter's recomputation check was another break), and no
  frame is compiled after the first step (the first compiles the split sizes symbolic after they
  change between the two MoE layers; the zero-row step recompiled 6 frames before shapes were
  size-oblivious). Breaks and recompiles are dynamo's, so the `aot_eager` backend shows them
  without inductor's compile time (a minute and a half more here); inductor's EP run is
  `test_expert_parallel.py`'s ep2_compile parity run.
"""

from __future__ import annotations

import importlib.util
import linecache
import logging
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, SHORT_DOCUMENTS, run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

# The short documents: their routing at step 3 sends no token of one layer to one rank's experts
# (a property of this data and seed, checked below, so a change of data order cannot hide it).
JOB = ["--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.local_batch_size", "2",
       "--parallelism.expert_parallel_degree", "2", "--model.load_balance_coeff", "0.05", *SHORT_DOCUMENTS]
COMPILED_STEPS = 4
FSDP_HOOKS = "torch/distributed/fsdp/_fully_shard/_fsdp_common.py"


def _bench_ep():
    spec = importlib.util.spec_from_file_location("bench_ep", REPO / "scripts" / "bench_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eager_overlap(out_dir: Path) -> dict:
    import torch

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    bench_ep = _bench_ep()
    trainer = Trainer(load_job_config([*JOB, "--job.dump_folder", str(out_dir / "eager")]))
    bench_ep.label_shared_experts(trainer.model)
    trainer.train_step(trainer.dataloader.next_batch())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(trainer.dataloader.next_batch())
    report = bench_ep.overlap_report(prof.events())
    return {"shared": len(report["shared"]), "shared_in_window": report["shared_in_window"],
            "windows": len(report["windows"])}


class _BreakSites(logging.Handler):
    """Collects where dynamo breaks graphs: ``path`` for torch's files, ``path: source line`` for
    the repo's."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"in user code at (\S+):(\d+)", record.getMessage())
        if match is None:
            return
        path, line = match[1], int(match[2])
        if path.startswith(str(REPO)):
            self.sites.add(f"{Path(path).relative_to(REPO)}: {linecache.getline(path, line).strip()}")
        else:
            self.sites.add(path[path.index("torch/"):])


def _compiled_steps(out_dir: Path) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    torch._logging.set_logs(graph_breaks=True)
    sites = _BreakSites()
    logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks").addHandler(sites)
    counters.clear()
    trainer = Trainer(load_job_config([*JOB, "--compile.enable", "true", "--compile.backend", "aot_eager",
                                       "--job.dump_folder", str(out_dir / "compiled")]))
    frames, routing = [], []
    for _ in range(COMPILED_STEPS):
        result = trainer.train_step(trainer.dataloader.next_batch())
        frames.append(counters["frames"]["total"])
        routing.append(result.tokens_per_expert.tolist())
    return {"frames": frames, "routing": routing, "break_sites": sorted(sites.sites),
            "bytes_sent": [m.dispatcher.bytes_sent for m in trainer.model.moe_layers()]}


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_rank_record(out_dir, {"eager": _eager_overlap(out_dir), "compiled": _compiled_steps(out_dir)})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("ep_overlap"), world=2, timeout=600)


def test_shared_expert_runs_inside_the_all_to_all_windows(measured):
    for rank, record in measured.items():
        eager = record["eager"]
        # Per MoE layer (2): counts, dispatch and combine forward, combine and dispatch backward.
        assert eager["windows"] == 10, rank
        # Per layer: the w1, w3, w2 forwards and their 6 backward nodes (mm and weight transpose).
        assert eager["shared"] == 18, rank
        assert eager["shared_in_window"] == eager["shared"], rank


def test_compiled_moe_blocks_break_only_at_the_split_read_and_fsdp_hooks(measured):
    for rank, record in measured.items():
        assert record["compiled"]["break_sites"] == [
            FSDP_HOOKS,
            "torchmoe/distributed/expert_parallel.py: "
            "splits = torch.cat([send_splits, recv_counts.sum(1)]).tolist()  # the host sync (see module doc)",
        ], rank


def test_compiled_ep_does_not_recompile_after_the_first_step(measured):
    for rank, record in measured.items():
        compiled = record["compiled"]
        routing = compiled["routing"]
        assert all(a != b for a, b in zip(routing, routing[1:])), rank  # the split sizes change
        # Some layer of some step sends no token to one rank's experts (4 of the 8 each).
        assert any(sum(layer[:4]) == 0 or sum(layer[4:]) == 0 for step in routing for layer in step), rank
        assert len(set(compiled["frames"])) == 1, (rank, compiled["frames"])
        assert all(n > 0 for n in compiled["bytes_sent"]), rank  # counted from compiled code


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
