"""Document sources: python_docs, local files (txt/jsonl/parquet, folders, globs), hub datasets.

    pytest tests/unit/test_dataset.py
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Training
from torchmoe.data import (
    FileDocuments,
    HFDocuments,
    InMemoryDocuments,
    build_documents,
)
from torchmoe.data import dataset as dataset_module
from torchmoe.data import file_listing, local_files, python_docs_files
from torchmoe.data.errors import DataConfigError
from torchmoe.data.file_index import line_spans


def _write_jsonl(path: Path, texts: list[str | None], field: str = "text") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({field: t, "id": i}) for i, t in enumerate(texts)]
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")  # a blank line is not a document


def _write_parquet(path: Path, texts: list[str | None], row_group_size: int = 2) -> None:
    pa = pytest.importorskip("pyarrow", reason="parquet needs pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    pq.write_table(table, path, row_group_size=row_group_size)


# python_docs -------------------------------------------------------------------------------


def test_python_docs_is_large_real_and_deterministic() -> None:
    files = python_docs_files()
    assert len(files) > 500
    assert sum(f.stat().st_size for f in files) > 10_000_000
    docs = build_documents(Training(dataset="python_docs"))
    first = list(itertools.islice(docs, 50))
    again = list(itertools.islice(build_documents(Training()), 50))
    assert first == again
    assert all(isinstance(d, str) for d in first)
    text = "".join(first)
    assert "def " in text and "import " in text and '"""' in text
    # Resuming at document k reads the same documents as a full pass.
    assert list(itertools.islice(docs.iter_from(20), 30)) == first[20:]


def test_python_docs_order_and_exclusions(tmp_path: Path) -> None:
    files = {
        "os.py": "", "zipfile.py": "", "json/__init__.py": "", "json/decoder.py": "",
        "test/test_os.py": "", "idlelib/idle_test/test_x.py": "", "idlelib/editor.py": "",
        "site-packages/pkg/mod.py": "", "__pycache__/os.py": "",
        "_sysconfigdata__linux.py": "", "config-3.11-x86_64/python-config.py": "",
        "README.txt": "", "lib-dynload/x.so": "",
    }  # fmt: skip
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    got = [p.relative_to(tmp_path).as_posix() for p in python_docs_files(tmp_path)]
    # Modules sorted by relative path, then the test suite.
    assert got == [
        "idlelib/editor.py", "json/__init__.py", "json/decoder.py", "os.py", "zipfile.py",
        "idlelib/idle_test/test_x.py", "test/test_os.py",
    ]  # fmt: skip
    # The test suite's encoding samples (a BOM, Latin-1) are left out: the reader refuses them.
    (tmp_path / "test" / "bad_coding2.py").write_bytes(b"\xef\xbb\xbfx = 1\n")
    (tmp_path / "test" / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\nx = '\xe9'\n")
    assert [p.relative_to(tmp_path).as_posix() for p in python_docs_files(tmp_path)] == got


# local -------------------------------------------------------------------------------------


def test_local_txt_folder_one_document_per_file(tmp_path: Path) -> None:
    for name, text in {"b.txt": "second", "a.txt": "first", "sub/c.txt": "third", "notes.md": "fourth"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    docs = build_documents(Training(dataset="local", dataset_path=str(tmp_path)))
    assert list(docs) == ["first", "second", "fourth", "third"]  # a, b, notes.md, sub/c
    # Text that is not UTF-8 (latin-1 here) is refused with its file and byte, not trained on
    # as replacement characters.
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"bad\.txt is not UTF-8 text \(byte 3 is 0xE9: unexpected end of data\)"):
        list(build_documents(Training(dataset="local", dataset_path=str(tmp_path))))


def test_local_jsonl_with_custom_field(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", ["one", "two", None, "four"], field="content")
    cfg = Training(dataset="local", dataset_path=str(tmp_path / "d.jsonl"), dataset_text_field="content")
    assert list(build_documents(cfg)) == ["one", "two", "", "four"]
    cfg.dataset_text_field = "text"
    with pytest.raises(ValueError, match=r'dataset_text_field = "text": .*d\.jsonl:1 has no such field'):
        list(build_documents(cfg))


def test_local_parquet(tmp_path: Path) -> None:
    texts = [f"row {i}" for i in range(7)]
    _write_parquet(tmp_path / "d.parquet", texts)
    docs = build_documents(Training(dataset="local", dataset_path=str(tmp_path / "d.parquet")))
    assert list(docs) == texts
    for k in range(9):  # across row-group boundaries and past the end
        assert list(docs.iter_from(k)) == texts[k:]
    bad = Training(dataset="local", dataset_path=str(tmp_path), dataset_text_field="body")
    with pytest.raises(ValueError, match=r'dataset_text_field = "body": .*d\.parquet has no such column'):
        list(build_documents(bad))


def test_local_mixed_folder_iter_from_matches_full_pass(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    _write_jsonl(tmp_path / "b.jsonl", ["b0", "b1", "b2"])
    _write_parquet(tmp_path / "c.parquet", ["c0", None, "c2", "c3", "c4"])
    (tmp_path / "d.txt").write_text("delta")
    docs = FileDocuments(local_files(str(tmp_path)))
    full = list(docs)
    assert full == ["alpha", "b0", "b1", "b2", "c0", "", "c2", "c3", "c4", "delta"]
    for k in range(len(full) + 2):
        assert list(docs.iter_from(k)) == full[k:]


def _mixed_folder(tmp_path: Path) -> list[str]:
    """txt, jsonl (with a blank line) and parquet files (row groups of 2); returns all documents."""
    (tmp_path / "a.txt").write_text("alpha")
    _write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(7)])
    _write_parquet(tmp_path / "c.parquet", [f"c{i}" for i in range(7)])
    for i in range(3):
        (tmp_path / f"d{i}.txt").write_text(f"delta{i}")
    return ["alpha", *(f"b{i}" for i in range(7)), *(f"c{i}" for i in range(7)), "delta0", "delta1", "delta2"]


def _units(row) -> list[str]:
    return [unit.content for unit in row]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 20])
