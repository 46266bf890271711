"""The memory estimate's states match what real sharded ranks hold (fp32 and pure bf16, CPU, gloo).

    python -m pytest -q tests/distributed/test_memory_measured.py

One torchrun world of 4 CPU/gloo ranks. For each layout below every rank builds the real
`Trainer` from configs/debug_model.toml, runs one `forward_backward` and one `optimizer.step()`,
and counts the bytes it holds:

    params     every model parameter's local shard (`DTensor.to_local()`), numel x element size
    grads      the same over `.grad` after the backward (sharded, after FSDP's reduce-scatter)
    optimizer  every tensor in `optimizer.state` (exp_avg, exp_avg_sq: local shards) except `step`

and, for params and grads, the bytes of the distinct storages behind those shards (what is
allocated: FSDP2 keeps each sharded parameter in a storage padded to ceil(dim 0 / group) rows and
reduce-scatters a unit's gradients into one padded buffer the `.grad`s are views of).

`memory_per_pp_rank` (`plan/memory.py`) for the same config and the rank's pp rank must give
exactly those bytes. What neither side counts, by design:
  - optimizer `step`: torch keeps one 0-dim fp32 tensor per parameter (4 B each, a few hundred
    bytes here); the estimate counts only the two Adam moments. Recorded and checked separately.
  - buffers (RoPE tables, MoE expert bias / token counts): not states of the estimate.
  - transient FSDP all-gather / reduce-scatter buffers and activations: the estimate bounds those
    as peaks (`fsdp_buffers`, `activations`), which a byte count of live tensors cannot check.
The estimate is of the fullest rank of its pp rank: shards are ceil-sized (FSDP padding
included). The tiny flavor's dims divide evenly by every degree here, so every rank holds exactly
that; the padded (uneven) case is checked against a meta-device model in tests/unit/test_plan.py.
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
        "--training.local_batch_size", "1", "--training.steps", "1"]
PURE_BF16 = ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]
LAYOUTS = {
    "fsdp4": [],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    "fsdp2_tp2_moe_tp": ["--parallelism.tensor_parallel_degree", "2"],
    "fsdp2_tp2_ep4": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
    "fsdp4_ep2": ["--parallelism.expert_parallel_degree", "2"],
    # Pure bf16 (training.dtype): 2 bytes per parameter, gradient and AdamW moment element.
    "hsdp2x2_pure_bf16": ["--parallelism.data_parallel_replicate_degree", "2", *PURE_BF16],
    "fsdp2_tp2_ep4_pure_bf16": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                                "4", *PURE_BF16],
    # Qwen3-MoE (qwen3 tiny): per-head QK norms replicated over tp, no shared expert, a dense layer.
    "qwen3_fsdp2_tp2_moe_tp": ["--model.name", "qwen3", "--parallelism.tensor_parallel_degree", "2"],
    "qwen3_fsdp2_tp2_ep4": ["--model.name", "qwen3", "--parallelism.tensor_parallel_degree", "2",
                            "--parallelism.expert_parallel_degree", "4"],
    # DeepSeek-V3 (deepseek_v3 tiny): latent attention's bottleneck projections and norms replicated
    # over tp, the heads' projections split; a shared expert; a dense layer.
    "deepseek_v3_fsdp2_tp2_moe_tp": ["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2"],
    "deepseek_v3_fsdp2_tp2_ep4": ["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
                                  "--parallelism.expert_parallel_degree", "4"],
    # gpt-oss (gpt_oss tiny): sinks split with the heads, projection biases (wo's replicated), the
    # fused experts and their biases (the down bias split on dim under MoE TP).
    "gpt_oss_fsdp2_tp2_moe_tp": ["--model.name", "gpt_oss", "--parallelism.tensor_parallel_degree", "2"],
    "gpt_oss_fsdp2_tp2_ep4": ["--model.name", "gpt_oss", "--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.expert_parallel_degree", "4"],
}


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    """Bytes of the tensors' local shards."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors' local shards (padding, shared buffers)."""
    storages = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _measure(label: str, out_dir: Path) -> dict:
    import torch

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    cfg = load_job_config([*BASE, *LAYOUTS[label], "--job.dump_folder", str(out_dir / label)])
    trainer = Trainer(cfg)
    params = list(trainer.model.parameters())
    trainer.forward_backward(trainer.dataloader.next_batch())
    grads = [p.grad for p in params]
    assert all(g is not None for g in grads), f"{label}: a parameter got no gradient"
    record = {
        "degrees": trainer.dims.degrees,
        "pp_rank": trainer.mesh["pp"].get_local_rank(),
        "params": _bytes(params), "params_storage": _storage_bytes(params),
        "grads": _bytes(grads), "grads_storage": _storage_bytes(grads),
    }
    trainer.optimizer.step()
    states = [s for p in params for s in trainer.optimizer.state[p].items()]
    record["optimizer"] = _bytes(t for k, t in states if k != "step")
    record["optimizer_storage"] = _storage_bytes(t for k, t in states if k != "step")
    steps = [t for k, t in states if k == "step"]
    record["step_tensors"], record["step_bytes"] = len(steps), _bytes(steps)
    record["n_params"] = len(params)
    record["dtypes"] = sorted({str(_local(t).dtype) for t in params + grads})
    del trainer
    torch.distributed.barrier()
    return record


def _worker(out_dir: Path) -> None:
    """Runs on every torchrun rank: each layout's real Trainer, measured."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the Trainer joins it; its meshes are built on top
    write_rank_record(out_dir, {label: _measure(label, out_dir) for label in LAYOUTS})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("memory"), world=WORLD, timeout=300)


def _estimate(label: str, pp_rank: int):
    from torchmoe.arch.registry import model_args_from_config
    from torchmoe.config.loader import load_job_config
    from torchmoe.plan.memory import memory_per_pp_rank
    from torchmoe.plan.parallel_dims import ParallelDims

    cfg = load_job_config([*BASE, *LAYOUTS[label]])
    dims = ParallelDims.from_config(cfg.parallelism, WORLD)
    est = memory_per_pp_rank(model_args_from_config(cfg.model), dims, cfg.training, cfg.activation_checkpoint,
                             cfg.parallelism, compiled=cfg.compile.enable)
    return dims, est[pp_rank]


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_states_per_rank_match_estimate(measured, label):
    for rank in range(WORLD):
        got = measured[rank][label]
        dims, est = _estimate(label, got["pp_rank"])
        assert got["degrees"] == dims.degrees, (label, rank)
        assert got["dtypes"] == ["torch.bfloat16" if "pure_bf16" in label else "torch.float32"], (label, rank)
        for field in ("params", "grads", "optimizer"):
            want = getattr(est, field)
            assert got[field] == want, (label, rank, field, got[field], want)
            assert got[f"{field}_storage"] == want, (label, rank, f"{field}_storage", got[f"{field}_storage"], want)
        # Excluded from the estimate: Adam's per-parameter 0-dim fp32 step counter.
        assert got["step_tensors"] == got["n_params"] and got["step_bytes"] == 4 * got["n_params"], (label, rank)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
