"""An all-to-all in two autograd nodes, launch and wait, so compute placed between them overlaps
the exchange in forward, and the same compute's backward overlaps the reverse exchange.

    pending = launch_all_to_all(x, out_splits, in_splits, group)   # returns at once
    ...work that does not need the exchanged rows...
    y = wait_all_to_all(pending)                                     # (sum(out_splits), ...)

Backward runs the pair in reverse: the wait's backward launches the gradient's all-to-all and
the launch's backward waits for it. The autograd engine runs, of the nodes ready, the most
recently created first; the nodes of the work between launch and wait were created between the
two, so (their gradients being ready: they come from the same output) their backward runs while
the gradient is in flight.

Both nodes are functional collectives (``_c10d_functional.all_to_all_single`` and
``wait_tensor``): in eager the collective runs on the process group's own thread (gloo) or stream
(NCCL) until waited on; torch.compile traces the pair into its graph, launch and wait as separate
nodes, and keeps the work between them where the compiler preserves the program's order (see
`torchmoe.distributed.compile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchmoe import _torch_private as private

_c10d = private.functional_collectives


@dataclass
class PendingAllToAll:
    """An all-to-all under way: `rows` must not be read before `wait_all_to_all`.

    rows: (sum(out_splits), ...) the receive buffer, filled by the collective.
    origin: a view of the sent tensor (kept alive and unchanged until the wait, see `_Wait`); in
        backward it carries the gradient's exchange, launched by the wait node, back to the
        launch node that waits for it.
    out_splits, in_splits: rows received from / sent to each rank.
    group_name: the process group's registered name.
    """

    rows: torch.Tensor
    origin: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]
    group_name: str


def launch_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      group: dist.ProcessGroup) -> PendingAllToAll:
    """Start exchanging the rows of `x` (sum(in_splits), ...): rank r gets the next
    ``in_splits[r]`` rows; ``out_splits[r]`` rows arrive from rank r."""
    rows, origin = _Launch.apply(x, out_splits, in_splits, group.group_name)
    return PendingAllToAll(rows, origin, out_splits, in_splits, group.group_name)


def wait_all_to_all(pending: PendingAllToAll) -> torch.Tensor:
    """The received rows (sum(out_splits), ...) of `pending`, once they have arrived."""
    return _Wait.apply(pending.rows, pending.origin, pending.out_splits, pending.in_splits, pending.group_name)


class _Launch(torch.autograd.Function):
    """Forward: launch the exchange. Backward: wait for the gradient's exchange (launched by
    `_Wait`'s backward) and return it as the input's gradient."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group_name):
        x = x.contiguous()
        return _c10d.all_to_all_single(x, out_splits, in_splits, group_name), x.view_as(x)

    @staticmethod
    def backward(ctx, sent_grad, grad_in_flight):
        return _c10d.wait_tensor(grad_in_flight), None, None, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange. Backward: launch the gradient's exchange (reverse splits)
    and pass it, still in flight, to `_Launch`'s backward as `origin`'s gradient.

    A sent buffer must not be overwritten before its exchange completes, and compiled code reuses
    a buffer once its last reader has run: inductor counts a collective's wait as a reader of the
    collective's input only when the wait is in the same graph. So each sent buffer travels with
    the exchange to the node that waits: in forward `origin` is a view of the sent rows, in
    backward the sent gradient is returned as the receive buffer's gradient (which `_Launch`'s
    backward drops).
    """

    @staticmethod
    def forward(ctx, rows, origin, out_splits, in_splits, group_name):
        ctx.reverse = (in_splits, out_splits, group_name)
        return _c10d.wait_tensor(rows)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group_name = ctx.reverse
        grad = grad.contiguous()
        return grad, _c10d.all_to_all_single(grad, in_splits, out_splits, group_name), None, None, None