def test_rows_are_contiguous_ranges_and_iter_from_seeks_in_them(tmp_path: Path, count: int) -> None:
    full = _mixed_folder(tmp_path)
    for docs in (FileDocuments(local_files(str(tmp_path))), InMemoryDocuments(full)):
        name = type(docs).__name__
        sizes = docs.sizes().tolist()  # a .jsonl document measures its line, the others their text
        total = sum(sizes)
        rows = [docs.split(j, count) for j in range(count)]
        assert all(len(row) for row in rows), name  # every row gets text
        for row in rows:
            for k in range(len(row) + 2):
                assert list(row.iter_from(k)) == list(row)[k:], name
        # In order, the rows hold every document once, whole or in consecutive parts.
        units = [u for row in rows for u in row]
        texts, text, inside = [], "", False
        for u in units:
            assert u.starts == (not inside), name  # BOS before a document's first unit only
            text += u.content
            inside = not u.ends
            if u.ends:
                texts.append(text)
                text = ""
        assert texts == full and text == "", name
        if max(sizes) * count <= total:  # no document larger than a row's share: all whole,
            for j, row in enumerate(rows):  # row j holds those starting in bytes [j T / G, (j + 1) T / G)
                want = [t for d, t in enumerate(full) if sum(sizes[:d]) * count // total == j]
                assert _units(row) == want and all(u.starts and u.ends for u in row), (name, j)
    with pytest.raises(ValueError, match=r"sub-corpus 3 is not in \[0, count=3\)"):
        InMemoryDocuments(full).split(3, 3)


def test_a_row_parses_and_opens_only_its_documents(tmp_path: Path, monkeypatch) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="parquet needs pyarrow")
    _mixed_folder(tmp_path)
    docs = FileDocuments(local_files(str(tmp_path)))
    # alpha 5 bytes, b0-b6 23 (their .jsonl lines), c0-c6 2, delta0-2 6: 198 bytes, rows of 39.6.
    assert docs.sizes().tolist() == [5] + [23] * 7 + [2] * 7 + [6] * 3  # indexes the files first
    parsed: list[bytes] = []
    opened: list[str] = []
    groups: list[int] = []
    real_loads, real_read_bytes, real_group = json.loads, Path.read_bytes, pq.ParquetFile.read_row_group
    monkeypatch.setattr(dataset_module.json, "loads", lambda line, **kw: parsed.append(line) or real_loads(line, **kw))
    monkeypatch.setattr(Path, "read_bytes", lambda self: opened.append(self.name) or real_read_bytes(self))
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: groups.append(i) or real_group(self, i, **kw))  # fmt: skip
    # Row 3 holds the documents starting in bytes 119-158: b5 (120) and b6 (143).
    assert _units(docs.split(3, 5).iter_from(1)) == ["b6"]
    assert [real_loads(line)["text"] for line in parsed] == ["b6"]  # b5's line: skipped by a seek, not parsed
    assert opened == [] and groups == []
    # Row 4 holds c0-c6 (166-178) and delta0-2 (180-192); from its unit 8 on: delta1, delta2.
    row = docs.split(4, 5)
    assert _units(row.iter_from(8)) == ["delta1", "delta2"]
    assert opened == ["d1.txt", "d2.txt"] and groups == []  # a.txt, d0.txt and the parquet row groups unread
    assert row.locate(0) == f"{tmp_path / 'c.parquet'} row 0"
    assert docs.split(3, 5).locate(1) == f"{tmp_path / 'b.jsonl'}:8"  # line 2 is blank


