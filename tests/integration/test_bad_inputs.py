"""Every bad input is one message and exit 2 (1 for a diverged run), and loses nothing: files the
job reads (config, datasets, tokenizer), files it writes (dump folder, checkpoints), numbers that
would overflow later, features this machine lacks, a launch without torchrun, state that turns
non-finite, and saves that fail mid-run.

    python -m pytest -q -m integration tests/integration/test_bad_inputs.py

Most cases run `torchmoe.commands.cli.main` in this process (what `torchmoe train` runs) and read what it
printed; one runs the real command to see the same from outside. Weight files
(`initial_load_path`, `convert`) are `test_bad_weights.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import DEBUG_CONFIG, HF_EXPORT, assert_user_error, small_bpe
from tests.launch import read_metrics, run_train
from torchmoe.arch.registry import model_args_from_config
from torchmoe.commands import cli
from torchmoe.config import ConfigError, load_job_config, resolve_degrees
from torchmoe.preflight.layout import check_memory_fits

pytestmark = pytest.mark.integration

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "2", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1"]


def _main(capsys, tmp_path: Path, *flags: str, dump: Path | None = None) -> tuple[int, str]:
    """`torchmoe train TINY FLAGS` in this process; returns (exit status, stderr)."""
    argv = ["train", *TINY, "--job.dump_folder", str(dump or tmp_path / "run"), *flags]
    status = cli.main(argv)
    return status, capsys.readouterr().err


def _assert_one_error(status: int, err: str, *expected: str, code: int = 2) -> None:
    assert status == code, err
    assert "Traceback" not in err, err
    assert err.count("error:") == 1, err
    for text in expected:
        assert text in err, err


# ---- files the job reads -----------------------------------------------------------------------


def _jsonl(path: Path, texts: list) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _dataset(tmp_path: Path, kind: str) -> str:
    """A dataset_path of each fault class (global batch: 2 rows)."""
    if kind == "missing":
        return str(tmp_path / "nope.txt")
    if kind == "empty_txt":
        (tmp_path / "a.txt").write_text("")
        (tmp_path / "b.txt").write_text("")
        return str(tmp_path / "*.txt")
    if kind == "whitespace_txt":
        for name in "ab":
            (tmp_path / f"{name}.txt").write_text("\n \n\t")
        return str(tmp_path / "*.txt")
    if kind == "not_utf8_txt":
        (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait")
        (tmp_path / "b.txt").write_text("fine")
        return str(tmp_path / "*.txt")
    if kind == "empty_strings_jsonl":
        return _jsonl(tmp_path / "d.jsonl", ["", "", None, ""])
    if kind == "truncated_jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "one"}\n{"text": "tw')
        return str(path)
    if kind == "deeply_nested_jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "one"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
        return str(path)
    if kind == "long_number_jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "one"}\n{"text": "two", "n": ' + "9" * 5001 + "}\n")
        return str(path)
    if kind == "deeply_nested_json":
        path = tmp_path / "d.json"
        path.write_text("[" * 100_000 + "]" * 100_000)
        return str(path)
    if kind == "not_utf8_jsonl":
        path = tmp_path / "d.jsonl"
        path.write_bytes(b'{"text": "\xff\xfe"}\n{"text": "ok"}\n')
        return str(path)
    if kind == "garbage_parquet":
        (tmp_path / "d.parquet").write_bytes(b"PAR1 but not really" * 3)
        return str(tmp_path / "d.parquet")
    if kind == "too_little_text":
        (tmp_path / "only.txt").write_text("x")
        return str(tmp_path / "only.txt")
    if kind == "folder_without_text":
        (tmp_path / "docs").mkdir()  # images and compiled code only, and hidden text
        (tmp_path / "docs" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
        (tmp_path / "docs" / "x.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0")
        (tmp_path / "docs" / ".notes.md").write_text("hidden")
        return str(tmp_path / "docs")
    if kind == "zero_byte_files":  # row 0 reads a.txt and b.txt (bytes 0-1 of 4), which hold no text
        for name, text in zip("abcd", ("", " \n", "", "\tx")):
            (tmp_path / f"{name}.txt").write_text(text)
        return str(tmp_path / "*.txt")
    if kind == "empty_parquet_rows":  # row 0 reads rows 0-3 (bytes 0-2 of 5), which hold no text
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pytest.importorskip("pyarrow").table({"text": ["", " ", None, "  ", "dd"]}),
                       tmp_path / "d.parquet")
        return str(tmp_path / "d.parquet")
    if kind == "bom_jsonl":
        path = tmp_path / "d.jsonl"
        path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n{"text": "b"}\n')
        return str(path)
    if kind == "utf16_txt":
        (tmp_path / "a.txt").write_text("two rows", encoding="utf-16")
        (tmp_path / "b.txt").write_text("fine")
        return str(tmp_path / "*.txt")
    raise ValueError(kind)


# key, and the message ({} is the test's folder); each names the file it is about.
DATASETS = {
    "missing": ("training.dataset_path", "No such file or directory"),
    "empty_txt": ("training.dataset_path", "holds 2 document(s), all empty: {0}/a.txt, {0}/b.txt\n  fix: point it "
                  "at files that hold text"),
    "whitespace_txt": ("training.dataset_path", "hold no text: {}/a.txt (empty or only whitespace)"),
    "zero_byte_files": ("training.dataset_path", "the 2 document(s) of a batch row hold no text: {0}/a.txt, "
                        "{0}/b.txt (empty or only whitespace)\n  fix: give them text or remove them from the dataset: "
                        "each of the training.global_batch_size rows packs its own range of the corpus; or check "
                        "training.dataset_text_field (it may name an empty column)"),
    "not_utf8_txt": ("training.dataset_path", "a.txt is not UTF-8 text (byte 3 is 0xE9: invalid continuation "
                     "byte)\n  fix: convert a.txt to UTF-8, e.g. iconv -f latin1 -t UTF-8 a.txt > a.txt.utf8, then "
                     "replace it; or remove it from the dataset"),
    "utf16_txt": ("training.dataset_path", "a.txt is UTF-16LE text, not UTF-8: it starts with the UTF-16LE byte "
                  "order mark (BOM, bytes FF FE)\n  fix: convert a.txt to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 a.txt "
                  "> a.txt.utf8, then replace it; or remove it from the dataset"),
    "empty_strings_jsonl": ("training.dataset_path", "the 3 document(s) of a batch row hold no text: {0}/d.jsonl:1, "
                            "{0}/d.jsonl:2, {0}/d.jsonl:3 (empty or only whitespace)"),
    "empty_parquet_rows": ("training.dataset_path", "the 4 document(s) of a batch row hold no text: {0}/d.parquet "
                           "row 0, {0}/d.parquet row 1, {0}/d.parquet row 2, ... (empty or only whitespace)"),
    "truncated_jsonl": ("training.dataset_path", "d.jsonl:2 is not JSON"),
    # Python's parsers recurse per level: a RecursionError traceback before.
    "deeply_nested_jsonl": ("training.dataset_path", "d.jsonl:2 is not JSON (nested too deeply"),
    "deeply_nested_json": ("training.dataset_path", "d.json\": is not JSON (nested too deeply"),
    # Python's digit limit: its ValueError traceback before.
    "long_number_jsonl": ("training.dataset_path", "d.jsonl:2 is not JSON (a number of more than 4,300 digits"),
    "not_utf8_jsonl": ("training.dataset_path", "d.jsonl:1 is not UTF-8 text (byte 10 is 0xFF: invalid start byte)"),
    "bom_jsonl": ("training.dataset_path", "{}/d.jsonl:1 starts with the UTF-8 byte order mark (BOM, bytes EF BB "
                  "BF)\n  fix: save d.jsonl as UTF-8 without a BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' d.jsonl; or "
                  "remove it from the dataset"),
    "garbage_parquet": ("training.dataset_path", "is not a readable .parquet file"),
    "too_little_text": ("training.global_batch_size", "the corpus (training.dataset_path = {0}/only.txt) holds 1 "
                        "bytes, too few to give each of 2 batch rows a part of it\n  fix: use a "
                        "smaller training.global_batch_size, or more text"),
    "folder_without_text": ("training.dataset_path", "this folder holds no corpus files (2 not text, e.g. "),
}


@pytest.mark.parametrize("kind", list(DATASETS))
def test_bad_dataset_is_one_message(capsys, tmp_path: Path, kind: str) -> None:
    key, problem = DATASETS[kind]
    status, err = _main(capsys, tmp_path, "--training.dataset", "local",
                        "--training.dataset_path", _dataset(tmp_path, kind))
    _assert_one_error(status, err, f"{key} = ", problem.format(tmp_path))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


@pytest.mark.parametrize("kind", ["local", "tokens"])
def test_a_corpus_of_the_other_kind_is_refused_before_the_model_is_built(capsys, tmp_path: Path, kind: str) -> None:
    """The README's prepare-data folder given to "local", and its text to "tokens": one message
    naming the kind that reads it, before the model is built (the run printed its opening line,
    built the model and failed on manifest.json as a JSON corpus before)."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    assert cli.main(["prepare-data", str(source), str(tmp_path / "tokens")]) == 0
    capsys.readouterr()
    path, other = (tmp_path / "tokens", "tokens") if kind == "local" else (source, "local")
    status = cli.main(["train", *TINY, "--job.dump_folder", str(tmp_path / "run"), "--training.dataset", kind,
                       "--training.dataset_path", str(path)])
    out, err = capsys.readouterr()
    _assert_one_error(status, err, f'training.dataset_path = "{path}": ', f'set training.dataset = "{other}"')
    assert out == "" and not (tmp_path / "run" / "config.toml").exists()  # no opening line: no model built


