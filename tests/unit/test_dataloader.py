"""Packing and the dp-sharded loader: EOS placement, dp-independence, exact resume.

    pytest tests/unit/test_dataloader.py
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from torchmoe.config.job_config import Training
from torchmoe.data import ByteTokenizer, DataLoader, InMemoryDocuments, PackedStream, build_dataloader

EOS = ByteTokenizer().eos_id


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


def _global(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def test_packing_puts_eos_between_documents_and_shifts_labels() -> None:
    docs = InMemoryDocuments(["ab", "cde", "f"])
    loader = _loader(docs, seq_len=3, global_batch_size=2, local_batch_size=2)
    [(inputs, labels)] = loader.next_batch()
    a, b, c, d, e, f = (ord(ch) for ch in "abcdef")
    # Stream: a b EOS c d e EOS f EOS | a b EOS ... cut into windows of seq_len + 1 = 4.
    assert inputs.tolist() == [[a, b, EOS], [d, e, EOS]]
    assert labels.tolist() == [[b, EOS, c], [e, EOS, f]]
    assert inputs.dtype == labels.dtype == torch.long
    assert inputs.shape == labels.shape == (2, 3)


def test_windows_tile_the_token_stream() -> None:
    docs = _corpus()
    tok = ByteTokenizer()
    stream = [t for text in docs for t in tok.encode(text) + [EOS]]
    loader = _loader(docs)
    got = []
    for _ in range(4):
        [(x, y)] = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        got += torch.cat([x, y[:, -1:]], dim=1).flatten().tolist()
    assert got == stream[: len(got)]


def test_read_ahead_does_not_change_the_stream() -> None:
    streams = [PackedStream(_corpus(), ByteTokenizer(), window=9, read_ahead=k) for k in (1, 3, 64)]
    for _ in range(20):  # past the end of the corpus and into the second pass
        first, *others = [stream.take(3) for stream in streams]
        assert all(torch.equal(first, other) for other in others)
        assert len({stream.position() for stream in streams}) == 1


@pytest.mark.parametrize("dp_degree", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_global_batch_is_independent_of_dp_and_accumulation(dp_degree: int, accum: int) -> None:
    G, seq_len = 8, 8  # _loader's seq_len
    reference = _loader(global_batch_size=G, local_batch_size=G)
    local_bs = G // (dp_degree * accum)
    ranks = [
        _loader(global_batch_size=G, local_batch_size=local_bs, dp_rank=r, dp_degree=dp_degree)
        for r in range(dp_degree)
    ]
    assert all(rank.grad_accum_steps == accum for rank in ranks)
    for _ in range(12):  # enough to wrap the corpus once
        want_x, want_y = _global(reference.next_batch())
        per_rank = [rank.next_batch() for rank in ranks]
        for micro_batches in per_rank:
            assert len(micro_batches) == accum
            assert all(x.shape == y.shape == (local_bs, seq_len) for x, y in micro_batches)
        got_x, got_y = _global([mb for micro_batches in per_rank for mb in micro_batches])
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)


@pytest.mark.parametrize("resume_at", [1, 3, 7])
def test_resume_from_state_dict_is_exact(resume_at: int) -> None:
    uninterrupted = _loader(global_batch_size=4, local_batch_size=2)
    for _ in range(resume_at):
        uninterrupted.next_batch()
    state = uninterrupted.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain ints, checkpoint friendly
    assert state["step"] == resume_at
    restored = _loader(global_batch_size=4, local_batch_size=2)
    restored.load_state_dict(state)
    for _ in range(10):
        for (x0, y0), (x1, y1) in zip(uninterrupted.next_batch(), restored.next_batch(), strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert restored.state_dict() == uninterrupted.state_dict()


def test_resume_does_not_retokenize_earlier_documents() -> None:
    docs = InMemoryDocuments([f"{i:04d}" + "x" * 996 for i in range(100)])
    uninterrupted = _loader(docs, seq_len=63, global_batch_size=4, local_batch_size=4)
    for _ in range(100):  # 100 * 4 * 64 tokens: deep into the corpus, inside document 25
        uninterrupted.next_batch()
    state = uninterrupted.state_dict()
    assert state["epoch"] == 0 and state["doc_index"] == 25 and 0 < state["token_offset"] < 1001
    tok = RecordingTokenizer()
    restored = _loader(docs, tok, seq_len=63, global_batch_size=4, local_batch_size=4)
    restored.load_state_dict(state)
    assert torch.equal(_global(restored.next_batch())[0], _global(uninterrupted.next_batch())[0])
    assert min(int(text[:4]) for text in tok.texts) == 25


def test_resume_into_another_dp_degree() -> None:
    single = _loader(global_batch_size=4, local_batch_size=4)
    single.next_batch()
    state = single.state_dict()
    ranks = [_loader(global_batch_size=4, local_batch_size=1, dp_rank=r, dp_degree=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    want = _global(single.next_batch())[0]
    got = _global([mb for rank in ranks for mb in rank.next_batch()])[0]
    assert torch.equal(got, want)


def test_two_constructions_are_identical() -> None:
    a, b = _loader(), _loader()
    for _ in range(5):
        assert torch.equal(_global(a.next_batch())[0], _global(b.next_batch())[0])


def test_wraps_around_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    loader = _loader(InMemoryDocuments(["abc", "de"]), seq_len=3, global_batch_size=1, local_batch_size=1)
    with caplog.at_level(logging.WARNING, logger="torchmoe.data.dataloader"):
        batches = [loader.next_batch()[0][0].tolist() for _ in range(3)]
    a, b, c, d, e = (ord(ch) for ch in "abcde")
    # Stream: a b c EOS d e EOS | a b c EOS d e EOS ..., windows of 4.
    assert batches == [[[a, b, c]], [[d, e, EOS]], [[b, c, EOS]]]
    assert "dataset exhausted after 2 documents" in caplog.text
    # The next window starts at "e": second pass, document 1, token 1.
    assert loader.state_dict() == {"step": 3, "epoch": 1, "doc_index": 1, "token_offset": 1}


def test_invalid_layouts_and_data() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size = 6: must be a positive multiple of "
                                         r"local_batch_size\(2\) \* dp\(2\) = 4"):  # fmt: skip
        _loader(global_batch_size=6, local_batch_size=2, dp_degree=2)
    with pytest.raises(ValueError, match=r"dp_rank 2 is not in \[0, dp_degree=2\)"):
        _loader(global_batch_size=4, local_batch_size=2, dp_rank=2, dp_degree=2)
    with pytest.raises(ValueError, match="no documents"):
        _loader(InMemoryDocuments([])).next_batch()
    loader = _loader(InMemoryDocuments(["short"]))
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({"step": 1, "epoch": 0, "doc_index": 3, "token_offset": 2})


def test_build_dataloader_on_python_docs() -> None:
    training = Training(seq_len=64, local_batch_size=2, global_batch_size=-1)
    loader = build_dataloader(training, ByteTokenizer(), dp_rank=1, dp_degree=2)
    assert loader.global_batch_size == 4 and loader.grad_accum_steps == 1
    [(x, y)] = loader.next_batch()
    assert x.shape == y.shape == (2, 64)
    assert int(x.max()) < ByteTokenizer().vocab_size
