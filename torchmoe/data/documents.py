"""Corpora as ordered documents, and their split into the rows of a global batch.

    docs.iter_from(1000)                 # documents 1000, 1001, ... of one pass (Documents)
    docs.sizes(), docs.read(17)          # sized corpora: every size known, any document read alone
    row = docs.split(j, G)               # the units batch row j of G packs, in order
    for unit in row.iter_from(k): ...    # Unit(content, starts, ends): a document or a part of one

**Rows are contiguous ranges of the corpus.** A sized corpus of total size T (bytes as stored, or
as the source text measured them for pre-tokenized shards) is cut into G ranges of T/G. A
document larger than one range is first cut into ``ceil(size * G / T)`` nearly equal parts (text
after a newline, tokens anywhere); each document or part then belongs to the row whose range
holds its first byte. So one 1 MB text file fills 8 or 1024 rows alike, many small documents are
dealt out whole, and every row reads only its own range, seeking to it: nothing before it is
read, and nothing outside it is tokenized. The ranges depend on G only, never on which rank
reads them or how many ranks there are.

A part that does not begin its document gets no BOS, and one that does not end it no EOS: the
packer (`dataloader.PackedStream`) adds those at real document boundaries only.

Streamed corpora without sizes (hub datasets) split by rows instead (`HFDocuments.split`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from torchmoe.data.errors import DataConfigError

if TYPE_CHECKING:
    from torchmoe.data.tokenizer import Tokenizer

__all__ = ["DataConfigError", "Unit", "Documents", "SizedDocuments", "RowCorpus", "text_part"]

Content = str | np.ndarray  # a document's text, or its token ids (a pre-tokenized corpus)


class Unit(NamedTuple):
    """What a batch row packs next: a whole document, or a contiguous part of one."""

    content: Content
    starts: bool
    """It begins its document (BOS may go before it)."""
    ends: bool
    """It ends its document (EOS goes after it)."""


class Documents(ABC):
    """An ordered corpus: document i is the same on every pass, rank and machine."""

    @abstractmethod
    def iter_from(self, start: int = 0) -> Iterator[Content | Unit]:
        """Documents (or, for a row, units) `start`, `start + 1`, ... to the end of one pass.

        Skipping the first `start` never hands them to a tokenizer: that keeps resuming cheap.
        """

    def split(self, index: int, count: int) -> Documents:
        """What batch row `index` of `count` packs; the rows together hold every document.

        Corpora override it; what a batch row packs is not split further.
        """
        raise TypeError(f"{self!r} is not split further")

    def locate(self, index: int) -> str:
        """Where document `index` comes from, for messages (a file, ``file:line``, a row)."""
        return f"document {index}"

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse a tokenizer this corpus cannot be read with: text goes with any; pre-tokenized
        shards (`TokenShards`) only with the one that made them."""

    def __iter__(self) -> Iterator[Content | Unit]:
        return self.iter_from(0)


def check_split(index: int, count: int) -> None:
    """Raises ValueError unless `0 <= index < count` (a caller bug)."""
    if not 0 <= index < count:
        raise ValueError(f"sub-corpus {index} is not in [0, count={count})")