HUB_DATASETS = {
    # `datasets.load_dataset` on a local folder: the same resolution and reading as the hub's.
    "no_such_dataset": (None, "FileNotFoundError"),
    "no_data_files": ({}, "EmptyDatasetError"),
    "garbage_parquet": ({"train.parquet": b"PAR1 not really"}, "ArrowInvalid"),
    "no_such_config": ({"train.jsonl": b'{"text": "a"}\n{"text": "b"}\n'}, "BuilderConfig 'nocfg' not found"),
    "too_few_documents": ({"train.jsonl": b'{"text": "only one"}\n'}, "holds 1 row(s), fewer than the 2 rows"),
}


@pytest.mark.parametrize("kind", list(HUB_DATASETS))
def test_bad_hub_dataset_is_one_message(capsys, tmp_path: Path, kind: str) -> None:
    pytest.importorskip("datasets")
    files, problem = HUB_DATASETS[kind]
    folder = tmp_path / "hub"
    if files is not None:
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
    spec = f"{folder}:nocfg" if kind == "no_such_config" else str(folder)
    status, err = _main(capsys, tmp_path, "--training.dataset", "hf", "--training.dataset_path", spec)
    _assert_one_error(status, err, "training.dataset_path = ", problem)
    assert "Failed to read" not in err  # datasets' own logging of the same error is not shown


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A small BPE tokenizer.json with Llama 4's special tokens (vocab 300 < tiny's)."""
    return small_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


TOKENIZERS = {
    "missing": (None, None, "tokenizer.json: No such file or directory"),
    "truncated": ("truncate", None, "is not a valid tokenizer.json"),
    "not_utf8": (b"\x80binary", None, "tokenizer.json is not UTF-8 text (byte 0 is 0x80: invalid start byte)"),
    "utf16": (b"\xff\xfe{\x00}\x00", None, "tokenizer.json is UTF-16LE text, not UTF-8: it starts with the "
              "UTF-16LE byte order mark (BOM, bytes FF FE)\n  fix: convert tokenizer.json to UTF-8, e.g. iconv -f "
              "UTF-16 -t UTF-8 tokenizer.json > tokenizer.json.utf8, then replace it"),
    "config_not_json": ("good", b'{"bos_token": ', "tokenizer_config.json is not JSON"),
    "config_nested_too_deeply": ("good", b'{"bos_token": ' + b"[" * 100_000, "tokenizer_config.json is not JSON "
                                 "(nested too deeply"),
    "config_number_too_long": ("good", b'{"model_max_length": ' + b"9" * 5001 + b"}", "tokenizer_config.json is not "
                               "JSON (a number of more than 4,300 digits"),
    "config_not_utf8": ("good", b'{"bos_token": "\xe9"}', "tokenizer_config.json is not UTF-8 text (byte 15 is 0xE9: "
                        "invalid continuation byte)"),
    "config_bom": ("good", b'\xef\xbb\xbf{"eos_token": "<|end_of_text|>"}', "tokenizer_config.json starts with the "
                   "UTF-8 byte order mark (BOM, bytes EF BB BF)\n  fix: save tokenizer_config.json as UTF-8 without a "
                   "BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' tokenizer_config.json"),
    "config_a_list": ("good", b"[1, 2]", "tokenizer_config.json holds a JSON list, not an object"),
    "config_wrong_type": ("good", b'{"bos_token": 5}', "bos_token is 5, not a token string"),
    "config_names_missing_token": ("good", b'{"eos_token": "</s>"}', "names eos_token '</s>'"),
    "config_a_folder": ("good", "folder", "tokenizer_config.json: Is a directory"),
}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_bad_tokenizer_files_are_one_message(capsys, tmp_path: Path, tokenizer_json: Path, kind: str) -> None:
    tokenizer, config, problem = TOKENIZERS[kind]
    folder = tmp_path / "tok"
    folder.mkdir()
    good = tokenizer_json.read_bytes()
    if tokenizer is not None:
        data = {"good": good, "truncate": good[: len(good) // 2]}.get(tokenizer, tokenizer)
        (folder / "tokenizer.json").write_bytes(data)
    if config == "folder":
        (folder / "tokenizer_config.json").mkdir()
    elif config is not None:
        (folder / "tokenizer_config.json").write_bytes(config)
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(folder))
    _assert_one_error(status, err, 'model.tokenizer_path = "', problem)


def test_good_tokenizer_with_its_config_trains(capsys, tmp_path: Path, tokenizer_json: Path) -> None:
    """The control: the same tokenizer with a valid config naming its tokens runs."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>", "pad_token": None}))
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(tmp_path / "tok"),
                        "--checkpoint.last_save_in_hf", "true", *HF_EXPORT)
    assert status == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    # The Hugging Face export carries the tokenizer, byte for byte: the folder loads whole.
    export = tmp_path / "run" / "checkpoint" / "step-2-hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (tmp_path / "tok" / name).read_bytes(), name
    assert not (export / "special_tokens_map.json").exists()  # the source has none


