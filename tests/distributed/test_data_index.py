"""One reader per corpus: under a process group, rank 0 alone reads a new `.jsonl` file to index
it; every rank memory-maps the saved index and cuts its own rows from it.

    python -m pytest -q tests/distributed/test_data_index.py

A 2-rank world (forked ranks, gloo) opens one corpus twice: a first time, when no index exists,
and again, when both find it saved. Each rank records how often it indexed the file, how many
bytes it read from files meanwhile (Linux's ``rchar``: `read` calls; a memory map's pages are not
counted), whether its tables are memory maps, and the units of its rows, which must be the rows
of the same corpus indexed in one process without any cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed

ROWS = 8  # 4 a rank


def _corpus(folder: Path) -> Path:
    """A .jsonl file of 4000 documents (about 160 KB), one larger than a row's share."""
    lines = [json.dumps({"text": f"document {i} " * (1 + i % 7)}) for i in range(4000)]
    lines[1234] = json.dumps({"text": "long " * 20000})
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "corpus.jsonl"


def _units(docs, rows) -> list[list[list[int]]]:
    return [[[int(d), int(p)] for d, p in zip(row._doc, row._part)] for row in (docs.split(r, ROWS) for r in rows)]


def _read_bytes() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")))


def _worker(out_dir: Path) -> None:
    import numpy as np
    import torch.distributed as dist

    from torchmoe.data import dataset
    from torchmoe.data.dataset import FileDocuments

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    indexed: list[str] = []
    line_spans = dataset.line_spans
    dataset.line_spans = lambda file: indexed.append(str(file)) or line_spans(file)
    record = {}
    for when in ("first", "again"):
        before, calls = _read_bytes(), len(indexed)
        docs = FileDocuments([out_dir / "corpus.jsonl"], index_cache=out_dir / "data_index")
        rows = range(rank * ROWS // 2, (rank + 1) * ROWS // 2)
        units = _units(docs, rows)
        record[when] = {"indexed": len(indexed) - calls, "read": _read_bytes() - before, "units": units,
                        "mapped": isinstance(docs._tables[0], np.memmap)}
    write_rank_record(out_dir, record)


def test_one_rank_indexes_a_new_corpus_and_every_rank_maps_it(tmp_path: Path) -> None:
    from torchmoe.data.dataset import FileDocuments

    corpus = _corpus(tmp_path)
    size = corpus.stat().st_size
    records = run_rank_script(__file__, tmp_path, world=2, timeout=120)
    reference = _units(FileDocuments([corpus]), range(ROWS))  # one process, no cache: built in memory
    for when in ("first", "again"):
        assert [records[r][when]["indexed"] for r in (0, 1)] == [1 if when == "first" else 0, 0], records
        assert all(records[r][when]["mapped"] for r in (0, 1)), when
        assert records[0][when]["units"] + records[1][when]["units"] == reference, when
    # The corpus read once in all, by rank 0 (and the index's header by each rank).
    assert records[0]["first"]["read"] >= size > 20 * records[1]["first"]["read"], records
    assert size > 20 * records[0]["again"]["read"] and size > 20 * records[1]["again"]["read"], records
    assert len(list((tmp_path / "data_index").glob("*.npy"))) == 1


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