def _play(lines: int) -> str:
    return "".join(f"{i}: Now is the winter of our discontent {'x' * (i % 37)}\n" for i in range(lines))


@pytest.mark.parametrize("rows", [8, 64, 1024])
def test_one_text_file_fills_any_number_of_rows(tmp_path: Path, rows: int) -> None:
    """One 1 MB .txt file (one document) is cut into G parts after newlines, one or two per row."""
    text = _play(17_000)
    assert 1_000_000 < len(text) < 1_100_000
    (tmp_path / "play.txt").write_text(text)
    docs = FileDocuments(local_files(str(tmp_path / "play.txt")))
    units = [list(docs.split(j, rows)) for j in range(rows)]
    assert all(units)  # every row gets a part
    parts = [u for row in units for u in row]
    assert "".join(u.content for u in parts) == text  # the parts, in order, are the file
    assert [u.starts for u in parts] == [True] + [False] * (len(parts) - 1)  # BOS once, EOS once
    assert [u.ends for u in parts] == [False] * (len(parts) - 1) + [True]
    assert all(u.content.endswith("\n") for u in parts)  # cut after newlines
    share = len(text) / rows
    longest = max(len(line) + 1 for line in text.splitlines())
    assert max(len(u.content) for u in parts) <= share + longest


def test_a_part_of_a_text_file_reads_only_its_bytes(tmp_path: Path, monkeypatch) -> None:
    text = _play(17_000)
    (tmp_path / "play.txt").write_text(text)
    docs = FileDocuments(local_files(str(tmp_path / "play.txt")))
    row = docs.split(700, 1024)
    read: list[int] = []
    real_open = Path.open

    class Counting:
        def __init__(self, f) -> None:
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def seek(self, offset: int) -> int:
            return self.f.seek(offset)

        def read(self, n: int = -1) -> bytes:
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(Path, "open", lambda self, mode="r": Counting(real_open(self, mode)))
    [part] = list(row)
    assert part.content and not part.starts and not part.ends
    assert sum(read) <= 3 * len(text) / 1024  # its part and the searches for its two newlines, not the file


def test_a_corpus_too_small_for_the_rows_is_one_message(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("abc")
    docs = FileDocuments(local_files(str(tmp_path / "t.txt")), value=str(tmp_path / "t.txt"))
    with pytest.raises(ConfigError, match=r"global_batch_size = 8: the corpus \(training.dataset_path = .*t\.txt\) "
                                          r"holds 3 bytes, too few to give each of 8 batch rows"):
        [docs.split(j, 8) for j in range(8)]
    (tmp_path / "t.txt").write_text("")
    with pytest.raises(ConfigError, match=r"holds 1 document\(s\), all empty"):
        FileDocuments(local_files(str(tmp_path / "t.txt"))).split(0, 1)


def test_jsonl_line_index_is_built_once_and_cached(tmp_path: Path, monkeypatch) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [f"doc {i}" for i in range(50)])
    cache = tmp_path / "run" / "data_index"
    first = FileDocuments([tmp_path / "d.jsonl"], index_cache=cache)
    assert list(first) == [f"doc {i}" for i in range(50)]
    assert len(list(cache.glob("*.npy"))) == 1
    monkeypatch.setattr(dataset_module, "line_spans", lambda file: pytest.fail("indexed again"))
    again = FileDocuments([tmp_path / "d.jsonl"], index_cache=cache)
    assert list(again.iter_from(48)) == ["doc 48", "doc 49"]  # from the cache
    monkeypatch.undo()
    _write_jsonl(tmp_path / "d.jsonl", [f"new {i}" for i in range(3)])  # an edited file: a new index
    assert list(FileDocuments([tmp_path / "d.jsonl"], index_cache=cache)) == ["new 0", "new 1", "new 2"]
    for path in cache.glob("*.npy"):  # a cache file cut short is built again
        path.write_bytes(path.read_bytes()[:20])
    assert list(FileDocuments([tmp_path / "d.jsonl"], index_cache=cache).iter_from(2)) == ["new 2"]