# ---- chat data and the tokenizer folder that renders it ---------------------------------------


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The chat fixtures' ChatML tokenizer folder (no generation markers; vocab < tiny's)."""
    from tests.chat_fixtures import chatml

    return chatml(tmp_path_factory.mktemp("chat") / "tok", marked=False)


def _chat_rows(path: Path, rows: list, *, raw: str = "") -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + raw)
    return path


ANSWERED = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]}
LONELY = {"messages": [{"role": "user", "content": "no answer here"}]}


def _chat_data(tmp_path: Path, kind: str, monkeypatch) -> str:
    """A chat dataset_path of each fault class (global batch: 2 rows), bounds set small where a
    fault needs much data to pass the default."""
    from torchmoe.data import read_bounds
    from torchmoe.data.chat import chat_masks

    data = tmp_path / "chat.jsonl"
    if kind == "no_targets":  # no conversation has a target: loss 0 for a whole pass before
        return str(_chat_rows(data, [LONELY] * 6))
    if kind == "content_number":
        return str(_chat_rows(data, [ANSWERED, {"messages": [{"role": "user", "content": 5}, *ANSWERED["messages"][1:]]}]))
    if kind == "content_object":
        return str(_chat_rows(data, [ANSWERED, {"messages": [{"role": "user", "content": {"a": 1}},
                                                             *ANSWERED["messages"][1:]]}]))
    if kind == "content_parts_written_whole":  # ChatML writes {{ m.content }}: the list's Python repr
        return str(_chat_rows(data, [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                                   *ANSWERED["messages"][1:]]}, ANSWERED]))
    if kind == "tools_not_a_list":
        return str(_chat_rows(data, [dict(ANSWERED, tools="get_weather"), ANSWERED]))
    if kind == "lone_surrogate":  # JSON's escape of half a pair: no text, which the tokenizer refused
        return str(_chat_rows(data, [ANSWERED, '{"messages": [{"role": "user", "content": "a\\ud800b"}, '
                                     '{"role": "assistant", "content": "two"}]}']))
    if kind == "named_pipe":  # a read would wait for a writer for ever
        (tmp_path / "data").mkdir()
        _chat_rows(tmp_path / "data" / "a.jsonl", [ANSWERED, ANSWERED])
        os.mkfifo(tmp_path / "data" / "b.jsonl")
        return str(tmp_path / "data")
    if kind == "row_too_large":
        monkeypatch.setattr(read_bounds, "READ_BYTES", 4096)
        long = {"messages": [{"role": "user", "content": "x" * 5000}, ANSWERED["messages"][1]]}
        return str(_chat_rows(data, [ANSWERED, long, ANSWERED, ANSWERED]))
    if kind == "array_file_too_large":
        monkeypatch.setattr(read_bounds, "READ_BYTES", 4096)
        (tmp_path / "chat.json").write_text(json.dumps([ANSWERED] * 100))
        return str(tmp_path / "chat.json")
    if kind == "parquet_group_too_large":
        import pyarrow as pa
        import pyarrow.parquet as pq

        monkeypatch.setattr(read_bounds, "READ_BYTES", 4096)
        rows = [{"messages": [{"role": "user", "content": f"question {i} " * 5}, ANSWERED["messages"][1]]}
                for i in range(400)]  # each its own text: a row group of 200 holds some 6 KB
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet", row_group_size=200)
        return str(tmp_path / "chat.parquet")
    if kind == "long_conversation_without_markers":  # each turn renders the conversation up to it
        monkeypatch.setattr(chat_masks, "PREFIX_MESSAGES", 1000)
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(3000)]
        return str(_chat_rows(data, [{"messages": turns}, ANSWERED]))
    raise ValueError(kind)


CHAT_DATA = {
    "no_targets": ('training.loss_on = "assistant": the 3 conversation(s) of a batch row ({0}/chat.jsonl:1, '
                   "{0}/chat.jsonl:2, {0}/chat.jsonl:3) hold no token to train on (no assistant turn, or every one "
                   "cut off or dropped as longer than training.seq_len + 1)\n  fix: give them assistant turns"),
    "content_number": ('training.dataset_path = "{0}/chat.jsonl": {0}/chat.jsonl:2: messages[0].content is 5 (a '
                       'number), not text (a string) or a list of content parts ([{{"type": "text", "text": ...}}])\n'
                       '  fix: write it as a string: "5"'),
    "content_object": ('{0}/chat.jsonl:2: messages[0].content is {{"a": 1}} (an object), not text (a string) or a '
                       'list of content parts ([{{"type": "text", "text": ...}}])\n  fix: write it as a string: '
                       '"{{\\"a\\": 1}}"'),
    "content_parts_written_whole": ("{0}/chat.jsonl:1: the chat template of {1} writes its messages[0].content (a "
                                    "list) into the text as its Python repr\n  fix: write messages[0].content as a "
                                    "string; or, for content parts"),
    "tools_not_a_list": ('{0}/chat.jsonl:1: its tools are "get_weather" (a string), not a list of JSON schemas\n'
                         "  fix: write them as"),
    "lone_surrogate": ("{0}/chat.jsonl:2: messages[0].content holds a lone surrogate (\\ud800 at character 1), which "
                       "is no text: it cannot be encoded as UTF-8, nor tokenized\n  fix: fix the row: a character "
                       "beyond U+FFFF is written in JSON as a pair of surrogates"),
    "named_pipe": ('training.dataset_path = "{0}/data": {0}/data/b.jsonl is a named pipe, not a regular file: it is '
                   "never read (a named pipe would wait for a writer, a device never end)\n  fix: remove it, or leave "
                   "it out with a glob or training.dataset_extensions"),
    "row_too_large": ('training.dataset_path = "{0}/chat.jsonl": {0}/chat.jsonl:2 holds 5,088 bytes, more than the '
                      "4,096 torchmoe reads of one row at once (the bound)\n  fix: split the conversation into "
                      "shorter ones, or remove it"),
    "array_file_too_large": ('training.dataset_path = "{0}/chat.json": {0}/chat.json holds 9,300 bytes, more than '
                             "the 4,096 torchmoe reads of one file at once (the bound)\n  fix: write its rows as "
                             ".jsonl, one a line, which is read a row at a time"),
    "parquet_group_too_large": ('training.dataset_path = "{0}/chat.parquet": {0}/chat.parquet row group 0 (rows 0 '
                                "to 199) holds ",  # pyarrow's own count of its uncompressed bytes
                                " bytes, more than the 4,096 torchmoe reads of one row at once (the bound)\n  fix: "
                                "write the file with smaller row groups (pyarrow.parquet.write_table(..., "
                                "row_group_size=N))"),
    "long_conversation_without_markers": (
        'training.loss_on = "assistant": {0}/chat.jsonl:1: finding the tokens of its 1500 assistant turns renders '
        "the conversation up to each turn, more than 1,000 messages in all for its 3000 (the bound): the chat "
        "template of {1} has no {{% generation %}} markers\n  fix: set training.loss_on = \"last\""),
}


@pytest.mark.parametrize("kind", list(CHAT_DATA))
def test_bad_chat_data_is_one_message_before_training(capsys, monkeypatch, tmp_path: Path, chat_tokenizer: Path,
                                                      kind: str) -> None:
    """Each is exit 2 naming the file, the row (and its field), the bound and the fix, before the
    first step (the data loader renders each row's conversations until one has a target)."""
    path = _chat_data(tmp_path, kind, monkeypatch)
    # A row of 1,024 tokens holds some 70 of the long conversation's turns: 2,500 messages rendered.
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(chat_tokenizer), "--training.dataset", "chat",
                        "--training.dataset_path", path, "--training.seq_len", "1024")
    expected = CHAT_DATA[kind] if isinstance(CHAT_DATA[kind], tuple) else (CHAT_DATA[kind],)
    _assert_one_error(status, err, *(text.format(tmp_path, chat_tokenizer) for text in expected))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


