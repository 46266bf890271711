"""What checksums cost a checkpoint: save and load of a model's training state (weights + AdamW
state, one process, CPU) through torch's DCP writer/reader and through torchmoe's.

    python scripts/bench_checkpoint.py                       # debugmodel, 7 pairs
    python scripts/bench_checkpoint.py --flavor tiny --reps 3

Save: `dcp.save` with torch's `FileSystemWriter` vs `ChecksummingWriter` (hashes every file as it
writes it, records `.checksums.json`). Load: torch's `dcp.load` (its reader and planner, which
unpickle unsafely) vs what a resume runs, `read_dcp_metadata` + `load_dcp` (the restricted
unpickler, every file hashed against its checksum, then the load). The two run in turn, A B A B,
into fresh folders of one temporary directory (page cache warm: the files were just written),
after one pair not counted; times are medians, overheads the median ratio of the pairs. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from torchmoe.checkpoints.checkpoint_state import ModelWrapper, OptimizerWrapper
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.weights.checksums import ChecksummingWriter
from torchmoe.weights.weight_files import load_dcp, read_dcp_metadata


def training_state(flavor: str) -> dict:
    """Model and AdamW state (after one step, so the moments exist) of `flavor`, on CPU."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS[flavor])
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(model, opt)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(flavor: str, reps: int, root: Path) -> dict:
    """Median seconds of each save and load over `reps` alternating pairs, and the overheads."""
    state = training_state(flavor)
    times: dict[str, list[float]] = {k: [] for k in ("save_torch", "save_checksums", "load_torch", "load_checked")}
    fix = "a benchmark folder"
    for rep in range(-1, reps):  # rep -1: a warm-up pair, not counted
        plain, checked = root / f"plain{rep}", root / f"checked{rep}"
        times["save_torch"].append(_timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(plain),
                                                           no_dist=True)))
        times["save_checksums"].append(_timed(lambda: dcp.save(state, storage_writer=ChecksummingWriter(checked),
                                                                no_dist=True)))
        times["load_torch"].append(_timed(lambda: dcp.load(state, storage_reader=FileSystemReader(plain),
                                                           no_dist=True)))
        times["load_checked"].append(_timed(lambda: load_dcp(state, checked, read_dcp_metadata("bench", checked, fix),
                                                             key="bench", fix=fix)))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    size = sum(f.stat().st_size for f in (root / "checked0").iterdir())

    def overhead(ours: str, theirs: str) -> float:
        # Pair by pair (the two ran back to back), so that the machine's drift cancels.
        return round(100 * (statistics.median(a / b for a, b in zip(times[ours][1:], times[theirs][1:])) - 1), 1)

    return {"flavor": flavor, "reps": reps, "checkpoint_mb": round(size / 1e6, 1),
            **{f"{k}_s": round(v, 4) for k, v in med.items()},
            "save_overhead_pct": overhead("save_checksums", "save_torch"),
            "load_overhead_pct": overhead("load_checked", "load_torch")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    parser.add_argument("--reps", type=int, default=7)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(bench(opts.flavor, opts.reps, Path(tmp)), indent=1))


if __name__ == "__main__":
    main()
