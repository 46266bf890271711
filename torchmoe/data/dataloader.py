"""Packing documents into fixed-length sequences: one packed sub-stream per batch row.

    from torchmoe.data import build_dataloader, build_tokenizer
    loader = build_dataloader(job_config.training, build_tokenizer(""), dp_rank=r, dp_degree=D,
                              batch_mesh=mesh["batch"])   # the mesh only under a process group
    for inputs, labels in loader.next_batch():   # one optimizer step: the micro-batches
        ...                                      # each (local_batch_size, seq_len) int64

The global batch has G = global_batch_size rows. Row j of every global batch is the next window
of `seq_len + 1` tokens of its own endless token stream, sub-stream j: the documents of
sub-corpus j (`Documents.split(j, G)`: documents j, j+G, j+2G, ... by default) each followed
by EOS (and preceded by BOS with `training.add_bos`, as torchtitan packs), document after
document, pass after pass. `inputs = window[:-1]`, `labels =
window[1:]`; nothing is padded, so every label counts in the loss.

Rank r of D data-parallel ranks owns the contiguous rows [r*G/D, (r+1)*G/D): it reads and
tokenizes only their sub-corpora, and splits its rows into consecutive micro-batches of
`local_batch_size`. Concatenating every rank's micro-batches in (rank, micro-batch) order gives
the global batch, and since the split into sub-corpora depends only on G, every layout with the
same G trains on the same data in the same order. The price: another G is another data order,
so a run cannot resume with a different G.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard

from torchmoe.data.dataset import DataConfigError, Documents, build_documents
from torchmoe.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchmoe.config.job_config import Training, Validation

__all__ = ["CorpusEnd", "PackedStream", "DataLoader", "build_dataloader", "validation_data"]

logger = logging.getLogger(__name__)


class CorpusEnd(Exception):
    """A stream built with ``repeat=False`` reached the end of its corpus (validation's one pass)."""


class PackedStream:
    """A corpus as an endless token stream cut into windows, with a resumable position.

    `DataLoader` runs one per batch row, over that row's sub-corpus.

    The position is where the next window starts: `(epoch, doc_index, token_offset)`, i.e.
    token `token_offset` of document `doc_index` (its tokens followed by EOS) in pass `epoch`.
    It depends on neither the window size nor the batch layout.

    Documents are read and tokenized `read_ahead` at a time with `Tokenizer.encode_batch`
    (Hugging Face tokenizers encode a batch on all cores); the position counts only documents
    handed out, so read-ahead never shows in it.

    Args:
        documents: the corpus; must yield the same documents on every pass.
        tokenizer: turns each document into ids; EOS is appended by the stream.
        window: tokens per window (`seq_len + 1`).
        read_ahead: documents tokenized together.
        bos: a token id to put before each document (the tokenizer's BOS), or None.
        repeat: start another pass at the end of the corpus; False raises `CorpusEnd` there.
    """

    def __init__(
        self, documents: Documents, tokenizer: Tokenizer, *, window: int, read_ahead: int = 64,
        bos: int | None = None, repeat: bool = True,
    ) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.bos = bos
        self.repeat = repeat
        self.window = window
        self.read_ahead = read_ahead
        self.seek(0, 0, 0)

    def position(self) -> tuple[int, int, int]:
        """`(epoch, doc_index, token_offset)` of the next window's first token."""
        if self._doc is not None and self._offset < len(self._doc):
            return self._epoch, self._next_doc - 1, self._offset
        return self._epoch, self._next_doc, 0

    def seek(self, epoch: int, doc_index: int, token_offset: int) -> None:
        """Continue from a `position()`.

        Costs one `documents.iter_from(doc_index)` (which may re-read, but not tokenize, the
        documents before it); only documents from `doc_index` on are tokenized again.

        Raises:
            DataConfigError: the position is past the end of the corpus (the dataset or the
                tokenizer changed since it was saved).
        """
        self._epoch = epoch
        self._next_doc = doc_index  # index of the next document to hand out
        self._docs: Iterator[str] = self.documents.iter_from(doc_index)
        self._ready: deque[torch.Tensor] = deque()  # tokenized, not yet handed out
        self._doc: torch.Tensor | None = None  # (n_tokens + 1,) the current document + EOS
        self._offset = 0
        # Documents with text (not empty, not only whitespace) read in this pass, when it started at
        # document 0: a whole pass without one means the corpus holds no text to train on.
        self._pass_text: int | None = 0 if doc_index == 0 else None
        if token_offset:
            self._read()
            if not self._ready or token_offset >= len(self._ready[0]):
                raise DataConfigError(
                    "training.dataset", repr(self.documents),
                    f"the saved data position (pass {epoch}, document {doc_index}, token "
                    f"{token_offset}) is past the end of the dataset or of that document",
                    "resume with the dataset and tokenizer the checkpoint was made with, or start "
                    "a new run in another job.dump_folder",
                )  # fmt: skip
            self._doc, self._offset = self._ready.popleft(), token_offset
            self._next_doc += 1

    def take(self, n: int) -> torch.Tensor:
        """The next `n` windows, shape (n, window), int64."""
        need = n * self.window
        pieces: list[torch.Tensor] = []
        while need:
            if self._doc is None or self._offset == len(self._doc):
                self._doc, self._offset = self._next_document(), 0
            piece = self._doc[self._offset : self._offset + need]
            self._offset += len(piece)
            need -= len(piece)
            pieces.append(piece)
        return torch.cat(pieces).view(n, self.window)

    def _next_document(self) -> torch.Tensor:
        """The next document's tokens + EOS, (n_tokens + 1,); starts a new pass at the end."""
        if not self._ready:
            self._read()
        if not self._ready:
            if self._next_doc == 0:
                raise self._empty()
            if self._pass_text == 0:
                raise DataConfigError(
                    "training.dataset", repr(self.documents),
                    f"holds no text: its {self._next_doc} document(s) are empty or only whitespace",
                    "check training.dataset_text_field (it may name an empty column), or point "
                    "training.dataset_path at files that hold text",
                )  # fmt: skip
            if not self.repeat:
                raise CorpusEnd(f"{self._next_doc} documents of {self.documents!r}")
            logger.warning(
                "dataset exhausted after %d documents (%r); starting pass %d over it (data repeats)",
                self._next_doc,
                self.documents,
                self._epoch + 1,
            )
            self._epoch += 1
            self._next_doc = 0
            self._pass_text = 0
            self._docs = self.documents.iter_from(0)
            self._read()
            if not self._ready:
                raise self._empty()
        self._next_doc += 1
        return self._ready.popleft()

    def _read(self) -> None:
        """Tokenize up to `read_ahead` more documents into `_ready`."""
        texts = list(itertools.islice(self._docs, self.read_ahead))
        if self._pass_text is not None:
            self._pass_text += sum(1 for text in texts if not text.isspace() and text)
        for ids in self.tokenizer.encode_batch(texts):
            tokens = array.array("q", () if self.bos is None else (self.bos,))  # int64
            tokens.extend(ids)  # ~3x faster than torch.tensor(list)
            tokens.append(self.tokenizer.eos_id)
            self._ready.append(torch.frombuffer(tokens, dtype=torch.long))

    def _empty(self) -> DataConfigError:
        return DataConfigError(
            "training.dataset", repr(self.documents), "this holds no documents",
            "point training.dataset_path at files or a hub dataset that hold text: at least "
            "training.global_batch_size documents, one for each batch row",
        )  # fmt: skip


class DataLoader:
    """This rank's batch rows, packed from their own sub-corpora, for each optimizer step.

    Rank r builds one `PackedStream` per row it owns (rows [r*G/D, (r+1)*G/D), see the module
    docstring) and never reads another row's documents: tokenization is split D ways.

    Args:
        documents: the corpus (`build_documents`); row j reads `documents.split(j, G)`.
        tokenizer: the model's tokenizer.
        seq_len: tokens per sequence.
        global_batch_size: sequences per optimizer step over all dp ranks (G): the rows.
        local_batch_size: sequences per micro-batch on one rank.
        dp_rank: this rank's index on the batch mesh (dp_replicate x dp_shard); CP/TP/PP peers
            of one dp rank pass the same dp_rank and get the same data.
        dp_degree: size of the batch mesh (D).
        batch_mesh: the 1-D batch DeviceMesh when running under a process group; the checkpoint
            state is then a DTensor sharded over it (see `state_dict`). Must agree with
            dp_rank and dp_degree.
        read_ahead: documents tokenized together on this rank, split over its rows (at least
            one per row); it changes no batch.
        add_bos: start every document with the tokenizer's BOS token.
        repeat: rows start another pass at the end of their sub-corpus; False makes `next_batch`
            raise `CorpusEnd` when a row of this rank runs out (one pass, for validation).

    Raises:
        ValueError: dp_rank, dp_degree or batch_mesh are out of range or disagree (a caller bug).
    """

    def __init__(
        self,
        documents: Documents,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        batch_mesh: DeviceMesh | None = None,
        read_ahead: int = 64,
        add_bos: bool = False,
        repeat: bool = True,
    ) -> None:
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        if batch_mesh is not None and (batch_mesh.ndim, batch_mesh.size(), batch_mesh.get_local_rank()) != (
            1, dp_degree, dp_rank
        ):
            raise ValueError(
                f"batch_mesh {batch_mesh} is not a 1-D mesh of size dp_degree={dp_degree} with "
                f"this rank at dp_rank={dp_rank}"
            )
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.batch_mesh = batch_mesh
        per_rank = global_batch_size // dp_degree
        self.rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)  # global row indices owned here
        bos = None
        if add_bos:
            bos = tokenizer.bos_id
            if bos is None:
                raise DataConfigError("training.add_bos", True, "the tokenizer has no BOS token",
                                      "name one as bos_token in tokenizer_config.json, or set add_bos = false")
        self._streams = [
            PackedStream(
                documents.split(row, global_batch_size), tokenizer,
                window=seq_len + 1, read_ahead=max(1, read_ahead // per_rank), bos=bos, repeat=repeat,
            )  # fmt: skip
            for row in self.rows
        ]
        self._step = 0

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank: G / (local_batch_size * D)."""
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step.

        Returns:
            `grad_accum_steps` pairs `(inputs, labels)`, each (local_batch_size, seq_len) int64,
            with `labels[:, t] == inputs[:, t + 1]` inside a sequence.
        """
        windows = torch.cat([stream.take(1) for stream in self._streams])  # (G/D, seq_len + 1)
        self._step += 1
        # clone: contiguous inputs and labels (each a strided view of the windows).
        return [(mb[:, :-1].clone(), mb[:, 1:].clone()) for mb in windows.split(self.local_batch_size)]

    def state_dict(self) -> dict[str, Any]:
        """The position after the last `next_batch`.

        - `step`: optimizer steps (global batches) served so far (the same on every rank).
        - `rows`: int64 (G, 3); row j is `(epoch, doc_index, token_offset)` of sub-stream j:
          its next window starts at token `token_offset` of document `doc_index` of sub-corpus
          j (its tokens + EOS) in pass `epoch`.

        With a `batch_mesh`, `rows` is a DTensor sharded `Shard(0)` over it, each rank holding
        its own G/D rows, so DCP saves every rank's rows and reshards them on load into any dp
        degree and local batch size with the same G. Without one it is a plain tensor of this
        rank's rows: (G, 3) in a single process.
        """
        rows = torch.tensor([stream.position() for stream in self._streams], dtype=torch.long)  # (G/D, 3)
        if self.batch_mesh is not None:
            rows = DTensor.from_local(
                rows, self.batch_mesh, [Shard(0)], shape=torch.Size((self.global_batch_size, 3)), stride=(3, 1)
            )
        return {"step": self._step, "rows": rows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state` (from `state_dict`, of any layout with the same G).

        `rows` may be a DTensor (this rank's shard is used), the full (G, 3) tensor (this rank
        takes its rows) or this rank's own (G/D, 3) rows.

        Cost: per row, the documents of its sub-corpus before `doc_index` are skipped by
        `Documents.iter_from` (see dataset.py for what each source re-reads); tokenization
        restarts at document `doc_index`, independent of the step count.

        Raises:
            DataConfigError: the state has another number of rows (another global_batch_size),
                or a position is past the end of its sub-corpus (the dataset changed).
        """
        rows = state["rows"]
        if isinstance(rows, DTensor):  # ours (DCP loads into `state_dict()`'s), so G matches
            rows = rows.to_local()
        elif len(rows) == self.global_batch_size:
            rows = rows[self.rows.start : self.rows.stop]
        if tuple(rows.shape) != (len(self.rows), 3):
            raise self._other_global_batch(len(rows))
        for stream, (epoch, doc_index, token_offset) in zip(self._streams, rows.tolist(), strict=True):
            stream.seek(epoch, doc_index, token_offset)
        self._step = int(state["step"])

    def check_saved_shapes(self, shapes: Mapping[str, torch.Size]) -> None:
        """Refuse a checkpoint whose `rows` (shape in `shapes`) were saved with another G.

        `CheckpointManager` calls it before loading (DCP would fail on the shape with a
        traceback-worthy error): another G is another data order, so it is a user error.
        """
        saved = shapes.get("rows")
        if saved is not None and tuple(saved) != (self.global_batch_size, 3):
            raise self._other_global_batch(saved[0])

    def _other_global_batch(self, saved_rows: int) -> DataConfigError:
        return DataConfigError(
            "training.global_batch_size", self.global_batch_size,
            f"the checkpoint was saved with global_batch_size {saved_rows}; each batch row reads "
            "its own sub-corpus, so the data position of one cannot continue in the other",
            f"resume with training.global_batch_size = {saved_rows}, or start a new run in another "
            "job.dump_folder (checkpoint.initial_load_path can start it from the weights)",
        )  # fmt: skip


def validation_data(training: Training, validation: Validation) -> Training:
    """The `[training]` data settings of the validation batches: `validation`'s dataset, split,
    rows and length, one batch per step (no accumulation); BOS and the text field stay the
    training's."""
    return dataclasses.replace(training, dataset=validation.dataset, dataset_path=validation.dataset_path,
                               dataset_split=validation.dataset_split, local_batch_size=validation.local_batch_size,
                               global_batch_size=-1, seq_len=validation.seq_len)


def build_dataloader(
    training: Training,
    tokenizer: Tokenizer,
    *,
    dp_rank: int = 0,
    dp_degree: int = 1,
    batch_mesh: DeviceMesh | None = None,
    repeat: bool = True,
    key: str = "training.dataset_path",
) -> DataLoader:
    """The loader the `[training]` section describes; `global_batch_size = -1` means
    `local_batch_size * dp_degree` (no gradient accumulation). `repeat` as in `DataLoader`; `key`
    names the dataset's path in messages (``validation.dataset_path`` for the validation data)."""
    global_batch_size = training.global_batch_size
    if global_batch_size == -1:
        global_batch_size = training.local_batch_size * dp_degree
    return DataLoader(
        build_documents(training, key=key),
        tokenizer,
        seq_len=training.seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=training.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        batch_mesh=batch_mesh,
        add_bos=training.add_bos,
        repeat=repeat,
    )
