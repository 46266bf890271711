"""Training data from pre-tokenized shards (`training.dataset = "tokens"`): the same rows and
windows as the raw text they were made from, exact resume across dp degrees, the tokenizer check.

    pytest tests/unit/test_token_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Training
from torchmoe.data import DataLoader, build_dataloader, build_tokenizer
from torchmoe.data.prepare import prepare
from torchmoe.data.token_shards import TokenShards

# Documents of 30-120 bytes in a .jsonl file, a .txt file and a .parquet file: none is larger than a
# row's share at the G used here, so rows hold whole documents and text and tokens split alike.
TEXTS = [f"{i}: " + "the quick brown fox jumps over the lazy dog "[: 20 + i * 7 % 90] + "\n" for i in range(60)]


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:40]))
    (folder / "b.txt").write_text(TEXTS[40])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS[41:]}), folder / "c.parquet", row_group_size=7)
    return folder


def _loaders(tmp_path: Path, tokenizer_path: str = "", **kw) -> tuple[DataLoader, DataLoader]:
    corpus = _corpus(tmp_path / "corpus")
    prepare([str(corpus)], tmp_path / "shards", tokenizer_path=tokenizer_path, workers=1, shard_tokens=500,
            show_progress=False)
    tokenizer = build_tokenizer(tokenizer_path)
    args = dict(seq_len=15, local_batch_size=8, global_batch_size=8) | kw
    text = build_dataloader(Training(dataset="local", dataset_path=str(corpus), **args), tokenizer)
    tokens = build_dataloader(Training(dataset="tokens", dataset_path=str(tmp_path / "shards"), **args), tokenizer)
    return text, tokens


@pytest.mark.parametrize("add_bos", [False, True])
def test_shards_give_the_windows_the_raw_text_gives(tmp_path: Path, add_bos: bool) -> None:
    text, tokens = _loaders(tmp_path, add_bos=add_bos)
    assert len(TokenShards(tmp_path / "shards")._names) > 1  # documents across shards
    for _ in range(60):  # past the end of every row, into the second pass
        (x, y), = text.next_batch()
        (xt, yt), = tokens.next_batch()
        assert torch.equal(x, xt) and torch.equal(y, yt)
    assert torch.equal(text.state_dict()["rows"], tokens.state_dict()["rows"])


def test_shards_of_a_bpe_tokenizer_give_its_windows(tmp_path: Path) -> None:
    from tests.unit.test_token_shards import _tiny_bpe

    text, tokens = _loaders(tmp_path, tokenizer_path=_tiny_bpe(tmp_path / "tok"), add_bos=True)
    for _ in range(30):
        assert torch.equal(text.next_batch()[0][0], tokens.next_batch()[0][0])


@pytest.mark.parametrize("saved, resumed", [((1, 8), (2, 4)), ((4, 1), (2, 2)), ((2, 2), (1, 8))])
def test_resume_from_shards_is_exact_across_dp_degrees(tmp_path: Path, saved, resumed) -> None:
    corpus = _corpus(tmp_path / "corpus")
    prepare([str(corpus)], tmp_path / "shards", workers=1, shard_tokens=500, show_progress=False)

    def ranks(dp: int, local: int) -> list[DataLoader]:
        training = Training(dataset="tokens", dataset_path=str(tmp_path / "shards"), seq_len=15,
                            local_batch_size=local, global_batch_size=8)
        return [build_dataloader(training, build_tokenizer(""), dp_rank=r, dp_degree=dp) for r in range(dp)]

    def step(loaders: list[DataLoader]) -> torch.Tensor:
        return torch.cat([x for loader in loaders for x, _ in loader.next_batch()])

    first = ranks(*saved)
    for _ in range(7):
        step(first)
    state = {"step": 7, "rows": torch.cat([loader.state_dict()["rows"] for loader in first])}
    assert (state["rows"][:, 2] > 0).any()  # some row inside a document
    again = ranks(*resumed)
    for loader in again:
        loader.load_state_dict(state)
    for _ in range(40):
        assert torch.equal(step(again), step(first))


def test_shards_of_another_tokenizer_are_refused_before_training(tmp_path: Path) -> None:
    from tests.unit.test_token_shards import _tiny_bpe

    _corpus(tmp_path / "corpus")
    prepare([str(tmp_path / "corpus")], tmp_path / "shards", workers=1, show_progress=False)
    training = Training(dataset="tokens", dataset_path=str(tmp_path / "shards"), seq_len=15, local_batch_size=8)
    with pytest.raises(ConfigError, match=r"model.tokenizer_path = .*the shards in .* were tokenized with "):
        build_dataloader(training, build_tokenizer(_tiny_bpe(tmp_path / "tok")))
    with pytest.raises(ConfigError, match=r'training.dataset_path = "": dataset = "tokens" needs a folder'):
        build_dataloader(Training(dataset="tokens"), build_tokenizer(""))


# A path that holds another kind of corpus than training.dataset reads: (kind, path under the test's
# folder: "shards" a prepare-data folder, "corpus" text; the message; the fix). The setting that
# reads it is named, before anything is read.
KIND_MISMATCHES = {
    "shards_as_local": ("local", "shards", 'is a folder of token shards written by `torchmoe prepare-data` '
                        '({tmp}/shards/manifest.json), which dataset "local" would read as text',
                        'fix: set training.dataset = "tokens" (--training.dataset tokens)'),
    "manifest_as_local": ("local", "shards/manifest.json", "is a file in a folder of token shards",
                          "(--training.dataset tokens), and point it at {tmp}/shards"),
    "shard_glob_as_local": ("local", "shards/*.npy", "is a file in a folder of token shards", "point it at"),
    "shards_as_hf": ("hf", "shards", 'which dataset "hf" would read as text', 'set training.dataset = "tokens"'),
    "unfinished_shards_as_local": ("local", "unfinished", "a folder of token shards", '"tokens"'),
    "jsonl_as_tokens": ("tokens", "corpus/a.jsonl", 'holds text, not the token shards dataset "tokens" reads (no '
                        "manifest.json)", 'set training.dataset = "local" (--training.dataset local) to read it as it '
                        "is, or tokenize it once: torchmoe prepare-data {tmp}/corpus/a.jsonl data/tokens"),
    "text_folder_as_tokens": ("tokens", "corpus", "holds text, not the token shards", "torchmoe prepare-data"),
    "text_glob_as_tokens": ("tokens", "corpus/*.txt", "holds text, not the token shards", '"local"'),
    "a_shard_as_tokens": ("tokens", "shards/shard-00000.tokens.npy", "is a file of the token shards in "
                          "{tmp}/shards, not their folder", "fix: point it at the folder: {tmp}/shards"),
}


@pytest.mark.parametrize("case", list(KIND_MISMATCHES))
def test_a_corpus_of_another_kind_names_the_kind_that_reads_it(tmp_path: Path, case: str) -> None:
    kind, path, *expected = KIND_MISMATCHES[case]
    _corpus(tmp_path / "corpus")
    prepare([str(tmp_path / "corpus")], tmp_path / "shards", workers=1, show_progress=False)
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "progress.json").write_text("{}")
    training = Training(dataset=kind, dataset_path=str(tmp_path / path), seq_len=15, local_batch_size=8)
    with pytest.raises(ConfigError) as err:
        build_dataloader(training, build_tokenizer(""))
    assert err.value.key == "training.dataset_path" and err.value.value == str(tmp_path / path)
    assert all(text.format(tmp=tmp_path) in str(err.value) for text in expected), str(err.value)


def test_a_mixture_and_validation_name_their_own_setting(tmp_path: Path) -> None:
    from torchmoe.data.dataset import build_documents

    _corpus(tmp_path / "corpus")
    prepare([str(tmp_path / "corpus")], tmp_path / "shards", workers=1, show_progress=False)
    with pytest.raises(ConfigError, match=r"fix: write its entry in training.dataset_mix as \[NAME=\]WEIGHT:tokens:PATH"):
        build_documents(Training(dataset="local", dataset_path=str(tmp_path / "shards")), key="training.dataset_mix")
    with pytest.raises(ConfigError, match='fix: set validation.dataset = "local"'):
        build_documents(Training(dataset="tokens", dataset_path=str(tmp_path / "corpus")), key="validation.dataset_path")
    # and what each kind reads is let through
    assert build_documents(Training(dataset="tokens", dataset_path=str(tmp_path / "shards"))).num_documents == 60
    build_documents(Training(dataset="local", dataset_path=str(tmp_path / "corpus")))
