"""One reader per file: under a process group, one rank alone reads a new `.jsonl` file to index
it (rank r the files r, r + N, ... of a corpus of several), one collective tells the others;
every rank memory-maps the saved indexes and cuts its own rows from them.

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
    record["shards"] = _token_shards(out_dir)
    record["many"] = _many_files(out_dir)
    write_rank_record(out_dir, record)


def _many_files(out_dir: Path) -> dict:
    """The folder of several files (`_folder`) opened twice as `_worker` opens one file: which
    files this rank indexed (read whole), the collectives it made, its rows' units and the tokens
    of its first two batches."""
    import numpy as np
    import torch.distributed as dist

    from torchmoe.data import FileDocuments, dataset, local_files
    from torchmoe.data.dataloader import DataLoader
    from torchmoe.data.errors import DataConfigError
    from torchmoe.data.tokenizer import ByteTokenizer

    rank = dist.get_rank()
    indexed: list[str] = []
    calls = {"collectives": 0}
    for name in ("line_spans", "_row_sizes", "_text_table"):  # each file's whole read
        original = getattr(dataset, name)
        setattr(dataset, name, lambda arg, original=original: indexed.append(str(getattr(arg, "name", "rows")))
                or original(arg))
    for name in ("all_gather_object", "broadcast_object_list", "broadcast", "all_reduce", "barrier"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, original=original, **k: calls.update(collectives=calls["collectives"] + 1)
                or original(*a, **k))
    record = {}
    for when in ("first", "again"):
        indexed.clear()
        calls["collectives"] = 0
        docs = FileDocuments(local_files(str(out_dir / "many")), index_cache=out_dir / "many_index")
        units = _units(docs, range(rank * ROWS // 2, (rank + 1) * ROWS // 2))
        loader = DataLoader(docs, ByteTokenizer(), seq_len=64, global_batch_size=ROWS, local_batch_size=ROWS // 2,
                            dp_rank=rank, dp_degree=2)
        batches = [loader.next_batch()[0][0].tolist() for _ in range(2)]
        record[when] = {"indexed": sorted(indexed), "collectives": calls["collectives"], "units": units,
                        "batches": batches, "mapped": [isinstance(t, np.memmap) for t in docs._tables]}
    broken = FileDocuments(local_files(str(out_dir / "broken")), index_cache=out_dir / "broken_index")
    try:
        broken.total_size()
    except DataConfigError as err:  # b.json, which rank 1 indexes
        record["raised"] = str(err)
    return record


def _folder(folder: Path) -> Path:
    """A corpus of seven files of three kinds: five .jsonl, a .json array and a text file."""
    many = folder / "many"
    many.mkdir()
    for f in range(5):
        lines = [json.dumps({"text": f"file {f} line {i} " * (1 + (i + f) % 5)}) for i in range(300 + 40 * f)]
        (many / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    (many / "array.json").write_text(json.dumps([{"text": f"row {i} " * (1 + i % 3)} for i in range(200)]))
    (many / "notes.txt").write_text("plain text\n" * 500)
    broken = folder / "broken"
    broken.mkdir()
    for name, text in (("a.jsonl", '{"text": "a"}\n'), ("b.json", '[{"text": "b"'), ("c.jsonl", '{"text": "c"}\n')):
        (broken / name).write_text(text)
    return many


def _token_shards(out_dir: Path) -> dict:
    """Token shards opened as a run opens them (`build_corpus`): the index files this rank
    hashed; then with one of the files rank 1 hashes damaged, what each rank raises."""
    import torch.distributed as dist

    from torchmoe.config.job_config import Training
    from torchmoe.data import token_shards
    from torchmoe.data.dataloader import build_corpus
    from torchmoe.data.errors import DataConfigError

    hashed: list[str] = []
    digest_file = token_shards.digest_file
    token_shards.digest_file = lambda path: hashed.append(Path(path).name) or digest_file(path)
    training = Training(dataset="tokens", dataset_path=str(out_dir / "shards"))
    build_corpus(training)
    record = {"hashed": sorted(hashed)}
    if dist.get_rank() == 0:
        sizes = out_dir / "shards" / token_shards.shard_file(token_shards.shard_name(1), "sizes")
        sizes.write_bytes(sizes.read_bytes()[:-8] + b"\x07" * 8)  # the same size, another last value
    dist.barrier()
    token_shards._VERIFIED.clear()  # as a new process would
    try:
        build_corpus(training)
    except DataConfigError as err:
        record["raised"] = str(err)
    return record


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    from torchmoe.data.prepare import prepare

    out = tmp_path_factory.mktemp("data_index")
    _corpus(out)
    _folder(out)
    prepare([str(out / "corpus.jsonl")], out / "shards", workers=1, shard_tokens=40_000, show_progress=False)
    return out, run_rank_script(__file__, out, world=2, timeout=120)


def test_one_rank_indexes_a_new_corpus_and_every_rank_maps_it(world) -> None:
    from torchmoe.data.dataset import FileDocuments

    tmp_path, records = world
    corpus = tmp_path / "corpus.jsonl"
    size = corpus.stat().st_size
    reference = _units(FileDocuments([corpus]), range(ROWS))  # one process, no cache: built in memory
    for when in ("first", "again"):
        assert [records[r][when]["indexed"] for r in (0, 1)] == [1 if when == "first" else 0, 0], records
        assert all(records[r][when]["mapped"] for r in (0, 1)), when
        assert records[0][when]["units"] + records[1][when]["units"] == reference, when
    # The corpus read once in all, by rank 0 (and the index's header by each rank).
    assert records[0]["first"]["read"] >= size > 20 * records[1]["first"]["read"], records
    assert size > 20 * records[0]["again"]["read"] and size > 20 * records[1]["again"]["read"], records
    assert len(list((tmp_path / "data_index").glob("*.npy"))) == 1


def test_a_corpus_of_many_files_is_indexed_a_share_a_rank_in_one_collective(world) -> None:
    """Rank r indexes files r, r + 2, ... of seven (sorted: array.json, notes.txt, part0-4.jsonl),
    each file once in all, with one collective for the corpus (not one per file); the indexes
    saved are those one process saves, byte for byte, and each rank's rows and batches are those
    of one process. Opened again, no file is read (the text file opened by its rank) and the one
    collective remains."""
    from torchmoe.data import FileDocuments, local_files
    from torchmoe.data.dataloader import DataLoader
    from torchmoe.data.tokenizer import ByteTokenizer

    tmp_path, records = world
    files = local_files(str(tmp_path / "many"))
    names = [f.name for f in files]
    assert names[:2] == ["array.json", "notes.txt"], names
    kinds = {"array.json": "rows", "notes.txt": "notes.txt"}  # what the counting stand-ins record
    for rank in (0, 1):
        first = records[rank]["many"]["first"]
        assert first["indexed"] == sorted(kinds.get(n, n) for n in names[rank::2]), (rank, first["indexed"])
        assert first["collectives"] == 1, first["collectives"]
        again = records[rank]["many"]["again"]
        # A text file's table (its size) is not kept: opened again, by its one rank only.
        assert again["indexed"] == (["notes.txt"] if rank == 1 else []) and again["collectives"] == 1, again
        assert records[rank]["many"]["again"]["mapped"] == [n != "notes.txt" for n in names]
    alone = tmp_path / "alone_index"  # one process, no process group
    docs = FileDocuments(files, index_cache=alone)
    reference = _units(docs, range(ROWS))
    loader = DataLoader(docs, ByteTokenizer(), seq_len=64, global_batch_size=ROWS, local_batch_size=ROWS)
    batches = [loader.next_batch()[0][0].tolist() for _ in range(2)]
    for when in ("first", "again"):
        got = [records[r]["many"][when] for r in (0, 1)]
        assert got[0]["units"] + got[1]["units"] == reference, when
        assert [got[0]["batches"][b] + got[1]["batches"][b] for b in (0, 1)] == batches, when
    saved = {p.name: p.read_bytes() for p in (tmp_path / "many_index").glob("*.npy")}
    assert len(saved) == 6 and saved == {p.name: p.read_bytes() for p in alone.glob("*.npy")}
    # A file that cannot be indexed (b.json, rank 1's) stops both ranks with its own message.
    broken = str(tmp_path / "broken" / "b.json")
    for rank in (0, 1):
        assert records[rank]["many"]["raised"] == f'training.dataset_path = "{broken}": is not JSON (Expecting \',\' ' \
            "delimiter at line 1)\n  fix: fix the file: a JSON array of objects, or one object per line", rank


def test_token_shards_are_hashed_once_in_all_and_a_damaged_one_stops_every_rank(world) -> None:
    """Each index file (docs, sizes) of the shards is hashed by one rank: rank r hashes every
    2nd shard from r (every rank hashing all of them reads them once per rank from the shared
    file system). A file only rank 1 hashes, damaged, stops both ranks with its message."""
    tmp_path, records = world
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    files = [[f for f in sorted(s["files"]) if not f.endswith("tokens.npy")] for s in manifest["shards"]]
    assert len(files) >= 4, manifest["shards"]  # shards enough for both ranks
    for rank in (0, 1):
        assert records[rank]["shards"]["hashed"] == sorted(f for shard in files[rank::2] for f in shard), rank
    for rank in (0, 1):
        raised = records[rank]["shards"]["raised"]
        assert raised.startswith(f'training.dataset_path = "{tmp_path / "shards"}": {files[1][1]} does not match '
                                 "the checksum in manifest.json"), raised


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
