"""Packing and the row-sharded loader: EOS placement, one sub-stream per batch row, each rank
tokenizing only its rows, dp-independence, exact resume across layouts.

    pytest tests/unit/test_dataloader.py
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys

import pytest
import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Training
from torchmoe.data import ByteTokenizer, DataLoader, InMemoryDocuments, PackedStream, build_dataloader

EOS = ByteTokenizer().eos_id
G = 8  # rows of the global batch in the layout tests
LAYOUTS = [(1, 8), (2, 4), (4, 1), (2, 1)]  # (dp_degree, local_batch_size): accumulation 1, 1, 2, 4


class RecordingTokenizer(ByteTokenizer):
    """Byte tokenizer that records the texts it was asked to encode."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return super().encode(text)


def _corpus(n: int = 40) -> InMemoryDocuments:
    """Documents of varied lengths (1..~60 bytes) so windows straddle document boundaries."""
    return InMemoryDocuments([f"doc{i}:" + "abcdefghij"[i % 10] * (i * 7 % 53) for i in range(n)])


def _loader(docs=None, tokenizer=None, **kw) -> DataLoader:
    args = dict(seq_len=8, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1) | kw
    return DataLoader(docs or _corpus(), tokenizer or ByteTokenizer(), **args)


def _ranks(dp_degree: int, local_batch_size: int, docs=None, tokenizers=None, **kw) -> list[DataLoader]:
    """The loaders of every dp rank of one layout with G rows, simulated in this process."""
    tokenizers = tokenizers or [None] * dp_degree
    return [
        _loader(docs, tokenizers[r], global_batch_size=G, local_batch_size=local_batch_size,
                dp_rank=r, dp_degree=dp_degree, **kw)
        for r in range(dp_degree)
    ]  # fmt: skip