def test_local_glob(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "x" / "1.jsonl", ["one"])
    _write_jsonl(tmp_path / "y" / "2.jsonl", ["two"])
    (tmp_path / "x" / "3.txt").write_text("three")
    assert [p.name for p in local_files(str(tmp_path / "*" / "*.jsonl"))] == ["1.jsonl", "2.jsonl"]
    assert [p.name for p in local_files(str(tmp_path / "**" / "*"))] == ["1.jsonl", "3.txt", "2.jsonl"]


def test_a_glob_through_symbolic_links_lists_each_file_once(tmp_path: Path) -> None:
    """A link back up the tree is a loop: glob's own ``**`` went round it until the path was too
    long (the file 41 times; with two such links it never ended). Each folder is gone through
    once, and a file reached by two paths (a link to it, a linked folder) is listed once, by its
    first path; a link to a folder outside is still followed, as glob follows it."""
    _write_jsonl(tmp_path / "data" / "a.jsonl", ["one"])
    _write_jsonl(tmp_path / "data" / "sub" / "b.jsonl", ["two"])
    _write_jsonl(tmp_path / "elsewhere" / "c.jsonl", ["three"])
    (tmp_path / "data" / "sub" / "up").symlink_to("..")  # a loop
    (tmp_path / "data" / "alias.jsonl").symlink_to("a.jsonl")
    (tmp_path / "data" / "more").symlink_to(tmp_path / "elsewhere")
    globbed = file_listing._glob(str(tmp_path / "data" / "**" / "*.jsonl"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in globbed) == [
        "data/a.jsonl", "data/alias.jsonl", "data/more/c.jsonl", "data/sub/b.jsonl"]  # each folder once
    found = local_files(str(tmp_path / "data" / "**" / "*.jsonl"))
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["data/a.jsonl", "data/more/c.jsonl",
                                                                   "data/sub/b.jsonl"]
    # The folder itself: links to folders are not followed (as before), a link to a file is one file.
    assert [p.relative_to(tmp_path).as_posix() for p in local_files(str(tmp_path / "data"))] == \
        ["data/a.jsonl", "data/sub/b.jsonl"]


@pytest.mark.parametrize("how", ["file", "folder", "glob"])
@pytest.mark.parametrize("kind", ["named pipe", "socket"])
def test_a_named_pipe_or_socket_among_the_data_is_refused_unopened(tmp_path: Path, how: str, kind: str) -> None:
    """Opened to read, a named pipe waits for a writer for ever (a `b.jsonl` FIFO hung a run)."""
    import os
    import socket

    _write_jsonl(tmp_path / "a.jsonl", ["one"])
    special = tmp_path / "b.jsonl"
    if kind == "named pipe":
        os.mkfifo(special)
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(special))
    path = {"file": special, "folder": tmp_path, "glob": tmp_path / "*.jsonl"}[how]
    with pytest.raises(DataConfigError) as err:
        local_files(str(path))
    assert str(err.value) == (f'training.dataset_path = "{path}": {special} is a {kind}, not a regular file: it is '
                              "never read (a named pipe would wait for a writer, a device never end)\n  fix: remove "
                              "it, or leave it out with a glob or training.dataset_extensions")
    assert local_files(str(tmp_path / "a.*")) == [tmp_path / "a.jsonl"]  # left out: never looked at


def test_a_lone_surrogate_in_a_text_row_is_named(tmp_path: Path) -> None:
    """JSON's escape of half a surrogate pair parses, and the tokenizer refused it with a traceback."""
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": "a\\udc00b"}\n')
    docs = build_documents(Training(dataset="local", dataset_path=str(tmp_path / "d.jsonl")))
    assert docs.read(0) == "fine"
    with pytest.raises(DataConfigError) as err:
        docs.read(1)
    assert str(err.value) == (
        f'training.dataset_path = "{tmp_path / "d.jsonl"}": {tmp_path / "d.jsonl"}:2: its text holds a lone '
        "surrogate (\\udc00 at character 1), which is no text: it cannot be encoded as UTF-8, nor tokenized\n  fix: "
        "fix the row: a character beyond U+FFFF is written in JSON as a pair of surrogates (\\ud83d\\ude00), or as "
        "itself")


