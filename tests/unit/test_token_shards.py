"""Pre-tokenized shards: `prepare` writes them, `TokenShards` reads them back exactly, a killed run
resumes to the same files, and what is wrong with a folder is one DataConfigError.

    pytest tests/unit/test_token_shards.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from torchmoe.commands import prepare_data
from torchmoe.config.errors import ConfigError
from torchmoe.config.numbers import shown_text
from torchmoe.data import build_tokenizer
from torchmoe.data import prepare as prepare_module
from torchmoe.data.dataset import DataConfigError
from torchmoe.data.prepare import prepare
from torchmoe.data.token_shards import MANIFEST, PROGRESS, TokenShards, token_dtype

# Empty documents, multi-byte characters, one long line: every document is its own ids.
TEXTS = [f"document {i}: {'héllo wörld → 你好 ' * (i % 7)}\n\tdef f{i}(x):\n    return x + {i}\n" for i in range(40)]
TEXTS[5] = TEXTS[17] = ""


def _corpus(folder: Path) -> list[str]:
    """TEXTS as a .jsonl file (the first 30) and ten .txt files (one document each); returns the
    INPUTs, whose documents are TEXTS in order."""
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:30]))
    (folder / "txt").mkdir()
    for i, text in enumerate(TEXTS[30:]):
        (folder / "txt" / f"{i:02d}.txt").write_text(text)
    return [str(folder / "a.jsonl"), str(folder / "txt")]


def _tiny_bpe(folder: Path) -> str:
    """A byte-level BPE of 300 ids trained on TEXTS, saved as folder/tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _prepared(tmp_path: Path, name: str = "out", **kwargs) -> TokenShards:
    inputs = _corpus(tmp_path / "corpus") if not (tmp_path / "corpus").exists() else \
        [str(tmp_path / "corpus" / "a.jsonl"), str(tmp_path / "corpus" / "txt")]
    prepare(inputs, tmp_path / name, show_progress=False, **{"workers": 1, "shard_tokens": 600, **kwargs})
    return TokenShards(tmp_path / name)


def _assert_round_trip(shards: TokenShards, tokenizer_path: str) -> None:
    tokenizer = build_tokenizer(tokenizer_path)
    assert shards.num_documents == len(TEXTS)
    for i, text in enumerate(TEXTS):
        assert shards.tokens(i).dtype == np.uint16
        assert shards.tokens(i).tolist() == tokenizer.encode(text), i
        assert shards.token_count(i) == len(tokenizer.encode(text))
    # Each document's size as the raw files' rows measure it: a .jsonl line's bytes, a .txt file's.
    lines = [len(json.dumps({"text": t})) for t in TEXTS[:30]]
    assert shards.sizes().tolist() == lines + [len(t.encode("utf-8")) for t in TEXTS[30:]]
    assert len(shards.manifest["shards"]) >= 3  # documents run on across shards
    shards.check_tokenizer(tokenizer)


def test_byte_shards_round_trip_to_the_tokenizer(tmp_path: Path) -> None:
    shards = _prepared(tmp_path)
    _assert_round_trip(shards, "")
    first = shards.manifest["shards"][0]["documents"]
    assert shards.locate(first + 2) == "shard-00001 document 2"
    assert (shards.manifest["documents"], shards.manifest["tokens"]) == (40, sum(len(t.encode()) for t in TEXTS))
    # Each shard is closed by the document that brings it to 600 tokens: no earlier, no later.
    for entry in shards.manifest["shards"][:-1]:
        assert entry["tokens"] >= 600
        assert entry["tokens"] - len(TEXTS[sum(s["documents"] for s in shards.manifest["shards"]
                                               if s["name"] <= entry["name"]) - 1].encode()) < 600
    with pytest.raises(IndexError):
        shards.tokens(40)


def test_hf_shards_round_trip_with_worker_processes(tmp_path: Path) -> None:
    """Two worker processes give the same files as one (documents in order)."""
    tokenizer = _tiny_bpe(tmp_path / "tok")
    _assert_round_trip(_prepared(tmp_path, "two", tokenizer_path=tokenizer, workers=2), tokenizer)
    _prepared(tmp_path, "one", tokenizer_path=tokenizer)
    assert _files(tmp_path / "two") == _files(tmp_path / "one")


