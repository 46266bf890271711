"""Packing documents into fixed-length sequences, and sharding each global batch over dp ranks.

    from torchmoe.data import build_dataloader, build_tokenizer
    loader = build_dataloader(job_config.training, build_tokenizer(""), dp_rank=r, dp_degree=D)
    for inputs, labels in loader.next_batch():   # one optimizer step: the micro-batches
        ...                                      # each (local_batch_size, seq_len) int64

The corpus becomes one endless token stream: each document's tokens, then EOS, document after
document, pass after pass. The stream is cut into windows of `seq_len + 1` tokens; window i is
packed sequence i, with `inputs = window[:-1]` and `labels = window[1:]`. Nothing is padded,
so every label counts in the loss.

The key property: global batch s is sequences [s*G, (s+1)*G) whatever the data-parallel degree
D and gradient accumulation. Rank r takes the contiguous slice [r*G/D, (r+1)*G/D) of it and
splits that into consecutive micro-batches of `local_batch_size`. Concatenating every rank's
micro-batches in (rank, micro-batch) order gives back the global batch, so every layout trains
on the same data in the same order.
"""

from __future__ import annotations

import array
import itertools
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from torchmoe.data.dataset import DataConfigError, Documents, build_documents
from torchmoe.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training

__all__ = ["PackedStream", "DataLoader", "build_dataloader"]

logger = logging.getLogger(__name__)


class PackedStream:
    """The corpus as an endless token stream cut into windows, with a resumable position.

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
    """

    def __init__(
        self, documents: Documents, tokenizer: Tokenizer, *, window: int, read_ahead: int = 64
    ) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
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
            logger.warning(
                "dataset exhausted after %d documents; starting pass %d over it (data repeats)",
                self._next_doc,
                self._epoch + 1,
            )
            self._epoch += 1
            self._next_doc = 0
            self._docs = self.documents.iter_from(0)
            self._read()
            if not self._ready:
                raise self._empty()
        self._next_doc += 1
        return self._ready.popleft()

    def _read(self) -> None:
        """Tokenize up to `read_ahead` more documents into `_ready`."""
        texts = list(itertools.islice(self._docs, self.read_ahead))
        for ids in self.tokenizer.encode_batch(texts):
            tokens = array.array("q", ids)  # int64; ~3x faster than torch.tensor(list)
            tokens.append(self.tokenizer.eos_id)
            self._ready.append(torch.frombuffer(tokens, dtype=torch.long))

    def _empty(self) -> DataConfigError:
        return DataConfigError(
            "training.dataset", repr(self.documents), "the dataset has no documents",
            "point training.dataset_path at files or a hub dataset that hold text",
        )  # fmt: skip


class DataLoader:
    """Per-rank batches of packed sequences for each optimizer step.

    Every rank builds the whole global batch and keeps its slice: each rank tokenizes the
    entire stream. That costs D times the tokenization of one rank but needs no communication
    and makes the batches independent of D by construction. Fine at our scale: the byte
    tokenizer packs tens of millions of tokens/s; a Hugging Face BPE packs about a million per
    process per second, still small next to a step's compute for our batch sizes.

    Args:
        documents: the corpus (`build_documents`).
        tokenizer: the model's tokenizer.
        seq_len: tokens per sequence.
        global_batch_size: sequences per optimizer step over all dp ranks (G).
        local_batch_size: sequences per micro-batch on one rank.
        dp_rank: this rank's index on the batch mesh (dp_replicate x dp_shard); CP/TP/PP peers
            of one dp rank pass the same dp_rank and get the same data.
        dp_degree: size of the batch mesh (D).

    Raises:
        DataConfigError: a non-positive size, or G is not a multiple of local_batch_size * D.
        ValueError: dp_rank or dp_degree is out of range (a caller bug).
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
    ) -> None:
        for key, value in (("training.seq_len", seq_len), ("training.local_batch_size", local_batch_size)):
            if value < 1:
                raise DataConfigError(key, value, "must be at least 1", "set a positive value")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        per_step = local_batch_size * dp_degree
        if global_batch_size < per_step or global_batch_size % per_step:
            raise DataConfigError(
                "training.global_batch_size", global_batch_size,
                f"must be a positive multiple of local_batch_size({local_batch_size}) * "
                f"dp({dp_degree}) = {per_step}",
                f"use a multiple of {per_step}, or -1 for {per_step} (no gradient accumulation)",
            )  # fmt: skip
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._stream = PackedStream(documents, tokenizer, window=seq_len + 1)
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
        windows = self._stream.take(self.global_batch_size)  # (G, seq_len + 1), same on all ranks
        per_rank = self.global_batch_size // self.dp_degree
        mine = windows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]  # (G/D, seq_len + 1)
        self._step += 1
        # clone: contiguous tensors that do not keep the whole global batch alive.
        return [(mb[:, :-1].clone(), mb[:, 1:].clone()) for mb in mine.split(self.local_batch_size)]

    def state_dict(self) -> dict[str, int]:
        """The position after the last `next_batch`, as plain ints.

        - `step`: optimizer steps (global batches) served so far.
        - `epoch`, `doc_index`, `token_offset`: where the next sequence starts in the token
          stream: token `token_offset` of document `doc_index` (its tokens + EOS) in pass `epoch`.

        The dict is identical on every rank and does not depend on the batch layout, so it can
        be saved once under one key and restored into any dp degree (or batch size).
        """
        epoch, doc_index, token_offset = self._stream.position()
        return {"step": self._step, "epoch": epoch, "doc_index": doc_index, "token_offset": token_offset}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at `state` (from `state_dict`).

        Cost: the documents before `doc_index` are skipped by `Documents.iter_from` (file and
        row counts for local files, nothing for python_docs, re-streaming for hub datasets);
        tokenization restarts at document `doc_index`, independent of the step count.
        """
        self._stream.seek(int(state["epoch"]), int(state["doc_index"]), int(state["token_offset"]))
        self._step = int(state["step"])


def build_dataloader(
    training: Training, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_degree: int = 1
) -> DataLoader:
    """The loader the `[training]` section describes; `global_batch_size = -1` means
    `local_batch_size * dp_degree` (no gradient accumulation)."""
    global_batch_size = training.global_batch_size
    if global_batch_size == -1:
        global_batch_size = training.local_batch_size * dp_degree
    return DataLoader(
        build_documents(training),
        tokenizer,
        seq_len=training.seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=training.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
    )