def test_rows_and_files_read_whole_are_bounded(tmp_path: Path, monkeypatch) -> None:
    """A .jsonl line and a .json array file are read whole (then decoded and parsed, several times
    their size in memory): beyond the bound each is one message naming it, the bound and the fix."""
    from torchmoe.data import read_bounds

    monkeypatch.setattr(read_bounds, "READ_BYTES", 100)
    _write_jsonl(tmp_path / "d.jsonl", ["short", "x" * 200])
    docs = build_documents(Training(dataset="local", dataset_path=str(tmp_path / "d.jsonl")))
    assert docs.read(0) == "short"
    with pytest.raises(DataConfigError, match=r'd.jsonl:3 holds 221 bytes, more than the 100 torchmoe reads of one '
                                              r'row at once \(the bound\)\n  fix: split the document into several '
                                              r'rows \(or a .txt file, read in parts\), or remove it'):
        docs.read(1)
    (tmp_path / "a.json").write_text(json.dumps([{"text": "x" * 60}, {"text": "y" * 60}]))
    with pytest.raises(DataConfigError, match=r"a.json holds 148 bytes, more than the 100 torchmoe reads of one "
                                              r"file at once \(the bound\)\n  fix: write its rows as .jsonl"):
        build_documents(Training(dataset="local", dataset_path=str(tmp_path / "a.json"))).read(0)


def test_local_no_match_error_names_path_and_fix(tmp_path: Path) -> None:
    pattern = str(tmp_path / "*.jsonl")
    with pytest.raises(ValueError) as err:
        build_documents(Training(dataset="local", dataset_path=pattern))
    # A ConfigError too: the CLI prints it as one message and exits with status 2.
    assert isinstance(err.value, ConfigError)
    assert pattern in str(err.value) and "this glob matches no corpus files" in str(err.value)
    assert "fix: point it at" in str(err.value) and "glob" in str(err.value)
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(ValueError, match=r"folder holds no corpus files \(1 not text, e\.g\. .*logo\.png\)"):
        local_files(str(tmp_path))
    with pytest.raises(ValueError, match=r"is not a text file \(a NUL byte"):
        local_files(str(tmp_path / "logo.png"))
    with pytest.raises(ValueError, match='dataset = "local" needs files'):
        local_files("")


