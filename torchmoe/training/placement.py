"""A micro-batch as this rank trains on it: its columns, on its device, with the document
segment tables its attention calls read and which of its tokens are data (not padding) for the
MoE routers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.nn.document_attention import (
    AttentionCall,
    DocumentSegments,
    document_segments,
    document_starts,
    whole_row_calls,
)
from torchmoe.plan.context import CPLayout
from torchmoe.plan.parallel_dims import ParallelDims

# Places a (B, seq_len) micro-batch's (inputs, labels, document starts or None, data mask or None)
# as this rank trains on them (`LocalColumns`): (inputs, labels, document segment tables or None,
# data mask or None).
PlaceColumns = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                        tuple[torch.Tensor, torch.Tensor, DocumentSegments | None, torch.Tensor | None]]


class LocalColumns:
    """Turns a (B, seq_len) micro-batch into this rank's part of it (`__call__`).

    Args:
        model_args: the model (its attention chunk sizes and sliding windows).
        dims, mesh: the layout (its context-parallel degree and this rank's cp coordinate).
        seq_len: training's sequence length (validation's equals it under CP: `preflight`).
        eos_id: the tokenizer's end of sequence, which separates documents; None: no document
            masking (`training.document_masking` is false).
        device: where the batch trains.
    """

    def __init__(self, model_args: ModelArgs, dims: ParallelDims, mesh: ParallelMesh | None, *, seq_len: int,
                 eos_id: int | None, device: torch.device) -> None:
        self.spans = model_args.attention_spans()
        self.cp = dims.cp
        self.cp_rank = mesh["cp"].get_local_rank() if dims.cp_enabled else 0
        self.eos_id = eos_id
        self.device = device
        # Context parallelism: the columns of each sequence this rank trains on (its head-tail pieces).
        self.positions = torch.tensor(CPLayout(seq_len, self.cp).positions(self.cp_rank)) \
            if dims.cp_enabled else None

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, starts: torch.Tensor | None = None,
                 real: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, DocumentSegments | None, torch.Tensor | None]:
        """This rank's columns of a (B, seq_len) micro-batch (its CP pieces; all without CP), on
        its device: its inputs, labels and (B, seq_len) bool mask of the tokens that are data
        (`data.micro_batches.MicroBatch.real`: None where all are), which the MoE layers take as
        the tokens take their columns (`models.decoder.moe.MoE.forward`); and with document
        masking the segment tables of every attention call this rank's layers make
        (`nn.document_attention.document_segments`), else None. The tables
        come from the batch's own (B, seq_len) document `starts` where it has them (chat rows,
        whose templates may write EOS inside a conversation: `data.micro_batches.MicroBatch`),
        else from the whole rows' token ids, on the host, before they travel (a piece's first
        document may begin in an earlier piece): no layer reads a device value for them. Every
        rank of a pipeline derives them from the same batch, so stages without the token ids get
        each micro-batch's own.

        To a GPU the copy is asynchronous: from pinned host memory, with ``non_blocking``, so the
        host goes on queueing work while the batch travels (the stream orders its use)."""
        documents = None
        if self.eos_id is not None:
            if starts is None:
                starts = document_starts(inputs, self.eos_id)
            documents = document_segments(starts,
                                          self.attention_calls(inputs.shape[-1]), self.device)
        columns = (inputs, labels) if real is None else (inputs, labels, real)
        if self.positions is not None:
            columns = tuple(t[:, self.positions] for t in columns)
        if self.device.type == "cuda":
            placed = [t.pin_memory().to(self.device, non_blocking=True) for t in columns]
        else:
            placed = [t.to(self.device) for t in columns]
        return placed[0], placed[1], documents, placed[2] if real is not None else None

    def attention_calls(self, seq_len: int) -> list[AttentionCall]:
        """The kinds of attention call this rank's layers make on rows of `seq_len` tokens: one
        per chunk size and sliding window of the model, per local CP piece under CP."""
        if self.cp == 1:
            return whole_row_calls(self.spans, seq_len)
        layout = CPLayout(seq_len, self.cp)
        return [AttentionCall(*call) for call in layout.attention_calls(self.cp_rank, self.spans)]
