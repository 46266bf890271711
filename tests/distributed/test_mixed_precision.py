"""`training.mixed_precision_param` is the dtype blocks compute in, and `training.dtype` the dtype of
the parameters, gradients and AdamW state, in every layout.

    python -m pytest -q tests/distributed/test_mixed_precision.py

One torchrun world of 2 CPU/gloo ranks builds the real `Trainer` for each layout below in three
precisions (bf16 compute over fp32 weights, fp32, pure bf16), runs one `forward_backward` and one
optimizer step, and records the dtype of every block's attention q projection and routed experts
output, of the parameters, their gradients and the AdamW moments (`tests.helpers.compute_dtypes`).
FSDP and DDP cast parameters with their mixed-precision policy; TP, PP and TP x EP alone have none
and run under autocast (`data_parallel.apply_autocast`) when the weights are fp32; the pipeline's
hidden states are then fp32 and its logits bf16, which its static stage metadata must match.
Before autocast, the TP, PP and TP x EP runs computed in fp32 whatever was asked; before
`training.dtype`, pure bf16 warned and trained fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import compute_dtypes, run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.steps", "1"]
ONE_SHARD = ["--parallelism.data_parallel_shard_degree", "1"]
LAYOUTS = {
    "fsdp2": [],
    "ddp2": ["--parallelism.data_parallel_replicate_degree", "2", *ONE_SHARD],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", *ONE_SHARD],
    "tp2_ep2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2", *ONE_SHARD],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", *ONE_SHARD],
    "fsdp2_ep2": ["--parallelism.expert_parallel_degree", "2"],  # experts in FSDP units of their own
}
# name: (flags, compute dtype, dtype of parameters, gradients and AdamW moments)
PRECISIONS = {
    "bf16_compute": (["--training.mixed_precision_param", "bfloat16"], "torch.bfloat16", "torch.float32"),
    "fp32": (["--training.mixed_precision_param", "float32"], "torch.float32", "torch.float32"),
    "pure_bf16": (["--training.mixed_precision_param", "bfloat16", "--training.dtype", "bfloat16"], "torch.bfloat16",
                  "torch.bfloat16"),
}


def _measure(label: str, precision: str, out_dir: Path) -> dict:
    import torch.distributed as dist

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    cfg = load_job_config([*BASE, *LAYOUTS[label], *PRECISIONS[precision][0],
                           "--job.dump_folder", str(out_dir / f"{label}_{precision}")])
    trainer = Trainer(cfg)
    record = {**compute_dtypes(trainer), "compute_dtype": str(trainer.compute_dtype)}
    trainer.optimizer.step()
    record["moments"] = sorted({str(v.dtype) for state in trainer.optimizer.state.values()
                                for key, v in state.items() if key in ("exp_avg", "exp_avg_sq")})
    del trainer
    dist.barrier()
    return record


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_rank_record(out_dir, {f"{label}_{precision}": _measure(label, precision, out_dir)
                                for label in LAYOUTS for precision in PRECISIONS})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("precision"), world=2, timeout=900)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_blocks_compute_in_the_requested_dtype_and_states_are_training_dtype(measured, label, precision):
    _, compute, states = PRECISIONS[precision]
    for rank, records in measured.items():
        got = records[f"{label}_{precision}"]
        assert got["q_proj"] == [compute], (label, rank)
        # Under PP one rank's stage may hold no MoE block.
        assert got["experts"] in ([compute], []), (label, rank)
        assert got["params"] == got["grads"] == got["moments"] == [states], (label, rank)
        assert got["compute_dtype"] == compute, (label, rank)
    assert any(records[f"{label}_{precision}"]["experts"] for records in measured.values())


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