def test_a_long_conversation_is_rendered_only_as_far_as_a_row_holds(capsys, monkeypatch, tmp_path: Path,
                                                                    chat_tokenizer: Path) -> None:
    """The conversation the bound refuses above (3,000 messages, 1,500 turns, at most 1,000
    messages rendered for its prefixes) trains when cut to a row: only the turns that begin in
    its first seq_len + 1 tokens are looked for."""
    path = _chat_data(tmp_path, "long_conversation_without_markers", monkeypatch)
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(chat_tokenizer), "--training.dataset", "chat",
                        "--training.dataset_path", path, "--training.seq_len", "64")
    assert status == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def _template_folder(folder: Path, kind: str, monkeypatch) -> Path:
    """A tokenizer folder with a faulty chat template or special token of each class."""
    from tests.chat_fixtures import CHATML, CHATML_SPECIALS, tokenizer_folder
    from torchmoe.data import read_bounds
    from torchmoe.data.chat import template_sandbox

    config: dict = {}
    if kind == "nested_loops":  # 10^10 steps
        monkeypatch.setattr(template_sandbox, "STEPS", 10_000)
        template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML
    elif kind == "writes_200_mb":
        template = "{{ 'x' * 200000000 }}" + CHATML
    else:
        template = CHATML
    folder = tokenizer_folder(folder, template, CHATML_SPECIALS, eos="<|im_end|>")
    if kind == "list_without_default":
        config["chat_template"] = [{"name": "chatml", "template": CHATML}, {"name": "tool_use", "template": CHATML}]
    elif kind == "list_entry_without_a_name":
        config["chat_template"] = [{"template": CHATML}]
    elif kind == "template_a_number":
        config["chat_template"] = 5
    elif kind == "bos_without_content":
        config["bos_token"] = {"lstrip": False}
    elif kind == "eos_a_list":
        config["eos_token"] = ["<|im_end|>"]
    elif kind == "pad_not_in_vocabulary":
        config["pad_token"] = "<pad>"
    elif kind == "jinja_not_utf8":
        (folder / "chat_template.jinja").write_bytes(b"{{ '\xff' }}" + CHATML.encode())
    elif kind == "jinja_a_named_pipe":
        os.mkfifo(folder / "chat_template.jinja")
    elif kind == "jinja_too_large":
        monkeypatch.setattr(read_bounds, "TEMPLATE_BYTES", 1000)
        (folder / "chat_template.jinja").write_text(CHATML + " " * 1000)
    elif kind == "tokenizer_a_named_pipe":
        (folder / "tokenizer.json").unlink()
        os.mkfifo(folder / "tokenizer.json")
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {**json.loads((folder / "tokenizer_config.json").read_text()), **config}))
    return folder


# The message after 'model.tokenizer_path = "{0}": ' ({0} the folder, {1} the data file).
CHAT_TEMPLATES = {
    "nested_loops": ("{1}:1: its chat template stopped: it ran more than 30,000 steps (loop iterations and calls), "
                     "the bound for this conversation (10,000, and 10,000 more a message or tool): a loop that does "
                     "not end with the conversation\n  fix: fix the chat template"),
    "writes_200_mb": ("{1}:1: its chat template stopped: it builds a str of 200,000,000 characters or items, more "
                      "than the bound of 33,554,432\n  fix: fix the chat template"),
    "list_without_default": ("its chat templates are named ['chatml', 'tool_use'], and none is \"default\", the one "
                             'transformers renders a conversation with\n  fix: name the template to train with '
                             '"default"'),
    "list_entry_without_a_name": ("tokenizer_config.json's chat_template is [{{\"template\": "),
    "template_a_number": ("tokenizer_config.json's chat_template is 5 (a number), not a template (a string) or a "
                          'list of {{"name": str, "template": str}}'),
    "bos_without_content": ("{0}/tokenizer_config.json: bos_token is {{'lstrip': False}}, not a token string (or "
                            '{{"content": "<token>"}})\n  fix: write it as "bos_token": "<token>", or remove it'),
    "eos_a_list": ("{0}/tokenizer_config.json: eos_token is ['<|im_end|>'], not a token string"),
    "pad_not_in_vocabulary": ("its config names pad_token '<pad>', which tokenizer.json does not hold\n  fix: fix "
                              "pad_token in tokenizer_config.json / special_tokens_map.json"),
    "jinja_not_utf8": ("{0}/chat_template.jinja is not UTF-8 text (byte 4 is 0xFF: invalid start byte)\n  fix: "
                       "convert chat_template.jinja to UTF-8"),
    "jinja_a_named_pipe": ("{0}/chat_template.jinja is a named pipe, not a regular file"),
    "jinja_too_large": ("{0}/chat_template.jinja holds 1,"),
    "tokenizer_a_named_pipe": ("{0}/tokenizer.json is a named pipe, not a regular file"),
}