def test_any_text_file_is_a_document_and_binary_files_are_passed_over(tmp_path: Path) -> None:
    # A source tree: code and docs of any suffix (or none) are text; compiled files, images and
    # hidden folders (.git) are not read.
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    (tmp_path / "pkg" / "main.py").write_text("def main():\n    return 1\n")
    (tmp_path / "pkg" / "README.md").write_text("# pkg\n")
    (tmp_path / "Makefile").write_text("all:\n\techo ok\n")
    (tmp_path / "pkg" / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0")
    (tmp_path / "pkg" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (tmp_path / "pkg" / "latin1.c").write_bytes("/* caf\xe9 */".encode("latin-1"))  # not UTF-8: not text
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    # A multi-byte character cut by the 8 KiB sniff is still text.
    (tmp_path / "pkg" / "long.rs").write_text("a" * 8191 + "é" + "b")
    names = [p.relative_to(tmp_path).as_posix() for p in local_files(str(tmp_path))]
    assert names == ["Makefile", "pkg/README.md", "pkg/long.rs", "pkg/main.py"]
    assert [p.name for p in local_files(str(tmp_path / "**" / "*.py"))] == ["main.py"]
    assert local_files(str(tmp_path / "Makefile")) == [tmp_path / "Makefile"]
    docs = FileDocuments(local_files(str(tmp_path / "pkg")))
    assert list(docs.iter_from(0)) == ["# pkg\n", "a" * 8191 + "é" + "b", "def main():\n    return 1\n"]
    # training.dataset_extensions: several extensions at once (which one glob cannot), any case,
    # in folders, globs, validation and mixture sources alike (build_documents passes it on).
    pick = lambda path, *exts: [p.relative_to(tmp_path).as_posix()  # noqa: E731
                                for p in local_files(str(path), extensions=exts)]
    assert pick(tmp_path, ".py", ".MD") == ["pkg/README.md", "pkg/main.py"]
    assert pick(tmp_path / "pkg" / "*", ".rs") == ["pkg/long.rs"]
    assert pick(tmp_path / "Makefile", ".py") == ["Makefile"]  # named alone: read whatever its extension
    training = Training(dataset="local", dataset_path=str(tmp_path), dataset_extensions=[".py"])
    assert list(build_documents(training).iter_from(0)) == ["def main():\n    return 1\n"]
    with pytest.raises(ValueError) as err:
        local_files(str(tmp_path), key="validation.dataset_path", extensions=[".go"])
    assert str(err.value).startswith(
        f'validation.dataset_path = "{tmp_path}": this folder holds 7 files of other extensions '
        '(training.dataset_extensions = [".go"]) and no corpus files\n')
    assert "fix: name the corpus's extensions in training.dataset_extensions (empty: every text file)" in str(err.value)


def test_unknown_dataset_kind() -> None:
    with pytest.raises(ValueError, match=r'training.dataset = "c5": unknown dataset\n.*python_docs'):
        build_documents(Training(dataset="c5"))


# hf ----------------------------------------------------------------------------------------


def test_hf_spec_parsing(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="dataset='hf' needs the 'datasets' package")
    docs = HFDocuments.from_spec("allenai/c4:en", split="validation", text_field="body")
    assert (docs.name, docs.config, docs.split_name, docs.text_field) == ("allenai/c4", "en", "validation", "body")
    assert HFDocuments.from_spec("roneneldan/TinyStories").config is None
    odd = tmp_path / "a:b"
    odd.mkdir()
    assert HFDocuments.from_spec(str(odd)).name == str(odd)
    with pytest.raises(ValueError, match='dataset = "hf" needs a hub dataset'):
        HFDocuments.from_spec("")


def test_hf_streams_a_local_dataset(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="dataset='hf' needs the 'datasets' package")
    texts = [f"document number {i}" for i in range(6)]
    _write_jsonl(tmp_path / "data" / "train.jsonl", texts)
    docs = build_documents(Training(dataset="hf", dataset_path=str(tmp_path / "data")))
    assert isinstance(docs, HFDocuments)
    assert list(docs) == texts
    assert list(docs.iter_from(4)) == texts[4:]
    docs.text_field = "content"
    with pytest.raises(ValueError, match=r'dataset_text_field = "content": row 0 .* has no such field'):
        next(iter(docs))


@pytest.mark.parametrize("n_files", [4, 3])
def test_hf_split_is_split_dataset_by_node(tmp_path: Path, n_files: int) -> None:
    """4 files for 2 sub-corpora: each reads whole files (shards j, j + 2); 3 files: datasets keeps
    one row in 2 of the whole stream, like the strided view."""
    pytest.importorskip("datasets", reason="dataset='hf' needs the 'datasets' package")
    files = [[f"f{f}d{i}" for i in range(5)] for f in range(n_files)]
    for f, texts in enumerate(files):
        path = tmp_path / "data" / f"part{f}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    docs = build_documents(Training(dataset="hf", dataset_path=str(tmp_path / "data")))
    full = [t for texts in files for t in texts]
    assert list(docs) == full
    parts = [docs.split(j, 2) for j in range(2)]
    for j, part in enumerate(parts):
        want = files[j] + files[j + 2] if n_files == 4 else full[j::2]
        assert "split_dataset_by_node(rank=" in repr(part)
        for k in (0, 1, 3, 6, 12):
            assert list(part.iter_from(k)) == want[k:], (j, k)
    assert docs.split(0, 1) is docs


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    from torchmoe.data.dataset import DataConfigError, FileDocuments

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataConfigError, match=r"d\.jsonl:2 is not JSON"):
        list(FileDocuments([path]).iter_from(0))


def test_json_files_hold_an_array_or_one_object_per_line(tmp_path: Path) -> None:
    """torchtitan's c4_test corpus is a .json file; `datasets` reads both layouts, so do we."""
    (tmp_path / "a.json").write_text(json.dumps([{"text": f"array {i}"} for i in range(5)]))
    (tmp_path / "b.json").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3)))
    docs = FileDocuments(local_files(str(tmp_path)))
    assert list(docs.iter_from(0)) == [*(f"array {i}" for i in range(5)), "line 0", "line 1", "line 2"]
    # 5 array rows of 7 bytes (their text), 3 lines of 18: rows of 29.7 bytes, row 1 holds bytes 30-59.
    assert _units(docs.split(1, 3)) == ["line 0", "line 1"]
    (tmp_path / "a.json").write_text('[{"text": "x"}, {"txt": "y"}]')
    with pytest.raises(ConfigError, match=r"a.json\[1\] has no such field \(found \['txt'\]\)"):
        list(FileDocuments(local_files(str(tmp_path))).iter_from(0))
    (tmp_path / "a.json").write_text('[{"text": "x"},')
    with pytest.raises(ConfigError, match=r"a.json\": is not JSON"):
        list(FileDocuments(local_files(str(tmp_path))).iter_from(0))


