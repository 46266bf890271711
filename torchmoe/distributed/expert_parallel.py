"""Expert parallelism: routed experts sharded over ``ep``, tokens exchanged with all-to-all.

Each EP rank holds ``num_experts / ep`` consecutive experts. Per MoE layer and micro-batch:

    1. route locally, sort routed copies by global expert id          (no communication)
    2. all-to-all the per-expert counts (E,) -> who sends how much     (one small exchange)
    3. read the split sizes on the host                                (the one host sync: the
                                                                        all-to-all needs them)
    4. all-to-all the rows; reorder them expert-major for the grouped GEMM
    5. run the local experts; undo the reorder; all-to-all back        (autograd reverses 4-5)

Dropless: every routed copy is sent, however unbalanced the routing. With TP, EP borrows the TP
ranks: each rank dispatches the tokens of its own sequence shard (no all-gather in the MoE
block), and the router gate and shared experts, replicated over ``tp``, see token-sharded inputs
so their gradients are summed over ``tp``.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchmoe.models.llama4.moe import GroupedExperts, TokenDispatcher


class AllToAllDispatcher(TokenDispatcher):
    """`TokenDispatcher` whose expert step exchanges rows with the EP ranks owning the experts.

    Counts the row bytes this rank sends to other ranks: `bytes_sent` in forward passes (the
    backward all-to-alls mirror them, moving the same bytes), `bytes_recomputed` when activation
    checkpointing re-runs the forward inside backward.
    """

    def __init__(self, num_experts: int, top_k: int, ep_mesh: DeviceMesh) -> None:
        super().__init__(num_experts, top_k)
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep
        self.bytes_sent = 0
        self.bytes_recomputed = 0

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """rows: (R, dim) sorted by global expert, counts: (E,) -> (R, dim) expert outputs."""
        group = self.ep_mesh.get_group()
        # recv_counts[src, e]: rows source rank src sends for our local expert e.
        recv_counts = funcol.all_to_all_single(counts, None, None, group).view(self.ep, self.local_experts)
        send_splits = counts.view(self.ep, self.local_experts).sum(1)
        splits = torch.cat([send_splits, recv_counts.sum(1)]).tolist()  # the host sync (see module doc)
        send, recv = splits[: self.ep], splits[self.ep :]
        received = funcol.all_to_all_single_autograd(rows, recv, send, group)  # (sum(recv), dim)

        order = _source_major_to_expert_major(recv_counts, sum(recv))
        out = self.run_local_experts(received[order], recv_counts.sum(0), experts)  # (sum(recv), dim)
        back = torch.empty_like(out)
        back[order] = out  # undo the reorder: rows grouped by source rank again
        self._count_bytes(rows, send)
        return funcol.all_to_all_single_autograd(back, send, recv, group)

    def _count_bytes(self, rows: torch.Tensor, send: list[int]) -> None:
        me = self.ep_mesh.get_local_rank()
        remote = sum(n for r, n in enumerate(send) if r != me)
        # Dispatch sends `remote` rows away and combine returns as many: count both.
        moved = 2 * remote * rows.shape[1] * rows.element_size()
        if torch._C._current_graph_task_id() == -1:
            self.bytes_sent += moved
        else:  # inside backward: an activation-checkpoint recomputation
            self.bytes_recomputed += moved


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


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, tp_mesh: DeviceMesh | None) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh` (``Shard(0)``: whole experts per
    rank) and install the all-to-all dispatcher. With `tp_mesh`, make the router gate and
    shared experts replicated DTensors on ``tp`` fed token-sharded inputs (see module doc)."""
    from torchmoe.distributed.tensor_parallel import ReplicateParallel

    for moe in model.moe_layers():
        experts = moe.experts
        if moe.num_experts % ep_mesh.size():
            raise ValueError(f"num_experts ({moe.num_experts}) is not divisible by ep ({ep_mesh.size()})")
        for name in ("w1", "w2", "w3"):
            param = getattr(experts, name)
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        moe.dispatcher = AllToAllDispatcher(moe.num_experts, moe.top_k, ep_mesh)
        if tp_mesh is not None:
            moe.sequence_shard_groups.append(tp_mesh.get_group())
            ReplicateParallel(input_layout=Shard(0))._apply(moe.router.gate, tp_mesh)
            if moe.shared_experts is not None:
                ReplicateParallel(input_layout=Shard(0))._apply(moe.shared_experts, tp_mesh)


def ep_bytes_moved(model: nn.Module) -> int:
    """All-to-all row bytes this rank has sent to other EP ranks so far, over all MoE layers:
    forward, the mirrored backward, and activation-checkpoint recomputation."""
    return sum(2 * m.dispatcher.bytes_sent + m.dispatcher.bytes_recomputed
               for m in model.moe_layers() if isinstance(m.dispatcher, AllToAllDispatcher))
