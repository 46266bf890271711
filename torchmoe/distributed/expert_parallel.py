"""Expert parallelism: routed experts sharded over ``ep``, tokens exchanged with all-to-all.

Each EP rank holds ``num_experts / ep`` consecutive experts. Per MoE layer and micro-batch, in
the phases of `TokenDispatcher` (what `MoE.forward` runs between them in brackets):

    dispatch     launch the all-to-all of the per-expert counts (E,); sort the routed copies by
                 global expert meanwhile; read the split sizes on the host (the one host sync:
                 the all-to-all needs them); launch the all-to-all of the rows
                 [the shared expert's first half, ``silu(w1 x) * w3 x``, while the rows travel]
    run_experts  wait for the rows; reorder them expert-major; run the local experts; undo the
                 reorder; launch the all-to-all of the outputs back
                 [the shared expert's second half, ``w2 h``, while the outputs travel]
    combine      wait for the outputs; gate and sum each token's copies

Each all-to-all is a launch and a wait autograd node (`async_all_to_all`), so backward mirrors
this: the outputs' gradients travel back to the experts' ranks during the backward of ``w2 h``,
the rows' gradients back to their tokens' ranks during the backward of the first half. The
shared expert is split where that changes no bit of the result, between its matmuls: two of its
three (w1, w3) in the dispatch window, one (w2) in the combine window. Splitting it by tokens
instead would balance the two windows (both exchanges move the same bytes) but change the GEMM
shapes, hence the rounding. With all three in the dispatch window, 2 gloo ranks hid about half
as much shared-expert compute behind the exchanges (docs/parallelism.md, "The parallelize order", step 3).

Dropless: every routed copy of a data token is sent, however unbalanced the routing; padding's
(`MoE.forward`'s mask) are not sent at all, so that a chat batch's padding, which all picks the
same experts, neither crosses the network nor piles up on their ranks. With TP, EP borrows the TP
ranks: each rank dispatches the tokens of its own sequence shard (no all-gather in the MoE
block), and the router gate and shared experts, replicated over ``tp``, see token-sharded inputs
so their gradients are summed over ``tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchmoe import _torch_private as private
from torchmoe.distributed.async_all_to_all import PendingAllToAll, launch_all_to_all, wait_all_to_all
from torchmoe.nn.dispatch import Routed, TokenDispatcher, copies_per_expert
from torchmoe.nn.moe_ops import count_exchanged_bytes


@dataclass
class Exchange:
    """`Routed.exchange` under expert parallelism.

    Attributes:
        send, recv: rows sent to / received from each EP rank.
        recv_counts: (ep, local_experts) rows received from each rank for each local expert.
        pending: the all-to-all under way: the rows to the experts' ranks after `dispatch`,
            the experts' outputs back after `run_experts`.
    """

    send: list[int]
    recv: list[int]
    recv_counts: torch.Tensor
    pending: PendingAllToAll


class AllToAllDispatcher(TokenDispatcher):
    """`TokenDispatcher` that exchanges rows with the EP ranks owning the experts (module doc).

    Counts the row bytes this rank sends to other ranks: `bytes_sent` in forward passes (the
    backward all-to-alls mirror them, moving the same bytes), `bytes_recomputed` when activation
    checkpointing re-runs the forward inside backward.
    """

    def __init__(self, num_experts: int, top_k: int, ep_mesh: DeviceMesh) -> None:
        super().__init__(num_experts, top_k)
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep
        # [forward, recomputed] bytes; a CPU tensor so that compiled code can count into it.
        self.exchanged_bytes = torch.zeros(2, dtype=torch.int64)

    @property
    def bytes_sent(self) -> int:
        return int(self.exchanged_bytes[0])

    @property
    def bytes_recomputed(self) -> int:
        return int(self.exchanged_bytes[1])

    def dispatch(self, tokens: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                 counts: torch.Tensor, score_before_experts: bool, real: torch.Tensor | None = None) -> Routed:
        """Sort the routed copies and launch their all-to-all to the experts' ranks. Padding
        (`real` False) goes nowhere: its copies sort after every expert's and are cut off once
        the split sizes are on the host, so its routed output is zero (`TokenDispatcher.dispatch`)."""
        group = self.ep_mesh.get_group()
        if real is not None:
            counts = copies_per_expert(selected, self.num_experts, real)  # the data's copies only
            selected = selected.masked_fill(~real.unsqueeze(-1), self.num_experts)  # padding sorts last
        # recv_counts[src, e]: rows source rank src sends for our local expert e; in flight
        # during the sort.
        recv_counts = private.all_to_all_counts(counts, group)
        routed = super().dispatch(tokens, top_scores, selected, counts, score_before_experts)
        recv_counts = recv_counts.view(self.ep, self.local_experts)
        send_splits = counts.view(self.ep, self.local_experts).sum(1)
        splits = torch.cat([send_splits, recv_counts.sum(1)]).tolist()  # the host sync (see module doc)
        send, recv = splits[: self.ep], splits[self.ep :]
        if real is not None:  # the data's copies, which lead the sorted ones
            rows = sum(send)
            routed.token_of, routed.gates, routed.rows = (t[:rows] for t in (routed.token_of, routed.gates, routed.rows))
        self._count_bytes(routed.rows, send)
        routed.exchange = Exchange(send, recv, recv_counts, launch_all_to_all(routed.rows, recv, send, group))
        return routed

    def run_experts(self, routed: Routed, experts: nn.Module) -> None:
        """Wait for the rows, run the local experts and launch the outputs' all-to-all back."""
        exchange = routed.exchange
        received = wait_all_to_all(exchange.pending)  # (sum(recv), dim), grouped by source rank
        order = _source_major_to_expert_major(exchange.recv_counts, sum(exchange.recv))
        out = self.run_local_experts(received[order], exchange.recv_counts.sum(0), experts)  # (sum(recv), dim)
        back = torch.empty_like(out)
        back[order] = out  # undo the reorder: rows grouped by source rank again
        exchange.pending = launch_all_to_all(back, exchange.send, exchange.recv, self.ep_mesh.get_group())

    def combine(self, routed: Routed) -> torch.Tensor:
        """Wait for the experts' outputs; each token's gated sum of them: (T, dim)."""
        return self._weighted_sum(routed, wait_all_to_all(routed.exchange.pending))

    def _count_bytes(self, rows: torch.Tensor, send: list[int]) -> None:
        remote = sum(send) - send[self.ep_mesh.get_local_rank()]
        # Dispatch sends `remote` rows away and combine returns as many: count both.
        count_exchanged_bytes(self.exchanged_bytes, 2 * remote * rows.shape[1] * rows.element_size())


