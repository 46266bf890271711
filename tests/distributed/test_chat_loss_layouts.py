"""The masked (chat SFT) loss in other layouts on the single process's step: FSDP over 2 ranks
(each rank's rows hold a different count of targets: the normaliser is the global one) and CP 2
(each rank's half of the columns, the count over whole rows) and PP 2 (the schedule's loss over
the same count, each row a pipeline micro-batch): the first two steps' loss and gradient norm
within 1e-5.

    python -m pytest -q tests/distributed/test_chat_loss_layouts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.any_checkpoint import save_checkpoint
from tests.chat_fixtures import chatml
from tests.chat_jobs import chat_job, write_chat_file
from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed
LAYOUTS = {"fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
           "cp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
           "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]}
STEPS = ["--training.steps", "2"]


def _run(root: Path, dump: Path, *flags: str) -> list[tuple[float, float]]:
    from torchmoe.training.loop import Trainer

    trainer = Trainer(chat_job(root / "qwen3", root / "chatml", root / "chat.jsonl", dump, *STEPS, *flags))
    try:
        trainer.load_initial_state()
        results = [trainer.train_step(trainer.dataloader.next_batch()) for _ in range(2)]
        return [(r.loss, r.grad_norm) for r in results]
    finally:
        trainer.release()  # the process group stays for `write_rank_record`


def _worker(out_dir: Path) -> None:
    root, layout = out_dir.parent / "inputs", out_dir.name
    write_rank_record(out_dir, {"steps": _run(root, out_dir / "dump", *LAYOUTS[layout])})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat_layouts") / "inputs"
    save_checkpoint("qwen3", root / "qwen3")
    chatml(root / "chatml", marked=False)
    write_chat_file(root / "chat.jsonl")
    return root


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_masked_loss_is_the_single_process_s_in_every_layout(root: Path, layout: str) -> None:
    want = _run(root, root.parent / "single")
    got = run_rank_script(__file__, root.parent / layout, world=2, timeout=300)
    for rank in (0, 1):
        for (loss, norm), (want_loss, want_norm) in zip(got[rank]["steps"], want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5), \
                (rank, got[rank]["steps"], want)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