def test_hub_dataset_input(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    prepare([f"hf:{tmp_path / 'hub'}"], tmp_path / "out", workers=1, text_field="body", show_progress=False)
    shards = TokenShards(tmp_path / "out")
    assert [shards.tokens(i).tolist() for i in range(len(TEXTS))] == [list(t.encode()) for t in TEXTS]
    assert shards.manifest["source"] == {"kind": "hf", "dataset": str(tmp_path / "hub"), "config": None,
                                         "split": "train", "text_field": "body"}


def test_vocabularies_above_65536_ids_take_uint32() -> None:
    assert (token_dtype(258), token_dtype(65536), token_dtype(65537), token_dtype(202048)) == (
        np.uint16, np.uint16, np.uint32, np.uint32)


class _Killed(BaseException):
    """What a kill does to the run: nothing after it (not an Exception, so nothing handles it)."""


def test_killed_run_resumes_to_identical_files(tmp_path: Path, monkeypatch) -> None:
    reference = _files(_prepared(tmp_path, "whole").folder)
    real_write, written = prepare_module.write_shard, []

    def killed_after_two(folder, index, *args):  # shard 2's files are written, its progress is not
        written.append(real_write(folder, index, *args))
        (folder / "shard-00003.tokens.npy.tmp").write_bytes(b"half a file")  # a write cut short
        if index == 2:
            raise _Killed
        return written[-1]

    monkeypatch.setattr(prepare_module, "write_shard", killed_after_two)
    with pytest.raises(_Killed):
        _prepared(tmp_path, "killed")
    assert (tmp_path / "killed" / PROGRESS).exists() and not (tmp_path / "killed" / MANIFEST).exists()
    with pytest.raises(DataConfigError, match="unfinished prepare-data run"):
        TokenShards(tmp_path / "killed")
    monkeypatch.setattr(prepare_module, "write_shard", real_write)

    # The resumed run reads the documents of shards 0 and 1 again but tokenizes none of them.
    real_encode, encoded = prepare_module.encode_documents, []
    monkeypatch.setattr(prepare_module, "encode_documents",
                        lambda tok, texts, dtype: encoded.extend(texts) or real_encode(tok, texts, dtype))
    _prepared(tmp_path, "killed")
    assert encoded == TEXTS[written[0]["documents"] + written[1]["documents"]:]
    assert _files(tmp_path / "killed") == reference


def test_out_dir_of_another_job_is_refused(tmp_path: Path) -> None:
    _prepared(tmp_path)
    # The same job again: nothing to do. Another tokenizer or shard size: refused.
    assert _prepared(tmp_path).manifest["tokens"] > 0
    with pytest.raises(DataConfigError, match=r"holds a finished prepare-data run of other inputs or settings "
                       r"\(another shard_tokens\)"):
        _prepared(tmp_path, shard_tokens=700)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DataConfigError, match=r'OUT_DIR = ".*other": is not empty \(holds notes.txt\)'):
        _prepared(tmp_path, "other")


def test_shards_of_another_tokenizer_are_refused(tmp_path: Path) -> None:
    shards = _prepared(tmp_path)
    bpe = _tiny_bpe(tmp_path / "tok")
    with pytest.raises(DataConfigError) as err:
        shards.check_tokenizer(build_tokenizer(bpe))
    assert str(err.value) == (
        f'model.tokenizer_path = "{bpe}": the shards in {tmp_path / "out"} were tokenized with byte (hash '
        f'torchmoe-byte-to), not {bpe} (hash {build_tokenizer(bpe).fingerprint().hash[:16]})\n'
        f'  fix: prepare the data again with --tokenizer {bpe}, or set model.tokenizer_path to \'\'')
    # The fingerprint hashes the special tokens the config files choose, not only tokenizer.json.
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    swapped = build_tokenizer(bpe)
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    assert swapped.fingerprint().hash != build_tokenizer(bpe).fingerprint().hash