def _source_major_to_expert_major(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Permutation taking received rows (grouped by source rank, then local expert) to
    expert-major order (by local expert, then source rank), computed on device.

    Args:
        recv_counts: (ep, local_experts) rows per (source, expert) block.
        total: recv_counts.sum() as a host int (already known from the split sizes).
    Returns:
        (total,) int64 index: expert-major row p is received row ``index[p]``.
    """
    flat = recv_counts.flatten()  # blocks in source-major order
    src_start = torch.cumsum(flat, 0) - flat  # where each block starts in the received rows
    by_expert = recv_counts.t().flatten()  # block lengths in expert-major order
    block_src_start = src_start.view_as(recv_counts).t().flatten()
    dst_start = torch.cumsum(by_expert, 0) - by_expert
    shift = torch.repeat_interleave(block_src_start - dst_start, by_expert, output_size=total)
    return torch.arange(total, device=recv_counts.device) + shift


def ep_bytes_moved(model: nn.Module) -> int:
    """All-to-all row bytes this rank has sent to other EP ranks so far, over all MoE layers:
    forward, the mirrored backward, and activation-checkpoint recomputation."""
    return sum(2 * m.dispatcher.bytes_sent + m.dispatcher.bytes_recomputed
               for m in model.moe_layers() if isinstance(m.dispatcher, AllToAllDispatcher))
