"""Under expert parallelism every FSDP unit's all-gather is issued before the unit before it (in
forward; after it, in backward) finishes: explicit prefetching (`data_parallel._prefetch_explicitly`).

    python -m pytest -q tests/distributed/test_fsdp_prefetch.py

One torchrun world of 2 CPU/gloo ranks builds the real `Trainer` for FSDP 2 x EP 2 (the tiny
flavor: blocks 1 and 3 are MoE, their routed experts are FSDP units of their own) and runs one
`forward_backward`, logging in order every all-gather FSDP issues (`FSDPParamGroup.unshard`
that starts one) and the end of every unit's forward and backward (`post_forward`,
`post_backward`), by unit name. Without explicit prefetching a unit is all-gathered only in its
own pre-forward, after the previous unit's forward has ended: EP's host sync of the all-to-all
split sizes then leaves every all-gather exposed on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--training.steps", "1", "--parallelism.expert_parallel_degree", "2"]
HEAD = "norm, output"  # fully_shard([norm, output]) names its unit after both


def _log_fsdp_events(out_dir: Path) -> list[list[str]]:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from torchmoe.config.loader import load_job_config
    from torchmoe.training.loop import Trainer

    trainer = Trainer(load_job_config([*FLAGS, "--job.dump_folder", str(out_dir / "run")]))
    events: list[list[str]] = []
    originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "post_forward", "post_backward")}

    def unshard(self, async_op: bool = False):
        idle = self._all_gather_result is None and not self.is_unsharded
        originals["unshard"](self, async_op)
        if idle and (self._all_gather_result is not None or self.is_unsharded):
            events.append(["all_gather", self._module_fqn])

    def marking(name: str):
        def call(self, *args, **kwargs):
            events.append([name, self._module_fqn])
            return originals[name](self, *args, **kwargs)
        return call

    FSDPParamGroup.unshard = unshard
    FSDPParamGroup.post_forward = marking("post_forward")
    FSDPParamGroup.post_backward = marking("post_backward")
    try:
        trainer.forward_backward(trainer.dataloader.next_batch())
    finally:
        for name, method in originals.items():
            setattr(FSDPParamGroup, name, method)
    return events


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_rank_record(out_dir, {"events": _log_fsdp_events(out_dir)})


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> dict[int, list[tuple[str, str]]]:
    records = run_rank_script(__file__, tmp_path_factory.mktemp("prefetch"), world=2, timeout=300)
    return {rank: [tuple(e) for e in record["events"]] for rank, record in records.items()}


def _passes(log: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The forward's events and the backward's (from the first post_backward's pass on: the
    backward starts with the head, whose all-gather, kept from forward, is never repeated)."""
    first_backward = min(i for i, (kind, _) in enumerate(log) if kind == "post_backward")
    last_forward = max(i for i, (kind, _) in enumerate(log[:first_backward]) if kind == "post_forward")
    return log[: last_forward + 1], log[last_forward + 1 :]


# (unit, units it must have all-gathered before its own forward ends), in forward order.
FORWARD = [("tok_embeddings", ["layers.0"]),
           ("layers.0", ["layers.1", "layers.1.moe.experts"]),
           ("layers.1", ["layers.2"]),
           ("layers.2", ["layers.3", "layers.3.moe.experts"]),
           ("layers.3", [HEAD])]
# The same before the unit's own backward ends, in backward order.
BACKWARD = [(HEAD, ["layers.3", "layers.3.moe.experts"]),
            ("layers.3", ["layers.2"]),
            ("layers.2", ["layers.1", "layers.1.moe.experts"]),
            ("layers.1", ["layers.0"]),
            ("layers.0", ["tok_embeddings"])]


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_next_units_are_all_gathered_before_the_current_one_ends(events, pass_name):
    for rank, log in events.items():
        forward, backward = _passes(log)
        log, end, expected = (forward, "post_forward", FORWARD) if pass_name == "forward" else (
            backward, "post_backward", BACKWARD)
        for unit, prefetched in expected:
            ends = log.index((end, unit))
            for target in prefetched:
                assert ("all_gather", target) in log[:ends], (rank, pass_name, unit, target, log)


def test_each_unit_is_all_gathered_once_per_pass(events):
    """Prefetching moves all-gathers earlier, it adds none: every resharding unit once in forward
    and once in backward; the head (kept unsharded after forward) and the root once in all."""
    units = ["tok_embeddings", "layers.0", "layers.1", "layers.1.moe.experts", "layers.2", "layers.3",
             "layers.3.moe.experts"]
    for rank, log in events.items():
        forward, backward = _passes(log)
        gathered = lambda part: sorted(unit for kind, unit in part if kind == "all_gather" and unit in units + [HEAD])
        assert gathered(forward) == sorted(units + [HEAD]), rank
        assert gathered(backward) == sorted(units), rank


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
