"""One batch row's endless token stream (`PackedStream`): the documents of its share of the
corpus tokenized in order, each followed by EOS (and preceded by BOS with `training.add_bos`),
read ahead a little, cut into windows; its position (epoch, document, token offset) is what a
checkpoint saves and `seek` returns to. `dataloader.py` builds one per row and batches them.

    stream = PackedStream(InMemoryDocuments(["ab" * 40, "x"]), ByteTokenizer(), window=11, bos=300)
    window = stream.take(1)                       # (1, 11) int64: the next window
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from torchmoe.data.documents import DataConfigError, Documents, Unit
from torchmoe.data.errors import CorpusEnd
from torchmoe.data.passes import Passes
from torchmoe.data.tokenizer import Tokenizer

__all__ = ["CorpusEnd", "PIECE_CHARS", "PackedStream"]



# A document longer than this many characters is tokenized in pieces of about this size, as it is
# packed (`Tokenizer.encode_pieces`): its token ids (8 bytes each, a Python list first) are never
# all in memory at once. Read-ahead stops once this much text is read.
PIECE_CHARS = 1 << 20
READ_AHEAD_CHARS = 1 << 24


class PackedStream:
    """A corpus as an endless token stream cut into windows, with a resumable position.

    `DataLoader` runs one per batch row, over that row's units (`Documents.split`).

    The position is where the next window starts: `(epoch, doc_index, token_offset)`, i.e.
    token `token_offset` of document `doc_index` (its tokens followed by EOS) in pass `epoch`.
    It depends on neither the window size nor the batch layout.

    Documents are read and tokenized `read_ahead` at a time with `Tokenizer.encode_batch`
    (Hugging Face tokenizers encode a batch on all cores), at most `READ_AHEAD_CHARS` of text;
    a document longer than `PIECE_CHARS` is tokenized piece by piece as it is packed, so memory
    stays about its text plus one piece. The position counts only documents handed out, so
    read-ahead never shows in it.

    Args:
        documents: the corpus; must yield the same documents on every pass.
        tokenizer: turns each document into ids; EOS is appended by the stream.
        window: tokens per window (`seq_len + 1`).
        read_ahead: documents tokenized together.
        bos: a token id to put before each document (the tokenizer's BOS), or None.
        repeat: start another pass at the end of the corpus; False raises `CorpusEnd` there.
        source: the setting that named the corpus and its value, for messages
            (``("training.dataset_path", "data/*.jsonl")``); default: the corpus itself.
        passes: the passes the source's rows on this process started (one line a pass says the
            data repeats); default: this row's own.
    """

    def __init__(
        self, documents: Documents, tokenizer: Tokenizer, *, window: int, read_ahead: int = 64,
        bos: int | None = None, repeat: bool = True, source: tuple[str, str] | None = None,
        passes: Passes | None = None,
    ) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.bos = bos
        self.repeat = repeat
        self.window = window
        self.read_ahead = read_ahead
        self.source = source or ("training.dataset", repr(documents))
        self.passes = passes or Passes()
        self.seek(0, 0, 0)

    def position(self) -> tuple[int, int, int]:
        """`(epoch, doc_index, token_offset)` of the next window's first token."""
        if self._piece is not None:  # a document is being packed
            return self._epoch, self._next_doc - 1, self._done + self._offset
        return self._epoch, self._next_doc, 0

    def seek(self, epoch: int, doc_index: int, token_offset: int) -> None:
        """Continue from a `position()`.

        Costs one `documents.iter_from(doc_index - 1)` (which may re-read, but not tokenize, the
        documents before it); only documents from `doc_index` on are tokenized again, and of a
        long one only the pieces up to `token_offset`.

        Raises:
            DataConfigError: the position is past the end of the corpus or of its document (the
                dataset or the tokenizer changed since it was saved).
        """
        self._epoch = epoch
        self._next_doc = doc_index  # index of the next document to hand out
        self._ready: deque[Iterator[torch.Tensor]] = deque()  # tokenized (or to be), not yet handed out
        self._piece: torch.Tensor | None = None  # (n,) the current piece of the document being packed
        self._pieces: Iterator[torch.Tensor] = iter(())  # the document's pieces after it
        self._offset = 0  # tokens of `_piece` handed out
        self._done = 0  # tokens of the document before `_piece`
        # Documents with text (not empty, not only whitespace) read in this pass, when it started at
        # document 0: a whole pass without one means the corpus holds no text to train on.
        self._pass_text: int | None = 0 if doc_index == 0 else None
        # The document before the position must exist: a corpus that lost documents since the
        # position was saved would otherwise look like one whose pass just ended.
        self._docs: Iterator[str] = self.documents.iter_from(max(doc_index - 1, 0))
        if doc_index and next(self._docs, None) is None:
            raise self._past_end(epoch, doc_index, token_offset, "the dataset")
        if token_offset:
            self._read()
            if not self._ready:
                raise self._past_end(epoch, doc_index, token_offset, "the dataset")
            self._start(self._ready.popleft())
            while self._piece is not None and self._done + len(self._piece) <= token_offset:
                self._advance()
            if self._piece is None:
                raise self._past_end(epoch, doc_index, token_offset, "that document")
            self._offset = token_offset - self._done

    def _past_end(self, epoch: int, doc_index: int, token_offset: int, what: str) -> DataConfigError:
        key, value = self.source
        return DataConfigError(
            key, value,
            f"the checkpoint's data position (pass {epoch}, document {doc_index}, token {token_offset}) is past "
            f"the end of {what}: the dataset or the tokenizer has changed since the checkpoint was saved",
            "resume with the dataset and tokenizer it was saved with; or, to go on training from it with these, "
            'set checkpoint.exclude_from_loading = ["dataloader"] (every batch row starts again at its first '
            "document); or start a new run in another job.dump_folder",
        )  # fmt: skip

    def take(self, n: int) -> torch.Tensor:
        """The next `n` windows, shape (n, window), int64."""
        need = n * self.window
        pieces: list[torch.Tensor] = []
        while need:
            if self._piece is None:
                self._start(self._next_document())
                continue  # a unit without tokens (an empty part of a document)
            piece = self._piece[self._offset : self._offset + need]
            self._offset += len(piece)
            need -= len(piece)
            pieces.append(piece)
            if self._offset == len(self._piece):
                self._advance()
        return torch.cat(pieces).view(n, self.window)

    def _start(self, pieces: Iterator[torch.Tensor]) -> None:
        """Pack the unit whose token pieces are `pieces` (`_piece` None if it has no tokens)."""
        self._pieces, self._done, self._piece = pieces, 0, None
        self._next_piece()
        self._next_doc += 1

    def _advance(self) -> None:
        """On to the current document's next piece; `_piece` None after its last."""
        self._done += len(self._piece)
        self._next_piece()

    def _next_piece(self) -> None:
        self._offset = 0
        self._piece = next((p for p in self._pieces if len(p)), None)  # a piece of no tokens is skipped

    def _next_document(self) -> Iterator[torch.Tensor]:
        """The next document's token pieces (its tokens + EOS); starts a new pass at the end."""
        if not self._ready:
            self._read()
        if not self._ready:
            if self._next_doc == 0:
                raise self._empty()
            if self._pass_text == 0:
                raise self._no_text()
            if not self.repeat:
                raise CorpusEnd(f"{self._next_doc} documents of {self.documents!r}")
            self._epoch += 1
            self.passes.start(self._epoch, lambda: (
                f"{self.source[0]} = {self.source[1]}: batch rows start pass {self._epoch} over their documents as "
                f"each finishes the one before (data repeats; this row's share holds {self._next_doc:,})"))
            self._next_doc = 0
            self._pass_text = 0
            self._docs = self.documents.iter_from(0)
            self._read()
            if not self._ready:
                raise self._empty()
        return self._ready.popleft()

    def _read(self) -> None:
        """Read up to `read_ahead` more units (and `READ_AHEAD_CHARS` of text) into `_ready`: the
        short texts tokenized together, long ones to be tokenized piece by piece, token ids (a
        pre-tokenized corpus) as they are."""
        units: list[Unit] = []
        chars = 0
        while len(units) < self.read_ahead and chars < READ_AHEAD_CHARS:
            item = next(self._docs, None)
            if item is None:
                break
            unit = item if isinstance(item, Unit) else Unit(item, True, True)  # a hub row: a whole document
            units.append(unit)
            chars += len(unit.content)
        if self._pass_text is not None:
            self._pass_text += sum(1 for unit in units if _has_text(unit.content))
        short = [unit.content for unit in units if isinstance(unit.content, str) and len(unit.content) <= PIECE_CHARS]
        encoded = iter(self.tokenizer.encode_batch(short))
        for unit in units:
            if not isinstance(unit.content, str):
                self._ready.append(self._token_pieces(unit))
            elif len(unit.content) <= PIECE_CHARS:
                self._ready.append(iter([self._tokens(next(encoded), first=unit.starts, last=unit.ends)]))
            else:
                self._ready.append(self._long_document(unit))

    def _long_document(self, unit: Unit) -> Iterator[torch.Tensor]:
        """The token pieces of a long text, tokenized as they are needed."""
        first = unit.starts
        for ids in self.tokenizer.encode_pieces(unit.content, PIECE_CHARS):
            yield self._tokens(ids, first=first, last=False)
            first = False
        yield self._tokens([], first=first, last=unit.ends)

    def _token_pieces(self, unit: Unit) -> Iterator[torch.Tensor]:
        """The pieces of a unit of token ids (read from a memory map as they are needed)."""
        ids = unit.content
        for start in range(0, len(ids), PIECE_CHARS):
            yield self._tokens(ids[start:start + PIECE_CHARS], first=unit.starts and start == 0, last=False)
        yield self._tokens([], first=unit.starts and len(ids) == 0, last=unit.ends)

    def _tokens(self, ids: list[int] | np.ndarray, *, first: bool, last: bool) -> torch.Tensor:
        """(n,) int64: `ids`, after BOS if `first` (and the stream has one), before EOS if `last`."""
        tokens = array.array("q", (self.bos,) if first and self.bos is not None else ())  # int64
        if isinstance(ids, np.ndarray):
            tokens.frombytes(ids.astype(np.int64).tobytes())
        else:
            tokens.extend(ids)  # ~3x faster than torch.tensor(list)
        if last:
            tokens.append(self.tokenizer.eos_id)
        return torch.frombuffer(tokens, dtype=torch.long) if tokens else torch.empty(0, dtype=torch.long)

    def _no_text(self) -> DataConfigError:
        """A whole pass of this row's documents held no text: the first few named by their files."""
        shown = [self.documents.locate(i) for i in range(min(self._next_doc, 3))]
        more = ", ..." if self._next_doc > 3 else ""
        key, value = self.source
        return DataConfigError(
            key, value,
            f"the {self._next_doc} document(s) of a batch row hold no text: {', '.join(shown)}{more} (empty or "
            "only whitespace)",
            "give them text or remove them from the dataset: each of the training.global_batch_size rows packs its "
            "own range of the corpus; or check training.dataset_text_field (it may name an empty column)",
        )  # fmt: skip

    def _empty(self) -> DataConfigError:
        key, value = self.source
        return DataConfigError(
            key, value, "holds no documents for one of the batch rows (a hub dataset's row j packs its rows j, "
            "j + G, ...)",
            "point it at files or a hub dataset that hold text: a hub dataset needs at least "
            "training.global_batch_size rows, one for each batch row",
        )  # fmt: skip


def _has_text(content: str | np.ndarray) -> bool:
    """Whether a unit holds something to train on (not empty, not only whitespace)."""
    return bool(content.strip()) if isinstance(content, str) else len(content) > 0