@pytest.mark.parametrize("kind", list(CHAT_TEMPLATES))
def test_a_bad_chat_template_or_special_token_is_one_message(capsys, monkeypatch, tmp_path: Path, kind: str) -> None:
    """One message naming the folder, the file (and the row the template stopped on), never a
    traceback and never a hang."""
    folder = _template_folder(tmp_path / "tok", kind, monkeypatch)
    data = _chat_rows(tmp_path / "chat.jsonl", [ANSWERED] * 4)
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(folder), "--training.dataset", "chat",
                        "--training.dataset_path", str(data))
    _assert_one_error(status, err, f'model.tokenizer_path = "{folder}": '
                      + CHAT_TEMPLATES[kind].format(folder, data))


def test_validation_batches_without_a_target_are_refused(capsys, tmp_path: Path, chat_tokenizer: Path) -> None:
    """Each row of the validation data has a target, but the one batch validated holds none (each
    row's first window is a conversation without an answer): no mean of no tokens (it was a loss of
    0, and eval's perplexity 1)."""
    lonely = {"messages": [{"role": "user", "content": "a question with no answer, long enough to fill a row"}]}
    val = _chat_rows(tmp_path / "val.jsonl", [lonely, ANSWERED, lonely, ANSWERED])
    train = _chat_rows(tmp_path / "chat.jsonl", [ANSWERED] * 4)
    status, err = _main(capsys, tmp_path, "--model.tokenizer_path", str(chat_tokenizer), "--training.dataset", "chat",
                        "--training.dataset_path", str(train), "--validation.enable", "true", "--validation.dataset",
                        "chat", "--validation.dataset_path", str(val), "--validation.seq_len", "32",
                        "--validation.local_batch_size", "2", "--validation.steps", "1", "--validation.freq", "1")
    _assert_one_error(status, err, f'validation.dataset_path = "{val}": its 1 batch(es) evaluated hold no target '
                      "token (chat conversations whose assistant turns are cut off or missing in the rows read), so "
                      "they have no mean loss\n  fix: evaluate more batches")


_TOML = "[training]\nsteps = 2\n"
_TO_UTF8 = "\n  fix: convert job.toml to UTF-8, e.g. iconv -f {} -t UTF-8 job.toml > job.toml.utf8, then replace it"
CONFIG_FILES = {
    "missing": (None, "No such file or directory"),
    "a_folder": ("folder", "Is a directory"),
    "not_utf8": (b"[training]\nsteps = 2\n\xff\xfe", "is not UTF-8 text (byte 21 is 0xFF: invalid start byte)"
                 + _TO_UTF8.format("latin1")),
    # Editors on Windows: UTF-8 with a byte order mark, UTF-16 / UTF-32 with or without one.
    "utf8_bom": (b"\xef\xbb\xbf" + _TOML.encode(), "starts with the UTF-8 byte order mark (BOM, bytes EF BB BF)\n"
                 "  fix: save job.toml as UTF-8 without a BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' job.toml"),
    "utf16_bom": (_TOML.encode("utf-16"), "is UTF-16LE text, not UTF-8: it starts with the UTF-16LE byte order mark "
                  "(BOM, bytes FF FE)" + _TO_UTF8.format("UTF-16")),
    "utf16be_bom": (_TOML.encode("utf-16-be").join([b"\xfe\xff", b""]), "is UTF-16BE text, not UTF-8: it starts "
                    "with the UTF-16BE byte order mark (BOM, bytes FE FF)" + _TO_UTF8.format("UTF-16")),
    "utf32_bom": (_TOML.encode("utf-32"), "is UTF-32LE text, not UTF-8: it starts with the UTF-32LE byte order mark "
                  "(BOM, bytes FF FE 00 00)" + _TO_UTF8.format("UTF-32")),
    "utf16_no_bom": (_TOML.encode("utf-16-le"), "is not UTF-8 text: byte 1 is NUL (UTF-16LE text without a byte "
                     "order mark?)" + _TO_UTF8.format("UTF-16LE")),
    "truncated": (b"[training]\nsteps = 2\n[optim", "TOML"),
    "json": (b'{"training": {"steps": 2}}', "TOML"),
    "another_model": (b'[model]\nname = "llama3"\nflavor = "8B"\n', 'model.name = "llama3"'),
}


@pytest.mark.parametrize("kind", list(CONFIG_FILES))
def test_bad_config_file_is_one_message(capsys, tmp_path: Path, kind: str) -> None:
    content, problem = CONFIG_FILES[kind]
    path = tmp_path / "job.toml"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    status = cli.main(["train", "--config", str(path), "--job.dump_folder", str(tmp_path / "run")])
    key = "" if kind == "another_model" else f'--config = "{path}": '  # a key in the file, not the file
    _assert_one_error(status, capsys.readouterr().err, key, problem)


# ---- inputs changed before a resume -----------------------------------------------------------------

_RESUME_FIX = (
    "  fix: resume with the dataset and tokenizer it was saved with; or, to go on training from it with these, set "
    'checkpoint.exclude_from_loading = ["dataloader"] (every batch row starts again at its first document); or start a '
    "new run in another job.dump_folder\n")
