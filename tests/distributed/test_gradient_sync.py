"""HSDP and DDP all-reduce gradients across replicas once per step, not once per micro-batch.

    python -m pytest -q tests/distributed/test_gradient_sync.py

One torchrun world of 4 CPU/gloo ranks. For HSDP 2 x 2 and DDP 4, each rank builds the real
`Trainer` (global batch 8, local batch 1: 2 micro-batches per step), runs one `forward_backward`
and counts the `all_reduce` calls it makes; then the same with the per-micro-batch sync of
before (`StepRunner.sync_gradients` switched off). Deferring halves the all-reduces and leaves every
gradient the same (fp32, summation order only): each rank compares its two runs' full gradients
itself and reports the parameters that differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

WORLD = 4
REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
        "--training.local_batch_size", "1", "--training.global_batch_size", "8", "--training.steps", "1"]
LAYOUTS = {
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    "ddp4": ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
}


def _measure(label: str, out_dir: Path, *, defer: bool) -> tuple[dict, dict]:
    """One `forward_backward` of `label`'s trainer: its micro-batch and all-reduce counts, and
    every parameter's full gradient."""
    import torch
    import torch.distributed as dist

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    cfg = load_job_config([*BASE, *LAYOUTS[label], "--job.dump_folder", str(out_dir / label)])
    trainer = Trainer(cfg)
    if not defer:
        trainer.steps.sync_gradients = lambda *, last: None
    batch = trainer.dataloader.next_batch()
    calls = 0
    original = dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        trainer.forward_backward(batch)
    finally:
        dist.all_reduce = original
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in trainer.model.named_parameters()}
    del trainer
    torch.distributed.barrier()
    return {"micro_batches": len(batch), "all_reduces": calls}, grads


def _compare(label: str, out_dir: Path) -> dict:
    """`label` with the all-reduce deferred and once per micro-batch; the parameters whose
    gradients differ between the two (fp32, summation order only: rtol 1e-5, atol 1e-7)."""
    import torch

    deferred, deferred_grads = _measure(label, out_dir, defer=True)
    each, each_grads = _measure(label, out_dir, defer=False)
    unequal = {}
    for name, grad in each_grads.items():
        try:
            torch.testing.assert_close(deferred_grads[name], grad, rtol=1e-5, atol=1e-7)
        except AssertionError as err:
            unequal[name] = str(err)
    return {"deferred": deferred, "each": each, "compared": sorted(each_grads), "unequal": unequal}


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_rank_record(out_dir, {label: _compare(label, out_dir) for label in LAYOUTS})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("sync"), world=WORLD, timeout=300)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_one_all_reduce_per_step(measured, label):
    for rank in range(WORLD):
        rec = measured[rank][label]
        deferred, each = rec["deferred"], rec["each"]
        assert deferred["micro_batches"] == each["micro_batches"] == 2
        assert deferred["all_reduces"] > 0 and 2 * deferred["all_reduces"] == each["all_reduces"], (rank, label)
        assert "tok_embeddings.weight" in rec["compared"] and rec["unequal"] == {}, (rank, label, rec["unequal"])


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