def _global(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def _global_step(ranks: list[DataLoader]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of every rank, micro-batches concatenated in (rank, micro-batch) order."""
    return _global([mb for rank in ranks for mb in rank.next_batch()])


def _state(ranks: list[DataLoader]) -> dict:
    """What DCP makes of the ranks' states: the step and all rows, (G, 3)."""
    states = [rank.state_dict() for rank in ranks]
    assert len({s["step"] for s in states}) == 1
    return {"step": states[0]["step"], "rows": torch.cat([s["rows"] for s in states])}


def _stream(texts: list[str]) -> list[int]:
    """The packed token stream of one pass over `texts`."""
    return [t for text in texts for t in ByteTokenizer().encode(text) + [EOS]]


def test_packing_puts_eos_between_documents_and_shifts_labels() -> None:
    docs = InMemoryDocuments(["ab", "cde", "f"])
    loader = _loader(docs, seq_len=3, global_batch_size=2, local_batch_size=2)
    [(inputs, labels)] = loader.next_batch()
    a, b, c, d, e, f = (ord(ch) for ch in "abcdef")
    # 6 bytes in 2 rows of 3: documents 0 and 1 start in bytes 0-2 (row 0: a b EOS c d e EOS | a ...),
    # document 2 at byte 5 (row 1: f EOS f EOS ...). Each is cut into windows of seq_len + 1 = 4.
    assert inputs.tolist() == [[a, b, EOS], [f, EOS, f]]
    assert labels.tolist() == [[b, EOS, c], [EOS, f, EOS]]
    assert inputs.dtype == labels.dtype == torch.long
    assert inputs.shape == labels.shape == (2, 3)


def test_add_bos_starts_every_document_with_bos_as_torchtitan_packs() -> None:
    bos = ByteTokenizer().bos_id
    loader = _loader(InMemoryDocuments(["ab", "cde", "f"]), seq_len=5, global_batch_size=2, local_batch_size=2,
                     add_bos=True)
    [(inputs, labels)] = loader.next_batch()
    a, b, c, f = (ord(ch) for ch in "abcf")
    # Row 0: BOS a b EOS BOS c d e EOS ...; row 1: BOS f EOS BOS f EOS ...
    assert inputs.tolist() == [[bos, a, b, EOS, bos], [bos, f, EOS, bos, f]]
    assert labels.tolist() == [[a, b, EOS, bos, c], [f, EOS, bos, f, EOS]]


def _contiguous_rows(texts: list[str], rows: int) -> list[list[str]]:
    """The documents of each row when none is larger than a row's share: document d, starting at
    byte s of the corpus's T, belongs to row floor(s * rows / T)."""
    starts = [sum(len(t) for t in texts[:d]) for d in range(len(texts))]
    total = sum(len(t) for t in texts)
    return [[t for t, s in zip(texts, starts) if s * rows // total == row] for row in range(rows)]


def test_each_row_tiles_the_stream_of_its_range_of_the_corpus() -> None:
    docs = _corpus()
    rows = _contiguous_rows(docs.texts, 4)
    assert all(len(t) * 4 <= sum(map(len, docs.texts)) for t in docs.texts)  # no document is cut
    loader = _loader(docs, global_batch_size=4, local_batch_size=2)
    got: list[list[int]] = [[] for _ in range(4)]
    for _ in range(6):
        x, y = _global(loader.next_batch())
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, window in enumerate(torch.cat([x, y[:, -1:]], dim=1).tolist()):
            got[row] += window
    for row in range(4):
        want = _stream(rows[row])
        assert got[row] == want[: len(got[row])], row


def test_read_ahead_does_not_change_the_stream() -> None:
    streams = [PackedStream(_corpus(), ByteTokenizer(), window=9, read_ahead=k) for k in (1, 3, 64)]
    for _ in range(20):  # past the end of the corpus and into the second pass
        first, *others = [stream.take(3) for stream in streams]
        assert all(torch.equal(first, other) for other in others)
        assert len({stream.position() for stream in streams}) == 1


def test_long_documents_pack_in_pieces_as_they_would_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents longer than PIECE_CHARS are tokenized piece by piece as they are packed: the same
    windows and positions as whole, BOS and EOS included, and a resume from any position (inside
    a piece, at a piece's end) continues identically."""
    import torchmoe.data.packing as dataloader

    docs = InMemoryDocuments(["ab" * 40, "x", "héllo → 你好 " * 9, "", "end" * 30])
    whole = PackedStream(docs, ByteTokenizer(), window=11, bos=300, read_ahead=2)
    monkeypatch.setattr(dataloader, "PIECE_CHARS", 7)
    pieces = PackedStream(docs, ByteTokenizer(), window=11, bos=300, read_ahead=2)
    positions = []
    for _ in range(60):  # several passes
        positions.append(pieces.position())
        assert pieces.position() == whole.position()
        assert torch.equal(pieces.take(1), whole.take(1))
    reference = PackedStream(docs, ByteTokenizer(), window=11, bos=300, read_ahead=2)
    windows = [reference.take(1) for _ in range(60)]
    for i, position in enumerate(positions):
        resumed = PackedStream(docs, ByteTokenizer(), window=11, bos=300, read_ahead=2)
        resumed.seek(*position)
        assert all(torch.equal(resumed.take(1), w) for w in windows[i:i + 5]), position


def test_a_huge_document_takes_memory_of_its_size_not_18_times(tmp_path) -> None:
    """One 40 MiB .jsonl line (a document), packed and checked token by token, in a process of
    its own: its peak memory (ru_maxrss) may grow by at most 4x the line (it grew 26x when the
    whole document's ids were listed at once: a 192 MiB line took 4.8 GiB)."""
    size = 40 * 2**20
    line = '{"text": "' + ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size] + '"}\n'
    (tmp_path / "d.jsonl").write_text(line + '{"text": "small"}\n')
    script = f"""
import hashlib, resource, torch
from pathlib import Path
from torchmoe.data import ByteTokenizer, FileDocuments, PackedStream
stream = PackedStream(FileDocuments([Path({str(tmp_path / "d.jsonl")!r})]), ByteTokenizer(), window=4097)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
digest, count = hashlib.sha256(), 0
while stream.position()[0] == 0:  # the first pass: both documents and their EOS
    tokens = stream.take(64).flatten()
    digest.update(tokens.to(torch.int16).numpy().tobytes())
    count += len(tokens)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, count, digest.hexdigest())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    grown_kib, count, digest = proc.stdout.split()
    ids = torch.cat([torch.frombuffer(bytearray(line[10:-3].encode()), dtype=torch.uint8).to(torch.int16),
                     torch.tensor([EOS, *b"small", EOS], dtype=torch.int16)])
    ids = torch.cat([ids, ids])[: int(count)]  # the last windows run into the second pass
    assert digest == hashlib.sha256(ids.numpy().tobytes()).hexdigest()  # every token, in order
    assert int(grown_kib) * 1024 <= 4 * size, f"grew {int(grown_kib) / 1024:.0f} MiB for a {size / 2**20:.0f} MiB line"


@pytest.mark.parametrize("dp_degree, local_batch_size", LAYOUTS)
def test_global_batch_is_independent_of_dp_and_accumulation(dp_degree: int, local_batch_size: int) -> None:
    reference = _ranks(1, G)
    ranks = _ranks(dp_degree, local_batch_size)
    accum = G // (dp_degree * local_batch_size)
    assert all(rank.grad_accum_steps == accum for rank in ranks)
    for _ in range(12):  # enough to wrap every sub-corpus (5 documents each)
        want_x, want_y = _global_step(reference)
        per_rank = [rank.next_batch() for rank in ranks]
        for micro_batches in per_rank:
            assert len(micro_batches) == accum
            assert all(x.shape == y.shape == (local_batch_size, 8) for x, y in micro_batches)
        got_x, got_y = _global([mb for micro_batches in per_rank for mb in micro_batches])
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)


@pytest.mark.parametrize("dp_degree", [1, 2, 4])
def test_each_rank_tokenizes_only_its_own_rows(dp_degree: int) -> None:
    # 64 documents of 31 bytes + EOS: row j reads documents 8j .. 8j + 7, every row consumes as many, so
    # each rank must tokenize exactly 1/D of what one rank tokenizes (read_ahead 1: one document per row
    # at a time).
    docs = InMemoryDocuments([f"{i:03d}" + "x" * 28 for i in range(64)])
    tokenizers = [RecordingTokenizer() for _ in range(dp_degree)]
    ranks = _ranks(dp_degree, G // dp_degree, docs, tokenizers, seq_len=15, read_ahead=1)
    for _ in range(5):  # 5 windows of 16 tokens per row: documents 0..2 of each row
        _global_step(ranks)
    per_rank = G // dp_degree
    for r, tok in enumerate(tokenizers):
        # Rank r's rows r*G/D ..: documents 8 * row, 8 * row + 1, 8 * row + 2.
        want = sorted(8 * row + k for row in range(r * per_rank, (r + 1) * per_rank) for k in range(3))
        assert sorted(int(text[:3]) for text in tok.texts) == want
        assert len(tok.texts) == 24 // dp_degree and sum(map(len, tok.texts)) == 24 * 31 // dp_degree


@pytest.mark.parametrize("saved, resumed", [(LAYOUTS[0], LAYOUTS[2]), (LAYOUTS[2], LAYOUTS[3]),
                                            (LAYOUTS[3], LAYOUTS[1]), (LAYOUTS[1], LAYOUTS[0])])
@pytest.mark.parametrize("resume_at", [1, 3, 7])
def test_resume_is_exact_across_layouts(saved: tuple[int, int], resumed: tuple[int, int], resume_at: int) -> None:
    uninterrupted = _ranks(*saved)
    for _ in range(resume_at):
        _global_step(uninterrupted)
    state = _state(uninterrupted)
    assert state["step"] == resume_at and state["rows"].shape == (G, 3) and state["rows"].dtype == torch.long
    assert (state["rows"][:, 2] > 0).any()  # some row resumes inside a document
    restored = _ranks(*resumed)
    for rank in restored:
        rank.load_state_dict(state)
    for _ in range(10):  # into the second pass
        want, got = _global_step(uninterrupted), _global_step(restored)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(_state(restored)["rows"], _state(uninterrupted)["rows"])
    assert _state(restored)["step"] == resume_at + 10


def test_a_rank_loads_its_own_rows_back() -> None:
    ranks = _ranks(2, 2)
    _global_step(ranks)
    states = [rank.state_dict() for rank in ranks]
    assert all(s["rows"].shape == (G // 2, 3) for s in states)
    restored = _ranks(2, 2)
    for rank, state in zip(restored, states):
        rank.load_state_dict(state)
    assert torch.equal(_global_step(restored)[0], _global_step(ranks)[0])


def test_resume_does_not_retokenize_earlier_documents() -> None:
    docs = InMemoryDocuments([f"{i:04d}" + "x" * 996 for i in range(100)])  # 1001 tokens with EOS
    uninterrupted = _loader(docs, seq_len=63, global_batch_size=4, local_batch_size=4)
    for _ in range(100):  # 100 windows of 64 tokens per row: inside document 6 of each row
        uninterrupted.next_batch()
    state = uninterrupted.state_dict()
    assert state["rows"].tolist() == [[0, 6, 100 * 64 - 6 * 1001]] * 4
    tok = RecordingTokenizer()
    restored = _loader(docs, tok, seq_len=63, global_batch_size=4, local_batch_size=4)
    restored.load_state_dict(state)
    assert torch.equal(_global(restored.next_batch())[0], _global(uninterrupted.next_batch())[0])
    # Row j reads documents 25j .. 25j + 24, and resumes in 25j + 6: nothing before it was tokenized.
    assert min(int(text[:4]) for text in tok.texts) == 6
    assert all(int(text[:4]) % 25 >= 6 for text in tok.texts)


def test_two_constructions_are_identical() -> None:
    a, b = _loader(), _loader()
    for _ in range(5):
        assert torch.equal(_global(a.next_batch())[0], _global(b.next_batch())[0])


def test_wraps_around_and_says_so_once_a_pass(caplog: pytest.LogCaptureFixture) -> None:
    loader = _loader(InMemoryDocuments(["abc", "de"]), seq_len=3, global_batch_size=1, local_batch_size=1)
    with caplog.at_level(logging.INFO, logger="torchmoe.data.passes"):
        batches = [loader.next_batch()[0][0].tolist() for _ in range(3)]
    a, b, c, d, e = (ord(ch) for ch in "abcde")
    # Stream: a b c EOS d e EOS | a b c EOS d e EOS ..., windows of 4.
    assert batches == [[[a, b, c]], [[d, e, EOS]], [[b, c, EOS]]]
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "batch rows start pass 1 over their documents as each finishes the one before (data repeats; this row's "
        "share holds 2)"]
    # Eight rows of one document each: every row starts each pass, and each pass is said once.
    caplog.clear()
    rows = _loader(InMemoryDocuments(["ab"] * 8), seq_len=3, global_batch_size=8, local_batch_size=8)
    with caplog.at_level(logging.INFO, logger="torchmoe.data.passes"):
        for _ in range(3):
            rows.next_batch()
    assert [r.getMessage().split("start pass ")[1][:2] for r in caplog.records] == ["1 ", "2 ", "3 "]  # not 8 each
    # The next window starts at "e": second pass, document 1, token 1.
    state = loader.state_dict()
    assert state["step"] == 3 and state["rows"].tolist() == [[1, 1, 1]]


def test_invalid_layouts_and_data() -> None:
    with pytest.raises(ValueError, match=r"dp_rank 2 is not in \[0, dp_degree=2\)"):
        _loader(global_batch_size=4, local_batch_size=2, dp_rank=2, dp_degree=2)
    with pytest.raises(ValueError, match=r"InMemoryDocuments\(0 texts\)\"?: holds no documents"):
        _loader(InMemoryDocuments([])).next_batch()
    # 3 bytes for 4 rows: some row would get nothing.
    with pytest.raises(ValueError, match=r"(?s)global_batch_size = 4: the corpus .* holds 3 bytes, too few to give each "
                                         r"of 4 batch rows a part of it\n.*smaller"):  # fmt: skip
        _loader(InMemoryDocuments(["a", "b", "c"]), global_batch_size=4, local_batch_size=4).next_batch()
    # Documents, but no text: a whole pass of empty / whitespace-only ones is refused, not trained on.
    with pytest.raises(ValueError, match=r"the 3 document\(s\) of a batch row hold no text: document 0, document 1, "
                                         r"document 2 \(empty or only whitespace\)"):
        _loader(InMemoryDocuments(["", " \n", "\t"]), global_batch_size=1, local_batch_size=1).next_batch()
    # One text among empty documents is enough (it trains on that text and the EOS tokens).
    _loader(InMemoryDocuments(["", "x", ""]), global_batch_size=1, local_batch_size=1).next_batch()
    loader = _loader(InMemoryDocuments(["short"]), global_batch_size=1, local_batch_size=1)
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({"step": 1, "rows": torch.tensor([[0, 3, 2]])})


def test_state_of_another_global_batch_size_is_a_config_error() -> None:
    saved = _loader(global_batch_size=4, local_batch_size=4)
    saved.next_batch()
    with pytest.raises(ConfigError) as err:
        _loader().load_state_dict(saved.state_dict())  # G = 8
    assert err.value.key == "training.global_batch_size" and err.value.value == 8
    assert "saved with global_batch_size 4" in str(err.value)
    assert "resume with training.global_batch_size = 4" in str(err.value)


def test_build_dataloader_on_python_docs() -> None:
    training = Training(seq_len=64, local_batch_size=2, global_batch_size=-1)
    loader = build_dataloader(training, ByteTokenizer(), dp_rank=1, dp_degree=2)
    assert loader.global_batch_size == 4 and loader.grad_accum_steps == 1
    assert list(loader.rows) == [2, 3]
    [(x, y)] = loader.next_batch()
    assert x.shape == y.shape == (2, 64)
    assert int(x.max()) < ByteTokenizer().vocab_size


@pytest.mark.parametrize("saved, resumed", [(LAYOUTS[0], LAYOUTS[3]), (LAYOUTS[2], LAYOUTS[1])])
def test_resume_inside_parts_of_one_text_file_is_exact_across_layouts(tmp_path, saved, resumed) -> None:
    """One .txt file cut into G parts: positions inside parts resume exactly, under any layout."""
    from torchmoe.data import FileDocuments

    (tmp_path / "play.txt").write_text("".join(f"{i}: and thus the native hue of resolution\n" for i in range(400)))
    docs = FileDocuments([tmp_path / "play.txt"])
    uninterrupted = _ranks(*saved, docs=docs)
    for _ in range(30):
        _global_step(uninterrupted)
    state = _state(uninterrupted)
    assert (state["rows"][:, 2] > 0).all()  # every row inside its part
    restored = _ranks(*resumed, docs=FileDocuments([tmp_path / "play.txt"]))
    for rank in restored:
        rank.load_state_dict(state)
    for _ in range(300):  # past the end of every row's part (about 2,100 bytes), into the second pass
        want, got = _global_step(uninterrupted), _global_step(restored)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (_state(restored)["rows"][:, 0] >= 1).all()