def _damage(folder: Path, how: str) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    if how == "truncated":
        path = folder / "shard-00001.tokens.npy"
        path.write_bytes(path.read_bytes()[:-2])
    elif how == "flipped":
        path = folder / "shard-00001.docs.npy"
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))
    elif how == "missing":
        (folder / "shard-00001.sizes.npy").unlink()
    elif how == "version":
        (folder / MANIFEST).write_text(json.dumps({**manifest, "version": 2}))
    elif how in ("piped_manifest", "piped_docs", "piped_tokens"):  # a read would wait for a writer for ever
        name = {"piped_manifest": MANIFEST, "piped_docs": "shard-00001.docs.npy",
                "piped_tokens": "shard-00001.tokens.npy"}[how]
        (folder / name).unlink()
        os.mkfifo(folder / name)
    elif how == "pickled":  # an object array, its digest recorded: loading it would unpickle
        np.save(folder / "shard-00001.sizes.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
        from torchmoe.config.files.digests import digest_file
        manifest["shards"][1]["files"]["shard-00001.sizes.npy"] = digest_file(folder / "shard-00001.sizes.npy")
        (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("how, message", [
    ("truncated", r"shard-00001.tokens.npy is not a whole .npy array \(mmap length is greater than file size\)"),
    ("flipped", r"shard-00001.docs.npy does not match the checksum in manifest.json \(xxh3_64 \w+, recorded \w+\): "
                r"it changed on disk"),
    ("missing", r".*out/shard-00001.sizes.npy: No such file or directory"),
    ("version", r"manifest.json is format version 2; this torchmoe reads version 1"),
    ("piped_manifest", r".*out/manifest.json is a named pipe, not a regular file"),
    ("piped_docs", r".*out/shard-00001.docs.npy is a named pipe, not a regular file"),
    ("piped_tokens", r".*out/shard-00001.tokens.npy is a named pipe, not a regular file"),
    ("pickled", r"shard-00001.sizes.npy is not a whole .npy array \(Array can.t be memory-mapped: Python objects "
                r"in dtype.\)"),
])
def test_damaged_folders_are_refused(tmp_path: Path, how: str, message: str) -> None:
    folder = _prepared(tmp_path).folder
    _damage(folder, how)
    with pytest.raises(DataConfigError, match=r'training.dataset_path = ".*out": ' + message):
        TokenShards(folder)


@pytest.mark.parametrize("token", [65535, "vocab"])
def test_a_token_id_outside_the_vocabulary_is_refused_where_it_is_read(tmp_path: Path, token) -> None:
    """tokens.npy carries no digest (it is the bulk): an id written into it by something else is
    refused when its document is read, naming the shard and document, whether past any
    embedding (65535: an IndexError mid-step before) or just past the tokenizer's vocabulary
    (which trained silently before). The last id of the vocabulary is read."""
    shards = _prepared(tmp_path)
    vocab = shards.manifest["vocab_size"]
    path = tmp_path / "out" / "shard-00001.tokens.npy"
    tokens = np.load(path)
    tokens[3] = vocab - 1
    np.save(path, tokens)
    within = int(np.searchsorted(shards._offsets[1], 3, side="right")) - 1  # the document holding token 3
    document = int(shards._first[1]) + within
    assert int(TokenShards(tmp_path / "out").tokens(document).max()) == vocab - 1
    tokens[3] = 65535 if token == 65535 else vocab
    np.save(path, tokens)
    with pytest.raises(DataConfigError, match=rf'"{re.escape(str(tmp_path / "out"))}": shard-00001 document '
                       rf"{within} holds token id {tokens[3]}, outside the vocabulary of {vocab} ids"):
        TokenShards(tmp_path / "out").tokens(document)


def test_a_manifest_vocabulary_changed_by_hand_is_refused(tmp_path: Path) -> None:
    """The tokenizer's hash matches but the recorded vocabulary was raised (to let larger ids
    through): refused against the tokenizer's own size."""
    shards = _prepared(tmp_path)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    (tmp_path / "out" / MANIFEST).write_text(json.dumps({**manifest, "vocab_size": 65536}))
    with pytest.raises(DataConfigError, match="its manifest.json records a vocabulary of 65536 ids, but its "
                       rf"tokenizer \(byte .*\) has {shards.manifest['vocab_size']}"):
        TokenShards(tmp_path / "out").check_tokenizer(build_tokenizer(""))


def test_empty_corpus_is_one_message(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataConfigError, match=r"INPUT = .*empty.jsonl\": holds no text \(1 documents, all empty\)"):
        prepare([str(tmp_path / "empty.jsonl")], tmp_path / "out", workers=1, show_progress=False)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("bad", ["a_line_not_json", "a_line_not_utf8"])
def test_an_input_error_before_any_shard_leaves_nothing_and_the_fixed_command_runs(tmp_path: Path, bad: str) -> None:
    """A bad line found before any shard is complete: nothing to resume, so nothing is left
    (before, its progress.json made the fixed command, of other inputs, "another job's run")."""
    corpus = tmp_path / "c.jsonl"
    good = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5])
    corpus.write_bytes(good.encode() + (b'{"text": "cut\n' if bad == "a_line_not_json" else b'{"text": "\xff"}\n'))
    with pytest.raises(DataConfigError, match=r"c\.jsonl:6 is not "):
        prepare([str(corpus)], tmp_path / "out", workers=1, show_progress=False)
    assert list((tmp_path / "out").iterdir()) == []
    corpus.write_text(good)
    assert prepare([str(corpus)], tmp_path / "out", workers=1, show_progress=False)["documents"] == 5


