"""Micro-batches as the loader hands them out: `(inputs, labels)`, and what an exact loss needs.

    for batch in loader.next_batch():
        inputs, labels = batch          # each (B, S) int64, as always
        batch.supervised                # labels != -100, a Python int counted on the host
        batch.starts                    # (B, S) int64 document starts, or None: derive them from EOS
        batch.real                      # (B, S) bool: the token is data, not padding; None: all are

A text row is a window of S + 1 tokens: `inputs = window[:-1]`, `labels = window[1:]`, every label
a target, and its documents are told by EOS (`nn.document_attention.document_starts`). A chat row
(`chat.ChatStream`) comes with its own labels (-100 where the token is no target, and at every
document boundary), document starts, since a conversation may hold EOS between its turns, and
which tokens are data: a window's padding is not, so it takes no part in the MoE routers'
statistics (`models.decoder.moe.MoE`). A token of a conversation is data whether or not it is a
target. A batch of text rows only is exactly what it always was (`starts` and `real` None,
`supervised` and `real_tokens` B * S); with a chat row in it, text rows' starts are derived from
EOS as the trainer would, and every one of their tokens is data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchmoe.nn.document_attention import document_starts

__all__ = ["IGNORE", "ChatWindows", "MicroBatch", "micro_batches"]

IGNORE = -100
"""The label of a position that is no target (`torch.nn.functional.cross_entropy`'s ignore_index)."""


class ChatWindows(NamedTuple):
    """Rows packed from conversations: each (n, S) int64."""

    inputs: torch.Tensor
    labels: torch.Tensor
    """The next token where it is a target of the same conversation, else `IGNORE`."""
    starts: torch.Tensor
    """Each position's document start in its row (padding is a document of its own)."""
    real: torch.Tensor
    """(n, S) bool: the position holds a conversation's token, not the padding after the last one."""


class MicroBatch(tuple):
    """`(inputs, labels)`, each (B, S) int64, with `starts` ((B, S) int64, or None where the
    documents are told by EOS), `supervised` (how many labels are targets, an int), `real`
    ((B, S) bool, True where the token is data and not padding, or None where every one is) and
    `real_tokens` (how many are, an int)."""

    starts: torch.Tensor | None
    supervised: int
    real: torch.Tensor | None
    real_tokens: int

    def __new__(cls, inputs: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor | None = None,
                supervised: int | None = None, real: torch.Tensor | None = None) -> MicroBatch:
        batch = super().__new__(cls, (inputs, labels))
        batch.starts = starts
        batch.supervised = labels.numel() if supervised is None else supervised
        batch.real = real
        batch.real_tokens = inputs.numel() if real is None else int(real.sum())
        return batch


def micro_batches(rows: list[torch.Tensor | ChatWindows], local_batch_size: int, eos_id: int) -> list[MicroBatch]:
    """This rank's rows of one step, in order, cut into micro-batches of `local_batch_size` rows.

    Args:
        rows: per row, a text window ((1, S + 1) int64) or `ChatWindows` of one row.
        local_batch_size: rows per micro-batch.
        eos_id: the token that ends a text document.
    """
    if all(isinstance(row, torch.Tensor) for row in rows):
        windows = torch.cat(rows)  # (rows, S + 1)
        # clone: contiguous inputs and labels (each a strided view of the windows).
        return [MicroBatch(mb[:, :-1].clone(), mb[:, 1:].clone()) for mb in windows.split(local_batch_size)]
    parts = [row if isinstance(row, ChatWindows) else
             ChatWindows(row[:, :-1], row[:, 1:], document_starts(row[:, :-1], eos_id),
                         torch.ones_like(row[:, :-1], dtype=torch.bool)) for row in rows]
    columns = (torch.cat(column).split(local_batch_size) for column in zip(*parts, strict=True))
    return [MicroBatch(x, y, s, int((y != IGNORE).sum()), real) for x, y, s, real in zip(*columns, strict=True)]
