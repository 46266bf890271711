"""Every layout starts from the same full weights as the single process, without a seed checkpoint.

    python -m pytest -q tests/distributed/test_init_layouts.py

One torchrun world of 4 CPU/gloo ranks builds the real `Trainer` under several layouts, one after
the other (each with its own meshes and parallelize), gathers its full weights
(`get_model_state_dict(full_state_dict=True)`) and compares them with a single-process init of the
same seed on that rank: every parameter must be equal bit for bit. Besides the tiny model, an
"uneven" variant (vocab 510, hidden sizes 382 / 254, two experts) makes FSDP shards uneven (510
rows over 4 ranks; 255 and 191 TP rows over 2) and puts FSDP on the experts' hidden dim (one local
expert per EP rank). The FSDP 4 trainer then trains its first step, which must equal a 1-process
`torchmoe train` run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record
from tests.launch import metrics_by_step, run_train

pytestmark = pytest.mark.distributed

WORLD = 4
SEED = 7  # not the default: the trainer must pass training.seed on
REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--training.steps", "1",
        "--training.seed", str(SEED)]
UNEVEN = ["--model.flavor", "uneven"]
TP2, EP2, PP2 = (["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"],
                 ["--parallelism.pipeline_parallel_degree", "2"])
LAYOUTS = {
    # name: (flags, a placement the layout must produce somewhere, as str(DTensor.placements))
    "fsdp4": ([], "(Shard(dim=0),)"),
    "fsdp4_uneven": (UNEVEN, "(Shard(dim=0),)"),
    "hsdp2x2": (["--parallelism.data_parallel_replicate_degree", "2"], "(Replicate(), Shard(dim=0))"),
    "ddp4": (["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
             "(Replicate(),)"),
    "tp2_fsdp2_uneven": ([*UNEVEN, *TP2], "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # + MoE TP
    "tp2_fsdp2_moe_tp": (TP2, "(Shard(dim=0), Shard(dim=2))"),  # row-wise routed-expert w2
    "ep2_fsdp2": (EP2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # whole experts per FSDP rank
    "ep2_fsdp2_uneven": ([*UNEVEN, *EP2], "(Shard(dim=1), Shard(dim=0))"),  # FSDP on the hidden dim
    "ep2_spanning_tp2_fsdp2": ([*TP2, *EP2], "(Shard(dim=0), Shard(dim=1))"),  # row-wise wo under FSDP
    "cp2_fsdp2": (["--parallelism.context_parallel_degree", "2"], "(Shard(dim=0),)"),
    "pp2_fsdp2": (PP2, "(Shard(dim=0),)"),
    "pp2_tp2_uneven": ([*UNEVEN, *PP2, *TP2], "(Shard(dim=1),)"),
}
FIRST_STEP = "fsdp4"  # the layout whose first training step is compared too


def _register_uneven_flavor() -> None:
    from torchmoe.models.llama4 import FLAVORS

    FLAVORS["uneven"] = FLAVORS["tiny"].replace(vocab_size=510, ffn_hidden_dim=382, moe_hidden_dim=254,
                                                      num_experts=2)


def _compare(label: str, out_dir: Path) -> dict:
    """Build `label`'s trainer; return which full parameters equal the 1-process init's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from torchmoe.config.loader import load_job_config
    from torchmoe.models.llama4 import FLAVORS, Transformer
    from torchmoe.training.loop import Trainer

    flags, _ = LAYOUTS[label]
    cfg = load_job_config([*BASE, *flags, "--job.dump_folder", str(out_dir / label)])
    trainer = Trainer(cfg)
    placements = sorted({str(p.placements) for p in trainer.model.parameters() if isinstance(p, DTensor)})
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    with torch.device("meta"):
        reference = Transformer(FLAVORS[cfg.model.flavor])
    reference.to_empty(device="cpu")
    reference.init_weights(seed=SEED)
    ref = dict(reference.named_parameters())
    compared = sorted(name for name in full if name in ref)
    record = {"compared": compared, "placements": placements,
              "unequal": [name for name in compared if not torch.equal(full[name], ref[name])],
              "extra": sorted(name for name in full if name not in ref and not name.endswith(
                  ("expert_bias", "tokens_per_expert"))),
              "all": sorted(ref)}
    if label == FIRST_STEP:
        result = trainer.train_step(trainer.dataloader.next_batch())
        record["first_step"] = {"loss": result.loss, "grad_norm": result.grad_norm}
    del trainer
    dist.barrier()
    return record


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _register_uneven_flavor()
    write_rank_record(out_dir, {label: _compare(label, out_dir) for label in LAYOUTS})


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict]:
    return run_rank_script(__file__, tmp_path_factory.mktemp("init"), world=WORLD, timeout=600)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_full_weights_equal_single_process_init(measured, label):
    _, placement = LAYOUTS[label]
    records = [measured[rank][label] for rank in range(WORLD)]
    for rank, rec in enumerate(records):
        assert rec["unequal"] == [] and rec["extra"] == [], (label, rank, rec["unequal"], rec["extra"])
    # Every parameter compared somewhere (each pp rank holds its stages' parameters only) ...
    assert sorted({name for rec in records for name in rec["compared"]}) == records[0]["all"], label
    # ... under the layout the test means to exercise.
    assert placement in {p for rec in records for p in rec["placements"]}, (label, records[0]["placements"])


def test_fsdp4_first_step_equals_single_process_without_seed_checkpoint(measured, tmp_path):
    """Same initial weights, hence the same first step: loss and gradient norm within 1e-5 of one
    process training the same global batch (8 x 32 tokens) in one micro-batch."""
    run_train([*BASE, "--training.local_batch_size", "8"], dump_folder=tmp_path, timeout=300)
    single = metrics_by_step(tmp_path)[1]
    for rank in range(WORLD):
        fsdp = measured[rank][FIRST_STEP]["first_step"]
        for key in ("loss", "grad_norm"):
            assert fsdp[key] == pytest.approx(single[key], rel=1e-5), (rank, key)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