def test_torchtitan_dataset_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """c4 / c4_validation stream allenai/c4 "en" (dataset_path replaces the hub id), c4_test reads
    ./tests/assets/c4_test of a torchtitan checkout."""
    monkeypatch.chdir(tmp_path)
    for name, split in (("c4", "train"), ("c4_validation", "validation")):
        docs = build_documents(Training(dataset=name))
        assert (docs.name, docs.config, docs.split_name) == ("allenai/c4", "en", split)
        assert build_documents(Training(dataset=name, dataset_path="/mirror/c4")).name == "/mirror/c4"
    with pytest.raises(ConfigError, match=r'training.dataset = "c4_test": reads torchtitan\'s test corpus from '
                                          r"tests/assets/c4_test .*\n  fix: run from a torchtitan checkout"):
        build_documents(Training(dataset="c4_test"))
    corpus = tmp_path / "tests" / "assets" / "c4_test"
    corpus.mkdir(parents=True)
    (corpus / "data.json").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(4)))
    assert list(build_documents(Training(dataset="c4_test")).iter_from(2)) == ["doc 2", "doc 3"]


@pytest.mark.parametrize("chunk", [3, 7, 1 << 24])
def test_line_index_finds_every_non_blank_line(tmp_path: Path, monkeypatch, chunk: int) -> None:
    """Lines that straddle the reader's chunks, blank and whitespace-only lines, no last newline."""
    from torchmoe.data import file_index

    monkeypatch.setattr(file_index, "_CHUNK", chunk)
    for data in (b"", b"\n", b"a\n\n  \nbb\n \tx\n\t\n", b"abc", b"line one\n   \n  two\nlast", b"\n\n\nx", b" y\r\n"):
        (tmp_path / "f.jsonl").write_bytes(data)
        want, offset, start = [], 0, 0
        for number, line in enumerate(data.split(b"\n"), start=1):
            if line.strip():
                want.append([offset, len(line), number, start])  # start: the lengths before it
                start += len(line)
            offset += len(line) + 1
        assert file_index.line_spans(tmp_path / "f.jsonl").tolist() == want, data


def test_empty_documents_at_the_end_belong_to_the_last_row() -> None:
    """Empty documents after the last byte start at T, past every row's range but the last's."""
    docs = InMemoryDocuments(["abcd", "efgh", "", ""])
    rows = [docs.split(j, 2) for j in range(2)]
    assert [_units(row) for row in rows] == [["abcd"], ["efgh", "", ""]]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_one_document_in_any_format_fills_the_rows(tmp_path: Path, suffix: str) -> None:
    """One big document of a .jsonl line, a .parquet row or a .json array element is cut into
    parts like a .txt file: every row gets one, in order, BOS once and EOS once."""
    text = _play(3_000)
    path = tmp_path / f"one{suffix}"
    if suffix == ".jsonl":
        _write_jsonl(path, [text])
    elif suffix == ".parquet":
        _write_parquet(path, [text])
    else:
        path.write_text(json.dumps([{"text": text}]))
    docs = FileDocuments([path])
    units = [u for j in range(16) for u in docs.split(j, 16)]
    assert len(units) == 16 and "".join(u.content for u in units) == text
    assert [u.starts for u in units] == [True] + [False] * 15 and [u.ends for u in units] == [False] * 15 + [True]