_TOKENIZED = ["def train(model): return model " * 4] * 4  # 125 bytes; far fewer BPE tokens
# Saved documents, the documents resumed with, flags of the resumed run, where the position lies.
CHANGES = {
    # Row 0 is 66 tokens (2 steps x 33) into document 0, which now holds 11.
    "shorter_documents": (["x" * 300] * 4, ["short text"] * 4, [], "(pass 0, document 0, token 66) is past the end "
                          "of that document"),
    # A document is one window (32 bytes + EOS): row 0 is at its sub-corpus' document 2, which now holds one.
    "fewer_documents": (["y" * 32] * 6, ["y" * 32] * 2, [], "(pass 0, document 2, token 0) is past the end of the "
                        "dataset"),
    "another_tokenizer": (_TOKENIZED, _TOKENIZED, ["--model.tokenizer_path", "{tokenizer}"],
                          "(pass 0, document 0, token 66) is past the end of that document"),
}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_inputs_changed_before_a_resume_are_one_whole_message(capsys, tmp_path: Path, tokenizer_json: Path,
                                                              kind: str) -> None:
    """The saved data position does not fit the dataset or the tokenizer any more: one message,
    whole, whose fix keeps the run's checkpoints (they are fine)."""
    saved, changed, flags, where = CHANGES[kind]
    data = tmp_path / "d.jsonl"
    _jsonl(data, saved)
    run = ["--training.dataset", "local", "--training.dataset_path", str(data), "--checkpoint.enable", "true"]
    status, err = _main(capsys, tmp_path, *run)
    assert status == 0, err
    _jsonl(data, changed)
    flags = [f.format(tokenizer=tokenizer_json) for f in flags]
    status, err = _main(capsys, tmp_path, *run, "--training.steps", "4", *flags)
    _assert_one_error(status, err, f'error: training.dataset_path = "{data}": the checkpoint\'s data position {where}: '
                      "the dataset or the tokenizer has changed since the checkpoint was saved\n" + _RESUME_FIX)
    assert "delete" not in err
    assert (tmp_path / "run" / "checkpoint" / "step-2" / ".complete").is_file()
    # The fix works: the weights and optimizer go on, the data starts again.
    status, err = _main(capsys, tmp_path, *run, "--training.steps", "3", *flags,
                        "--checkpoint.exclude_from_loading", "dataloader")
    assert status == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_hf_assets_path_must_be_a_folder(capsys, tmp_path: Path, tokenizer_json: Path) -> None:
    """torchtitan's folder of tokenizer, config and weights: a tokenizer.json file there is refused
    under its own key (it was read as the tokenizer), also when the tokenizer is given."""
    for flags in ([], ["--model.tokenizer_path", str(tokenizer_json)]):
        status, err = _main(capsys, tmp_path, "--model.hf_assets_path", str(tokenizer_json), *flags)
        _assert_one_error(status, err, f'error: model.hf_assets_path = "{tokenizer_json}": Not a directory '
                          f"({tokenizer_json} is a file)\n  fix: point it at a Hugging Face model folder (tokenizer.json; "
                          "config.json and *.safetensors for checkpoint.initial_load_in_hf)\n")


# ---- files the job writes ----------------------------------------------------------------------


def _dump_folder(tmp_path: Path, kind: str) -> Path:
    run = tmp_path / "run"
    if kind == "dump_folder_is_a_file":
        run.write_text("x")
    elif kind == "cannot_be_created":
        return Path("/proc/1/torchmoe-run")  # /proc refuses new entries, even to root
    elif kind == "config_toml_is_a_folder":
        (run / "config.toml").mkdir(parents=True)
    elif kind == "metrics_jsonl_is_a_folder":
        (run / "metrics.jsonl").mkdir(parents=True)
    elif kind == "lock_file_is_a_folder":
        (run / ".torchmoe.lock").mkdir(parents=True)
    elif kind == "run_info_is_a_folder":
        (run / "run_info.json").mkdir(parents=True)
    elif kind == "wandb_folder_is_a_file":
        run.mkdir()
        (run / "wandb").write_text("x")
    elif kind == "wandb_run_id_is_a_folder":
        (run / "wandb_run_id").mkdir(parents=True)
    elif kind == "checkpoint_folder_is_a_file":
        run.mkdir()
        (run / "checkpoint").write_text("x")
    elif kind == "step_n_is_a_file":
        (run / "checkpoint").mkdir(parents=True)
        (run / "checkpoint" / "step-2").write_text("x")
    return run


OUTPUTS = {
    "dump_folder_is_a_file": ("job.dump_folder", "is a file"),
    "cannot_be_created": ("job.dump_folder", "/proc/1: cannot create files in it"),
    "config_toml_is_a_folder": ("job.dump_folder", "config.toml: Is a directory"),
    "metrics_jsonl_is_a_folder": ("job.dump_folder", "metrics.jsonl: Is a directory"),
    "lock_file_is_a_folder": ("job.dump_folder", ".torchmoe.lock: Is a directory"),
    "run_info_is_a_folder": ("job.dump_folder", "run_info.json: Is a directory"),
    "wandb_folder_is_a_file": ("job.dump_folder", "wandb is a file"),
    "wandb_run_id_is_a_folder": ("job.dump_folder", "wandb_run_id: Is a directory"),
    "checkpoint_folder_is_a_file": ("checkpoint.folder", "checkpoint is a file"),
    "step_n_is_a_file": ("checkpoint.folder", 'step-2 is a file, where the run will save "step-2"'),
}


@pytest.mark.parametrize("kind", list(OUTPUTS))
def test_unwritable_outputs_are_refused_before_training(capsys, tmp_path: Path, monkeypatch, kind: str) -> None:
    key, problem = OUTPUTS[kind]
    dump = _dump_folder(tmp_path, kind)
    # W&B on, as its folder and run id are checked only then; disabled, so that a run this fails
    # to refuse would not reach for the network.
    monkeypatch.setenv("WANDB_MODE", "disabled")
    status, err = _main(capsys, tmp_path, "--checkpoint.enable", "true", "--metrics.enable_wandb", "true", dump=dump)
    _assert_one_error(status, err, f"{key} = ", problem)
    assert "step 1/" not in err  # refused at start: no step was trained (and lost)


def test_dry_run_into_a_file_is_refused(capsys, tmp_path: Path) -> None:
    (tmp_path / "run").write_text("x")
    status, err = _main(capsys, tmp_path, "--dry-run", "--world-size", "64")
    _assert_one_error(status, err, "job.dump_folder = ", "run is a file")


# ---- numbers, devices, launch ------------------------------------------------------------------


SETTINGS = {
    "seed_beyond_64_bits": (["--training.seed", str(2**64)], "training.seed", "does not fit in 64 bits"),
    "seq_len_beyond_positions": (["--training.seq_len", "100000000000"], "training.seq_len",
                                 "has 2048 positions"),
    "batch_beyond_memory": (["--training.local_batch_size", "100000000000"], "training.local_batch_size",
                            "needs an estimated"),
    "timeout_beyond_timedelta": (["--comm.init_timeout_seconds", str(10**14)], "comm.init_timeout_seconds",
                                 "<= 2147483647"),
    "flex_attention_on_cpu": (["--model.attn_backend", "flex"], "model.attn_backend",
                              "FlexAttention cannot train on CPU"),
    "float8_on_cpu": (["--float8.enable", "true"], "float8.enable", "compute capability 8.9"),
    "float8_experts_on_cpu": (["--float8.routed_experts", "true", "--float8.moe_fqns", "experts",
                               "--training.mixed_precision_param", "bfloat16"], "float8.routed_experts",
                              "compute capability 9.0"),
    "seed_checkpoint_without_checkpointing": (["--checkpoint.create_seed_checkpoint", "true"],
                                              "checkpoint.create_seed_checkpoint", "needs checkpoint.enable"),
}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_settings_that_would_fail_later_are_refused(capsys, tmp_path: Path, kind: str) -> None:
    flags, key, problem = SETTINGS[kind]
    status, err = _main(capsys, tmp_path, *flags)
    _assert_one_error(status, err, f"{key} = ", problem)


