"""Several `torchmoe train` jobs, one after the other, in one world of ranks (for the parity tests).

    python tests/fork_ranks.py tests/distributed/train_jobs.py OUT_DIR N  # N ranks (run_rank_script)
    python tests/distributed/train_jobs.py OUT_DIR  # one process without a process group
    run_here(jobs)                                  # the same, in the calling process

`OUT_DIR/jobs.json` lists the jobs in order: ``{"label", "args", "dump_folder", "start_from",
"preflight", "flash"}``, `args` being `torchmoe train` arguments; `preflight` false skips the checks that
refuse what this machine cannot run usefully (`tests.helpers.Job`); `flash` true trains with
attention on CUDA flash's path, emulated (`tests.helpers.emulated_flash`), counting the host reads
of the model's forward and backward (`tests.helpers.HostReads`), written per rank to
``host_reads_rank<r>.json`` in the dump folder. Every rank runs each job as `torchmoe train` does: the
config validated for this world, the real `Trainer` (its own meshes, built on the one process
group), its initial state loaded, `fit`; then it leaves the dump folder for the next job. Starting
a world (torch imported and gloo joined on every rank) costs more than training a tiny job, which
is why the jobs share one. Without torchrun the jobs run in one process as `torchmoe train` runs
without it: no process group at all. `start_from`, unless null, is a step-N checkpoint folder that
rank 0 copies into the dump folder first, so that the job resumes from it: a seed checkpoint's
step-0, or a checkpoint an earlier job wrote.

Every job trains with attention masks refused (`tests.helpers.refusing_attention_masks`): the
parity runs prove that no layout hands SDPA a mask tensor, which fused GPU kernels refuse.

A job that raises ends the world (the launcher reports the rank's traceback); rank 0 names each job
on stderr as it starts and as it ends, with its seconds, so the output says which one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path


def _run(job: dict, world_size: int) -> None:
    import torch.distributed as dist

    from torchmoe.config.loader import load_job_config
    from torchmoe.preflight import validate_job_config
    from torchmoe.training.loop import Trainer

    dump_folder = Path(job["dump_folder"])
    started = time.perf_counter()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"=== job {job['label']}", file=sys.stderr, flush=True)
        if job["start_from"] is not None:
            start = Path(job["start_from"])
            shutil.copytree(start, dump_folder / "checkpoint" / start.name)
    if dist.is_initialized():
        dist.barrier()
    cfg = load_job_config([*job["args"], "--job.dump_folder", str(dump_folder)])
    if job["preflight"]:
        validate_job_config(cfg, world_size)
    if cfg.compile.enable:
        import torch._dynamo

        torch._dynamo.reset()  # compiles afresh, as in a process of its own (no recompile limit reached)
    trainer = Trainer(cfg)
    trainer.load_initial_state()
    with contextlib.ExitStack() as stack:
        if job.get("flash"):
            _count_host_reads(trainer, stack)
        trainer.fit()
    trainer.release()  # Trainer.close would also leave the process group
    del trainer
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"=== job {job['label']}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def _count_host_reads(trainer, stack: contextlib.ExitStack) -> None:
    """Attention on flash's path (emulated) for the rest of the job, and every host read of the
    model's forward and backward counted; the counts are written when the job ends."""
    import torch.distributed as dist

    from tests.helpers import HostReads, counting_model_reads, emulated_flash

    reads = HostReads()
    calls = stack.enter_context(emulated_flash(reads))
    stack.enter_context(counting_model_reads(trainer, reads))
    rank = dist.get_rank() if dist.is_initialized() else 0
    record = Path(trainer.dump_folder) / f"host_reads_rank{rank}.json"
    stack.callback(lambda: record.write_text(json.dumps({"reads": reads.counts, "varlen_calls": len(calls)})))


def run_here(jobs: list[dict]) -> None:
    """The one-process `jobs` in this (a test's) process: one intra-op thread, as each rank and
    a ``python train_jobs.py`` process has (so their numbers match), and the process as it was
    after (thread count, the `torchmoe` logger the trainer sets up). Saves starting an
    interpreter that imports the stack again."""
    import logging

    import torch

    from tests.helpers import refusing_attention_masks

    log = logging.getLogger("torchmoe")
    threads, handlers, level, propagate = torch.get_num_threads(), list(log.handlers), log.level, log.propagate
    torch.set_num_threads(1)
    try:
        with refusing_attention_masks():
            for job in jobs:
                _run(job, world_size=1)
    finally:
        torch.set_num_threads(threads)
        log.handlers[:], log.level, log.propagate = handlers, level, propagate


def _backend(jobs: list[dict]) -> str:
    """gloo for CPU jobs; for CUDA jobs (`scripts/gpu_check.py`'s NCCL parity) NCCL with gloo
    beside it, as `torchmoe train` picks for a job that reduces host tensors (CPU offload), and
    this rank's GPU made current."""
    import torch

    from torchmoe.distributed.process_groups import backend_spec

    cuda = any(arg == "cuda" for job in jobs for arg in job["args"])  # --training.device cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return backend_spec("cuda" if cuda else "cpu", host_collectives=True)


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from tests.helpers import refusing_attention_masks, write_rank_record

    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    jobs = json.loads((out_dir / "jobs.json").read_text())
    if world_size > 1:
        dist.init_process_group(_backend(jobs))  # every job's Trainer joins it
    with refusing_attention_masks():
        for job in jobs:
            _run(job, world_size)
    write_rank_record(out_dir, {"trained": [job["label"] for job in jobs]})


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
