"""CheckpointManager on 2 gloo ranks with FSDP2-sharded state and dataloader rows sharded over
the batch mesh, resumed on 2 ranks and in 1; each rank's files checksummed and checked in shares.

    pytest -m distributed tests/distributed/test_checkpoint_dcp.py
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchmoe.checkpoints.checkpoint import CheckpointManager
from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper, RankLocal, RNGState
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Checkpoint as CheckpointConfig
from torchmoe.config.job_config import LRScheduler as LRSchedulerConfig
from torchmoe.data import ByteTokenizer, DataLoader, InMemoryDocuments
from torchmoe.optim.lr_scheduler import build_lr_scheduler
from torchmoe.weights.checksums import SIDECAR, digest_file, verify

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
WORLD = 2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(6, 8)
        self.w2 = nn.Linear(8, 6)
        self.register_buffer("expert_bias", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x))) + self.expert_bias.sum()


def _data(rank: int, dp_degree: int, mesh=None) -> DataLoader:
    """Global batch 4 rows of 8 tokens; 2 per rank on 2 ranks, 4 in one process."""
    docs = InMemoryDocuments([f"doc {i}: " + "q" * (i * 3 % 17) for i in range(20)])
    return DataLoader(docs, ByteTokenizer(), seq_len=7, global_batch_size=4, local_batch_size=4 // dp_degree,
                      dp_rank=rank, dp_degree=dp_degree, batch_mesh=mesh)


class _Run:
    def __init__(self, *, shard: bool, rank: int = 0) -> None:
        torch.manual_seed(1234)
        self.model = _Net()
        mesh = None
        if shard:
            mesh = init_device_mesh("cpu", (WORLD,))
            fully_shard(self.model.w1, mesh=mesh)
            fully_shard(self.model.w2, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = build_lr_scheduler(self.opt, LRSchedulerConfig(warmup_steps=1), total_steps=10)
        self.loader = {"offset": 0}
        self.data = _data(rank, WORLD if shard else 1, mesh)
        self.state = {
            "model": ModelWrapper(self.model),
            "optimizer": OptimizerWrapper(self.model, self.opt),
            "lr_scheduler": self.sched,
            "dataloader": RankLocal(self.loader, rank=rank),
            "data": self.data,
            "rng": RankLocal(RNGState(), rank=rank),
        }
        self.rank = rank

    def step(self) -> None:
        x = torch.randn(4, 6) + self.rank  # each data-parallel rank sees its own batch
        self.model(x).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        with torch.no_grad():
            self.model.expert_bias += 1.0
        self.loader["offset"] += 4 + self.rank
        self.data.next_batch()

    def full_state(self) -> dict[str, torch.Tensor]:
        """A copy of the unsharded model and optimizer state (collective; complete on rank 0)."""
        model = get_model_state_dict(self.model, options=FULL)
        optim = get_optimizer_state_dict(self.model, self.opt, options=FULL)
        state = {**{f"model.{k}": v for k, v in model.items()}, **{f"optim.{k}": v for k, v in optim.items()}}
        # Buffers and optimizer step counters may alias live tensors that training updates.
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _assert_state_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        if isinstance(expected[k], torch.Tensor):
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=k)
        else:
            assert got[k] == expected[k], k


_OPENING: list[tuple[Path, list[str]]] = []  # (folder, names opened in it) while counted


def _count_open(event: str, args: tuple) -> None:
    if event == "open" and _OPENING and isinstance(args[0], (str, Path)) and Path(args[0]).parent == _OPENING[-1][0]:
        _OPENING[-1][1].append(Path(args[0]).name)


@contextmanager
def _opened_under(folder: Path) -> Iterator[list[str]]:
    """The names of `folder`'s files this process opens meanwhile (Python's `open` audit event)."""
    if not getattr(_count_open, "hooked", False):  # an audit hook stays for the process's life
        sys.addaudithook(_count_open)
        _count_open.hooked = True
    _OPENING.append((folder, []))
    try:
        yield _OPENING[-1][1]
    finally:
        _OPENING.pop()


def _cfg(**kw) -> CheckpointConfig:
    return CheckpointConfig(enable=True, interval=1, **kw)


def _worker(rank: int, dump: str) -> None:
    run = _Run(shard=True, rank=rank)
    run.step()
    run.step()
    sync = CheckpointManager(dump, _cfg(), total_steps=10)
    sync.save(2, run.state)
    ref2 = run.full_state()
    run.step()
    async_ = CheckpointManager(dump, _cfg(async_mode="async"), total_steps=10)
    async_.save(3, run.state)
    async_.close()
    ref3 = run.full_state()
    if rank == 0:
        torch.save({"ref2": ref2, "ref3": ref3}, Path(dump) / "ref.pt")

    resumed = _Run(shard=True, rank=rank)
    with _opened_under(Path(dump) / "checkpoint" / "step-3") as opened:
        assert CheckpointManager(dump, _cfg(), total_steps=10).load_latest(resumed.state) == 3
    # Rank 0 reads the metadata and the recorded digests, and checks every data file's size, for
    # both ranks (on a shared file system every rank doing so is N opens of N files at once).
    if rank == 0:
        assert opened.count(".metadata") == 1 and opened.count(SIDECAR) == 2, opened  # the metadata's, the files'
    else:
        assert ".metadata" not in opened and SIDECAR not in opened, opened
    got3 = resumed.full_state()
    assert resumed.loader == {"offset": 3 * (4 + rank)}
    assert torch.equal(resumed.data.state_dict()["rows"].full_tensor(), run.data.state_dict()["rows"].full_tensor())
    assert torch.equal(resumed.data.next_batch()[0][0], run.data.next_batch()[0][0])
    assert resumed.sched.last_epoch == 3
    if rank == 0:
        _assert_state_equal(got3, ref3)

    # A shard that only rank 1 reads is truncated: every rank must fall back to step-2 together.
    if rank == 0:
        shard = Path(dump) / "checkpoint" / "step-3" / "__1_0.distcp"
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    dist.barrier()
    fallback = _Run(shard=True, rank=rank)
    assert CheckpointManager(dump, _cfg(), total_steps=10).load_latest(fallback.state) == 2
    got2 = fallback.full_state()
    assert fallback.loader == {"offset": 2 * (4 + rank)}
    if rank == 0:
        _assert_state_equal(got2, ref2)

    # Bytes flipped in a file that only rank 1 hashes (rank r checks every world_size-th file):
    # every rank learns of it and skips the checkpoint.
    step4 = Path(dump) / "checkpoint" / "step-4"
    if rank == 0:
        shutil.rmtree(Path(dump) / "checkpoint" / "step-3")
    sync.save(4, run.state)
    if rank == 0:
        data = bytearray((step4 / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (step4 / "__1_0.distcp").write_bytes(bytes(data))
    dist.barrier()
    problem = verify(step4, ["__0_0.distcp", "__1_0.distcp"], sync.group)
    assert problem.startswith("__1_0.distcp does not match the checksum recorded when it was saved"), problem
    again = _Run(shard=True, rank=rank)
    assert CheckpointManager(dump, _cfg(), total_steps=10).load_latest(again.state) == 2

    # A load_step with no checkpoint: rank 0 finds out and every rank raises its error (it
    # crosses the broadcast whole; before, rank 1 failed to unpickle it: a TypeError traceback).
    with pytest.raises(ConfigError) as refused:
        CheckpointManager(dump, _cfg(load_step=9), total_steps=10).load_latest(again.state)
    assert (refused.value.key, refused.value.value) == ("checkpoint.load_step", 9)
    assert "no complete checkpoint step-9" in refused.value.problem and "(found: step-2, step-4)" in str(refused.value)


def _entry(rank: int, dump: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{dump}/store", rank=rank, world_size=WORLD)
    try:
        _worker(rank, dump)
    finally:
        dist.destroy_process_group()


def test_sharded_save_resume_fallback_and_reshard_to_one_process(tmp_path: Path) -> None:
    mp.spawn(_entry, args=(str(tmp_path),), nprocs=WORLD, join=True)
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert names == ["step-2", "step-4"]
    # Rank 0 recorded the digests of both ranks' files, as they are on disk.
    step2 = tmp_path / "checkpoint" / "step-2"
    recorded = json.loads((step2 / SIDECAR).read_text())["files"]
    assert recorded == {name: digest_file(step2 / name) for name in (".metadata", "__0_0.distcp", "__1_0.distcp")}

    # The FSDP-sharded checkpoint loads into an unsharded model in a process without a group.
    single = _Run(shard=False, rank=0)
    assert CheckpointManager(tmp_path, _cfg(), total_steps=10).load_latest(single.state) == 2
    assert single.loader == {"offset": 8}
    # Each rank wrote its 2 rows of the (4, 3) positions; one process reads all 4 and continues.
    meta = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-2")).read_metadata()
    rows = meta.state_dict_metadata["data.rows"]
    assert rows.size == (4, 3) and [c.offsets for c in rows.chunks] == [torch.Size([0, 0]), torch.Size([2, 0])]
    reference = _data(0, 1)
    reference.next_batch()
    reference.next_batch()
    assert torch.equal(single.data.state_dict()["rows"], reference.state_dict()["rows"])
    assert torch.equal(single.data.next_batch()[0][0], reference.next_batch()[0][0])
    ref2 = torch.load(tmp_path / "ref.pt")["ref2"]
    _assert_state_equal(single.full_state(), ref2)