def test_batch_beyond_memory_names_the_largest_that_fits(capsys, tmp_path: Path) -> None:
    status, err = _main(capsys, tmp_path, "--training.local_batch_size", "1000000", "--job.device_memory_gib", "4")
    _assert_one_error(status, err, "more than the 4.0 GiB it has (job.device_memory_gib)")
    fits = int(err.split("use local_batch_size <= ")[1].split(";")[0])
    assert fits > 2
    # The bound is the planner's: it fits, one more sample does not.
    cfg = load_job_config([*TINY, "--job.device_memory_gib", "4"])
    args = model_args_from_config(cfg.model)
    degrees = resolve_degrees(cfg.parallelism, 1)
    check_memory_fits(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, local_batch_size=fits)),
                      args, degrees, torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs an estimated"):
        check_memory_fits(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                                local_batch_size=fits + 1)),
                          args, degrees, torch.device("cpu"))


def test_a_rank_beyond_memory_is_blamed_on_the_rank_not_the_batch(capsys, tmp_path: Path) -> None:
    """A LoRA rank of 100000 (its adapters: weights, gradients, Adam state) was blamed on
    training.local_batch_size, whose fix (a smaller batch) could not fit it. The largest rank named
    fits, one more does not; with nothing that fits at 1 the model's state is named."""
    lora = ["--model.name", "qwen3", "--lora.enable", "true", "--lora.export", "merged", "--job.device_memory_gib", "2"]
    status, err = _main(capsys, tmp_path, *lora, "--lora.rank", "100000", "--lora.alpha", "100000")
    _assert_one_error(status, err, "lora.rank = 100000: the fullest rank needs an estimated",
                      "more than the 2.0 GiB it has (job.device_memory_gib); the adapters (weights, gradients, "
                      "optimizer state and activations) take")
    fits = int(err.split("use lora.rank <= ")[1].split(",")[0])
    cfg = load_job_config([*TINY, *lora])
    args = model_args_from_config(cfg.model)
    degrees = resolve_degrees(cfg.parallelism, 1)
    at = lambda rank: dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=rank))  # noqa: E731
    check_memory_fits(at(fits), args, degrees, torch.device("cpu"))
    with pytest.raises(ConfigError, match="^lora.rank"):
        check_memory_fits(at(fits + 1), args, degrees, torch.device("cpu"))
    status, err = _main(capsys, tmp_path, "--job.device_memory_gib", "0.001")
    _assert_one_error(status, err, 'model.flavor = "tiny": the fullest rank needs an estimated',
                      "it does not fit even at training.local_batch_size 1", "shard the model over more ranks")


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_missing_metrics_package_is_refused(capsys, tmp_path: Path, monkeypatch, package: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    status, err = _main(capsys, tmp_path, f"--metrics.enable_{package}", "true")
    _assert_one_error(status, err, f"metrics.enable_{package} = true", f"{package} package is not installed",
                      f"pip install 'torchmoe[{package}]'")


def test_world_size_without_torchrun_is_refused(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    status, err = _main(capsys, tmp_path, "--parallelism.data_parallel_shard_degree", "2")
    _assert_one_error(status, err, "WORLD_SIZE = 2", "not by torchrun", "torchrun --nproc-per-node 2")


# ---- divergence and failed saves ---------------------------------------------------------------


OVERFLOW = ["--optimizer.lr", "1e300", "--optimizer.weight_decay", "0"]


@pytest.mark.parametrize("interval, flags, problem", [
    # Due to save after step 1: the check of the whole state before the save finds it.
    ("1", ["--model.load_balance_coeff", "1e300"], "state is not finite after step 1 (NaN or inf in "
     "model.layers.1.moe.expert_bias, model.layers.3.moe.expert_bias): stopping without saving; lower "
     "model.load_balance_coeff"),
    # Not due to save: the next step's check of the biases finds it, before anything could save it.
    ("2", ["--model.load_balance_coeff", "1e300"], "an MoE expert bias is not finite after step 1"),
    # foreach AdamW refuses the overflowing scalar before writing it (no weight decay: lr * weight_decay
    # >= 1 is refused before training)...
    ("1", [*OVERFLOW, "--optimizer.implementation", "foreach"], "the optimizer update overflows at step 1"),
    # ...fused AdamW (the default) writes NaN weights: the check of the state before the save finds them.
    ("1", OVERFLOW, "state is not finite after step 1 (NaN or inf in model.tok_embeddings.weight"),
    # ...and without checkpoints the last step's update reaches no save: the Hugging Face export checks it.
    ("0", [*OVERFLOW, "--training.steps", "1", "--checkpoint.last_save_in_hf", "true", *HF_EXPORT],
     "stopping without writing Hugging Face weights; lower optimizer.lr"),
], ids=["expert_bias_at_save", "expert_bias_next_step", "optimizer_overflow_foreach", "optimizer_overflow_fused",
        "export_after_the_last_step"])
def test_non_finite_state_stops_with_exit_1_and_saves_nothing(capsys, tmp_path: Path, interval, flags,
                                                              problem) -> None:
    checkpoints = ["--checkpoint.enable", "true", "--checkpoint.interval", interval] if interval != "0" else []
    status, err = _main(capsys, tmp_path, *checkpoints, *flags)
    _assert_one_error(status, err, problem, "stopping without", code=1)
    assert not list((tmp_path / "run" / "checkpoint").glob("step-*")), "poisoned weights were saved"


def test_a_save_failing_mid_run_keeps_training(capsys, tmp_path: Path, monkeypatch) -> None:
    """Step 2's save fails (disk full): the run reports it, trains on, and saves step 4; a last
    save that fails ends the run with exit 2, naming the checkpoint to resume from."""
    real_save = dcp.save
    failing = {2, 6}

    def save(state, storage_writer, **kwargs):
        if any(f"step-{s}.tmp-" in str(storage_writer.path) for s in failing):
            raise OSError(28, "No space left on device")
        return real_save(state, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    args = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "4"]
    status, err = _main(capsys, tmp_path, *args)
    assert status == 0, err
    assert "checkpoint step-2 could not be saved" in err and "No space left on device" in err
    assert "training goes on" in err and "no checkpoint is on disk" in err
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4"]  # the failed save left nothing behind
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]

    status, err = _main(capsys, tmp_path, *args[:-1], "6")  # resumes at 5; its last save (6) fails
    _assert_one_error(status, err, 'checkpoint.folder = "', "checkpoint step-6 could not be saved",
                      f"the newest checkpoint on disk is {folder / 'step-4'}", "run again to resume")
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4"]


def test_errors_from_outside_are_the_same(tmp_path: Path) -> None:
    """The real command: exit 2, one message, no traceback (here: a dataset with no text)."""
    (tmp_path / "a.txt").write_text("   ")  # rows of 3 bytes: row 0 reads a.txt alone
    (tmp_path / "b.txt").write_text(" \n ")
    proc = run_train([*TINY, "--training.dataset", "local", "--training.dataset_path", str(tmp_path / "*.txt")],
                     dump_folder=tmp_path / "run", timeout=120, expect=None)
    assert_user_error(proc, f"hold no text: {tmp_path / 'a.txt'} (empty or only whitespace)")


# ---- what a parser or the launcher's environment cannot take -------------------------------------

LAUNCH_ENV = {
    "world_size_not_a_number": ({"WORLD_SIZE": "abc"}, 'WORLD_SIZE = "abc": is not a whole number from 1 to 1048576'),
    "world_size_negative": ({"WORLD_SIZE": "-2"}, 'WORLD_SIZE = "-2": is not a whole number from 1 to 1048576'),
    "world_size_zero": ({"WORLD_SIZE": "0"}, 'WORLD_SIZE = "0": is not a whole number from 1 to 1048576'),
    # Past Python's digit limit: its ValueError traceback before; shown cut.
    "world_size_of_5001_digits": ({"WORLD_SIZE": "9" * 5001}, 'WORLD_SIZE = "99999999999999999999... (5,001 '
                                  'characters)": is not a whole number from 1 to 1048576'),
    "local_world_size_not_a_number": ({"LOCAL_WORLD_SIZE": "eight"}, 'LOCAL_WORLD_SIZE = "eight": is not a whole'),
    # Read first by the process group's start before: a ValueError traceback.
    "rank_not_a_number": ({"RANK": "abc", "WORLD_SIZE": "2"}, 'RANK = "abc": is not a whole number from 0 to 1048575'),
    "rank_negative": ({"RANK": "-1"}, 'RANK = "-1": is not a whole number from 0 to 1048575'),
}


@pytest.mark.parametrize("kind", list(LAUNCH_ENV))
def test_a_launcher_variable_set_by_hand_is_one_message(capsys, monkeypatch, tmp_path: Path, kind: str) -> None:
    """A launcher's variable exported by hand with a value no launcher sets: one message naming
    it (a ValueError traceback from wherever it was first read before)."""
    env, problem = LAUNCH_ENV[kind]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, err = _main(capsys, tmp_path)
    _assert_one_error(status, err, problem, f"fix: unset {next(iter(env))} to run in one process")


def test_a_rank_outside_its_world_is_one_message(capsys, monkeypatch, tmp_path: Path) -> None:
    """Every launcher variable there, but RANK 5 of 2 ranks: refused before the process group
    would wait for a world it is no rank of."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    status, err = _main(capsys, tmp_path)
    _assert_one_error(status, err, "RANK = 5: is not below WORLD_SIZE (2)", "fix: launch with torchrun")


PARSED = {
    # Python's TOML parser recurses per level: a RecursionError traceback before.
    "toml_nested_too_deeply": ("[training]\nsteps = " + "[" * 100_000 + "]" * 100_000 + "\n",
                               "malformed TOML: nested too deeply (more levels of [ or { than the parser can follow) "
                               "(at line 2)"),
    "toml_nested_tables_too_deeply": ("[training]\nsteps = " + "{a = " * 50_000 + "1" + "}" * 50_000 + "\n",
                                      "malformed TOML: nested too deeply"),
    # Python's digit limit (a ValueError traceback before); a hexadecimal one parses, but no message could show it.
    "toml_integer_too_long": ("[training]\nseed = 7\nsteps = " + "9" * 5001 + "\n",
                              "malformed TOML: a number of more than 4,300 digits, which no setting holds (at line 3)"),
    "toml_hex_integer_too_long": ("[training]\nsteps = 0x" + "f" * 5000 + "\n",
                                  "malformed TOML: a number of more than 4,300 digits, which no setting holds (at line "
                                  "2)"),
    # The OS refuses a NUL in a path, Python with a ValueError: a traceback before.
    "nul_in_a_path": ('[job]\ndump_folder = "out\\u0000x"\n',
                      'job.dump_folder = "out\\u0000x": holds a NUL byte (\\u0000), which no path'),
    "nul_in_a_list_of_paths": ('[training]\ndataset_mix = ["a.jsonl", "b\\u0000.jsonl"]\n',
                               'training.dataset_mix = ["a.jsonl", "b\\u0000.jsonl"]: holds a NUL byte'),
    "nul_in_a_name": ('[job]\ndescription = "a\\u0000b"\n', 'job.description = "a\\u0000b": holds a NUL byte'),
    # A path that prints like another: "runs/a" and "runs/a<U+200B>" are two folders (the run's
    # files seemed lost). Shown escaped.
    "zero_width_space_in_a_folder": ('[job]\ndump_folder = "runs/a\\u200b"\n', 'job.dump_folder = "runs/a\\u200B": '
                                     "holds an invisible character, U+200B (ZERO WIDTH SPACE), at position 6"),
    "direction_override_in_a_read_path": ('[model]\ntokenizer_path = "tok\\u202eenizer"\n',
                                          'model.tokenizer_path = "tok\\u202Eenizer": holds an invisible character, '
                                          "U+202E (RIGHT-TO-LEFT OVERRIDE), at position 3"),
    "tab_in_a_list_of_paths": ('[training]\ndataset_mix = ["a.jsonl", "b\\t.jsonl"]\n',
                               'training.dataset_mix = ["a.jsonl", "b\\t.jsonl"]: holds an invisible character, U+0009'),
}


def test_an_invisible_character_in_a_path_flag_is_one_message(capsys, tmp_path: Path) -> None:
    status = cli.main(["train", "--config", DEBUG_CONFIG, "--checkpoint.folder", "ckpt\u200d",
                       "--job.dump_folder", str(tmp_path / "run")])
    _assert_one_error(status, capsys.readouterr().err, '--checkpoint.folder = "ckpt\\u200D": holds an invisible '
                      "character, U+200D (ZERO WIDTH JOINER), at position 4", "fix: type the path again without it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", list(PARSED))
def test_a_config_no_parser_or_os_can_take_is_one_message(capsys, tmp_path: Path, kind: str) -> None:
    text, problem = PARSED[kind]
    (tmp_path / "job.toml").write_text(text)
    status = cli.main(["train", "--config", str(tmp_path / "job.toml"), "--job.dump_folder", str(tmp_path / "run")]
                      if "dump_folder" not in text else ["train", "--config", str(tmp_path / "job.toml")])
    _assert_one_error(status, capsys.readouterr().err, problem)