class SizedDocuments(Documents):
    """A corpus whose document sizes are known up front and whose documents read alone (seek).

    Subclasses give `sizes`, `read` and, where a part can be read without its whole document
    (a text file), `read_part`.
    """

    source: tuple[str, str] = ("training.dataset", "")
    """The setting that named the corpus and its value, for messages."""

    @abstractmethod
    def sizes(self) -> np.ndarray:
        """(N,) int64: each document's size as stored (bytes), the measure rows are cut by."""

    @abstractmethod
    def read(self, index: int) -> Content:
        """Document `index`, whole."""

    def read_part(self, index: int, part: int, parts: int) -> Content:
        """Part `part` of `parts` of document `index` (`text_part`; tokens cut evenly)."""
        content = self.read(index)
        if isinstance(content, str):
            data = content.encode("utf-8")
            start, end = text_part(lambda offset, n: data[offset:offset + n], len(data), part, parts)
            return data[start:end].decode("utf-8")
        count = len(content)
        return content[part * count // parts:(part + 1) * count // parts]

    # Where documents start in the corpus (the sum of the sizes before each), asked by a batch row
    # for its own range only: a corpus too large to hold every start in memory answers from its
    # files' memory-mapped indexes (`FileDocuments`); these defaults hold them all.

    @cached_property
    def _starts(self) -> np.ndarray:
        """(N + 1,) int64: where each document begins in the corpus, and its total size last."""
        return np.concatenate([np.zeros(1, np.int64), np.cumsum(self.sizes(), dtype=np.int64)])

    def count(self) -> int:
        """The number of documents (N)."""
        return len(self._starts) - 1

    def total_size(self) -> int:
        """The corpus's size (T): the sum of every document's."""
        return int(self._starts[-1])

    def first_from(self, offset: int) -> int:
        """The first document that starts at or after `offset` in the corpus (N when none does)."""
        return int(np.searchsorted(self._starts[:-1], offset))

    def starts_of(self, lo: int, hi: int) -> np.ndarray:
        """(hi - lo + 1,) int64: where documents lo .. hi - 1 start in the corpus, and where
        document hi - 1 ends (0 <= lo <= hi <= N)."""
        return self._starts[lo:hi + 1]

    def iter_from(self, start: int = 0) -> Iterator[Content]:
        return (self.read(i) for i in range(start, self.count()))

    def split(self, index: int, count: int) -> RowCorpus:
        check_split(index, count)
        return RowCorpus(self, index, count)


class RowCorpus(Documents):
    """The units batch row `row` of `rows` packs (see the module docstring), in corpus order.

    Raises:
        DataConfigError: the corpus holds no text, or too little to give this row any.
    """

    def __init__(self, corpus: SizedDocuments, row: int, rows: int) -> None:
        self.corpus, self.row, self.rows = corpus, row, rows
        total = corpus.total_size()
        if total == 0:
            n = corpus.count()
            shown = ", ".join(corpus.locate(i) for i in range(min(n, 3))) + (", ..." if n > 3 else "")
            what = "no documents" if n == 0 else f"{n} document(s), all empty: {shown}"
            raise DataConfigError(*corpus.source, f"holds {what}", "point it at files that hold text")
        # A unit starting at s belongs to row floor(s * G / T): starts in [lo, hi). Empty documents
        # at the very end start at T: the last row takes them.
        lo, hi = -(-row * total // rows), -(-(row + 1) * total // rows) + (row == rows - 1)
        # Only the documents that reach into [lo, hi) are read: those starting in it, and the one
        # running into it from before. A document larger than a row's share (size * G > T) is
        # cut into ceil(size * G / T) parts (none larger than a share), each the row's whose range
        # holds its first byte; the others are dealt out whole.
        first, end = corpus.first_from(lo), corpus.first_from(hi)
        near = max(first - 1, 0)
        starts = corpus.starts_of(near, end)
        ids, sizes = np.arange(near, end), np.diff(starts)
        cut = sizes * rows > total
        whole = ids[(ids >= first) & ~cut]
        docs, parts = [whole], [np.zeros(len(whole), np.int64)]
        self._parts: dict[int, int] = {}  # the documents of this row that are cut: their part count
        for doc, start, size in zip(ids[cut].tolist(), starts[:-1][cut].tolist(), sizes[cut].tolist()):
            count = -(-size * rows // total)
            k = np.arange(count)
            first_byte = start - (-k * size // count)  # ceil: part k of a whole corpus is row k's
            mine = k[(first_byte >= lo) & (first_byte < hi)]
            if len(mine):
                self._parts[doc] = count
                docs.append(np.full(len(mine), doc))
                parts.append(mine)
        doc, part = np.concatenate(docs), np.concatenate(parts)
        order = np.lexsort((part, doc))
        self._doc, self._part = doc[order], part[order]  # (units,) each: the document, its part
        if total < rows or len(self._doc) == 0:  # under a byte per row, some row's part holds nothing
            which = f" (row {row} gets none)" if total >= rows else ""
            raise DataConfigError(
                "training.global_batch_size", rows,
                f"the corpus ({corpus.source[0]} = {corpus.source[1]}) holds {total} bytes, too few to give each of "
                f"{rows} batch rows a part of it{which}",
                "use a smaller training.global_batch_size, or more text",
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"row {self.row} of {self.rows} of {self.corpus!r}"

    def __len__(self) -> int:
        return len(self._doc)

    def iter_from(self, start: int = 0) -> Iterator[Unit]:
        for i in range(start, len(self._doc)):
            doc, part = int(self._doc[i]), int(self._part[i])
            parts = self._parts.get(doc, 1)
            if parts == 1:
                yield Unit(self.corpus.read(doc), True, True)
            else:
                yield Unit(self.corpus.read_part(doc, part, parts), part == 0, part == parts - 1)

    def locate(self, index: int) -> str:
        doc, part = int(self._doc[index]), int(self._part[index])
        parts = self._parts.get(doc, 1)
        where = self.corpus.locate(doc)
        return where if parts == 1 else f"{where} (part {part + 1} of {parts})"


# Text parts are cut after a newline: the first one at or after the even cut, within the part.
_SCAN = 1 << 16


def text_part(read: Callable[[int, int], bytes], size: int, part: int, parts: int) -> tuple[int, int]:
    """Byte range [start, end) of part `part` of `parts` of a UTF-8 text of `size` bytes.

    Cut k (0 < k < parts) is just after the first newline in [k*size/parts, (k+1)*size/parts),
    or, with no newline there, at the first character boundary from k*size/parts: so both
    neighbours of a cut compute it alike, each part is valid UTF-8, and each part starts a line
    wherever lines allow. `read(offset, n)` returns up to n bytes from offset (a file or a buffer).
    """
    return _cut(read, size, part, parts), _cut(read, size, part + 1, parts)


def _cut(read: Callable[[int, int], bytes], size: int, k: int, parts: int) -> int:
    if k <= 0:
        return 0
    if k >= parts:
        return size
    ideal, limit = k * size // parts, (k + 1) * size // parts
    offset = ideal
    while offset < limit:
        chunk = read(offset, min(_SCAN, limit - offset))
        if not chunk:
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            return offset + newline + 1
        offset += len(chunk)
    head = read(ideal, 4)  # UTF-8 continuation bytes (0b10xxxxxx) never start a character
    skip = next((i for i, b in enumerate(head) if b & 0xC0 != 0x80), len(head))
    return min(ideal + skip, size)