@pytest.mark.parametrize(("workers", "problem"), [
    ("100000000000000000000", "is more than 8 (4 tokenizing processes for each of the 2 cores"),
    ("9", "is more than 8"),
    ("1e20", "expected an integer"),
    ("0", "must be an integer from 1 to 8"),
    ("1" * 5001, "is more than 8"),  # past Python's digit limit: was its ValueError traceback
])
def test_workers_are_bounded_by_the_cores(tmp_path: Path, monkeypatch, workers: str, problem: str) -> None:
    """--workers beyond 4 a core is refused before anything is forked (a number of 20 digits forked
    until the OS killed it)."""
    monkeypatch.setattr(prepare_module, "default_workers", lambda: 2)
    corpus = _corpus(tmp_path / "corpus")
    with pytest.raises(ConfigError, match=f'--workers = "{re.escape(shown_text(workers))}": {re.escape(problem)}'):
        prepare_data.prepare_main([*corpus, str(tmp_path / "out"), "--workers", workers])
    assert not (tmp_path / "out").exists()


def test_a_shard_index_found_good_is_not_hashed_again_until_it_changes(tmp_path: Path, monkeypatch) -> None:
    """The checks before a run and the run open the same shards: each index file is hashed once
    per process while it stays as it was (older than the clock's tick), and again once changed."""
    import os
    import time

    from torchmoe.data import token_shards

    folder = _prepared(tmp_path).folder
    past = time.time() - 60
    for path in folder.glob("*.npy"):
        os.utime(path, (past, past))
    hashed = []
    real = token_shards.digest_file
    monkeypatch.setattr(token_shards, "digest_file", lambda path: hashed.append(path) or real(path))
    TokenShards(folder)
    first = len(hashed)
    assert first == 2 * len(json.loads((folder / MANIFEST).read_text())["shards"])  # docs and sizes of each
    TokenShards(folder)
    assert len(hashed) == first
    _damage(folder, "flipped")  # same size, same inode: its times changed
    with pytest.raises(DataConfigError, match="does not match the checksum"):
        TokenShards(folder)


def test_a_resume_refuses_a_pickled_shard_whose_digest_was_recorded(tmp_path: Path, monkeypatch) -> None:
    """An unfinished run's shard replaced by an object array, its digest forged into
    progress.json: the resume refuses it (it was taken, and the finished folder then refused by
    every run that read it)."""
    real_write = prepare_module.write_shard

    def killed_after_one(folder, index, *args):
        written = real_write(folder, index, *args)
        if index == 1:
            raise _Killed
        return written

    monkeypatch.setattr(prepare_module, "write_shard", killed_after_one)
    with pytest.raises(_Killed):
        _prepared(tmp_path, "killed")
    monkeypatch.setattr(prepare_module, "write_shard", real_write)
    folder = tmp_path / "killed"
    np.save(folder / "shard-00000.sizes.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    progress = json.loads((folder / PROGRESS).read_text())
    from torchmoe.config.files.digests import digest_file
    progress["shards"][0]["files"]["shard-00000.sizes.npy"] = digest_file(folder / "shard-00000.sizes.npy")
    (folder / PROGRESS).write_text(json.dumps(progress))
    with pytest.raises(DataConfigError, match=r'OUT_DIR = ".*killed": shard-00000.sizes.npy is not a whole .npy '
                       r"array \(Array can.t be memory-mapped: Python objects in dtype.\)"):
        _prepared(tmp_path, "killed")
    assert not (folder / MANIFEST).exists()


@pytest.mark.parametrize("offsets", ["reversed", "past_the_end", "negative"])
def test_offsets_that_are_no_range_of_the_tokens_are_refused_where_read(tmp_path: Path, offsets: str) -> None:
    """docs.npy rewritten with its digest forged: a document whose offsets run backwards, past
    the shard's tokens or below 0 read other tokens, or none, silently before."""
    from torchmoe.config.files.digests import digest_file

    shards = _prepared(tmp_path)
    path = tmp_path / "out" / "shard-00000.docs.npy"
    docs = np.load(path)
    length = len(np.load(tmp_path / "out" / "shard-00000.tokens.npy"))
    docs[2] = {"reversed": docs[1] - 1, "past_the_end": length + 5, "negative": -4}[offsets]
    np.save(path, docs)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    manifest["shards"][0]["files"]["shard-00000.docs.npy"] = digest_file(path)
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(manifest))
    opened = TokenShards(tmp_path / "out")
    assert opened.tokens(0).tolist() == shards.tokens(0).tolist()  # an untouched document reads as before
    with pytest.raises(DataConfigError, match=r"shard-00000 document 1 spans tokens -?\d+ to -?\d+ in docs.npy, "
                       rf"not a range of the shard's {length} tokens"):
        opened.tokens(1)