def _reference_row(sizes: list[int], row: int, rows: int) -> list[tuple[int, int, int]]:
    """Row `row` of `rows` by the rule of `documents.py`'s docstring, from every size at once:
    (document, part, parts) of each unit in order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    total = starts[-1]
    lo, hi = -(-row * total // rows), -(-(row + 1) * total // rows) + (row == rows - 1)
    units = []
    for doc, size in enumerate(sizes):
        count = -(-size * rows // total) if size * rows > total else 1
        for part in range(count):
            first = starts[doc] + -(-part * size // count)
            if lo <= first < hi:
                units.append((doc, part, count))
    return units


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_rows_of_memory_mapped_indexes_follow_the_rule(tmp_path: Path, rows: int) -> None:
    """Rows cut from the files' memory-mapped indexes (several .jsonl files, empty ones and empty
    lines between, one line larger than many rows' share, a text file) hold exactly the units
    the rule gives from every size at once; and the index is a memory map, not a copy."""
    import numpy as np

    rng = np.random.default_rng(rows)
    files = []
    for f, count in enumerate([5, 0, 40, 1, 17]):
        lines = [json.dumps({"text": "x" * int(n)}) for n in rng.integers(0, 30, count)]
        if f == 2:
            lines[7] = json.dumps({"text": "y" * 3000})  # cut into parts in most row counts
        (tmp_path / f"{f}.jsonl").write_text("\n".join(lines) + ("\n\n" if f % 2 else ""))
        files.append(tmp_path / f"{f}.jsonl")
    (tmp_path / "z.txt").write_text("text file\n" * 30)
    files.append(tmp_path / "z.txt")
    docs = FileDocuments(files, index_cache=tmp_path / "cache")
    sizes = docs.sizes().tolist()
    assert all(isinstance(table, np.memmap) for table in docs._tables[:-1])  # the text file's is one row
    for row in range(rows):
        got = docs.split(row, rows)
        assert [(int(d), int(p), got._parts.get(int(d), 1)) for d, p in zip(got._doc, got._part)] == \
            _reference_row(sizes, row, rows), row


def _crafted_indexes(good, size: int) -> dict:
    """Saved indexes a careless or hostile hand could leave: each is refused and built again."""
    import numpy as np

    shifted = good.copy()
    shifted[:, 0] += size  # every line past the file's end
    bad_starts = good.copy()
    bad_starts[:, -1] = 0
    swapped = good.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # out of file order
    return {
        "400 rows of a 10-line file": np.tile(good, (40, 1)),
        "float64": good.astype(np.float64),
        "int32": good.astype(np.int32),
        "3 columns (the old format)": good[:, :3].copy(),
        "1-D": good[:, 0].copy(),
        "past the end": shifted,
        "negative length": np.where(np.arange(good.size).reshape(good.shape) == 1, -5, good),
        "wrong starts": bad_starts,
        "out of order": swapped,
        "an object array (a pickle)": np.array([{"code": 1}] * 3, dtype=object),
    }


def test_a_saved_index_that_does_not_fit_the_file_is_built_again(tmp_path: Path, monkeypatch) -> None:
    """The index cache is a file anyone can write: a saved index is used only when it is a
    regular file holding what this file's index holds; a FIFO, a link, a pickle, another dtype
    or shape, lines outside the file or out of order are built again (never trained on, never
    a traceback, never a hang), and loading one runs no code."""
    import os

    import numpy as np

    lines = [f"doc {i}" for i in range(10)]
    _write_jsonl(tmp_path / "d.jsonl", lines)
    cache = tmp_path / "data_index"
    assert list(FileDocuments([tmp_path / "d.jsonl"], index_cache=cache)) == lines
    (path,) = cache.glob("*.npy")
    good = np.load(path)
    size = (tmp_path / "d.jsonl").stat().st_size
    cases = {name: lambda p, a=array: np.save(p, a, allow_pickle=True) for name, array in
             _crafted_indexes(good, size).items()}
    cases["a FIFO"] = os.mkfifo
    cases["a link to a good index elsewhere"] = lambda p: (np.save(tmp_path / "other.npy", good),
                                                           os.symlink(tmp_path / "other.npy", p))
    cases["not a .npy"] = lambda p: p.write_bytes(b"#!/bin/sh\nrm -rf /\n")
    for name, craft in cases.items():
        path.unlink()
        craft(path)
        built = []
        monkeypatch.setattr(dataset_module, "line_spans", lambda file: built.append(file) or line_spans(file))
        assert list(FileDocuments([tmp_path / "d.jsonl"], index_cache=cache)) == lines, name
        assert built == [tmp_path / "d.jsonl"], name
        assert path.is_file() and not path.is_symlink() and np.array_equal(np.load(path), good), name
