"""Muon's orthogonalisation of a DTensor update: gather each matrix whole, orthogonalise it on
every rank that holds a piece of it, keep this rank's piece.

    ortho = orthogonalize(update, ns, dtype)   # update: a tensor or DTensor of a Muon parameter

Newton-Schulz needs whole matrices (its Gram matrices mix every row and column). For each mesh
dim of a parameter's placements:

- ``Replicate``: nothing to do;
- ``Shard(0)`` (or ``_StridedShard(0)``) of an expert stack ``(experts, out, in)``: expert
  parallel, or FSDP of the experts, splits the stack between whole experts, so nothing to do;
- any other shard (FSDP's rows, TP's column- or row-wise split, FSDP of the experts' hidden dim)
  splits matrices: all-gathered over that mesh dim.

The gathered update is cast to the NS dtype first (the NS's first op, so the result is the same)
and, after the NS, each rank keeps its own piece of the result (a slice, no communication).

Why gather per matrix rather than owner-computes (each matrix sent whole to one owning rank,
orthogonalised there and scattered back): every placement DTensor supports (FSDP and HSDP,
strided FSDP+TP, uneven shards, TP's column- and row-wise splits, expert stacks split by EP and
by FSDP on either dim) is handled by one ``redistribute``, with no assignment of matrices to
owners to balance; every rank runs the same NS on the same whole matrix as the single process,
so the step equals it whatever the layout. The cost is that the NS runs on every rank of the
group splitting a matrix (n times the flops of owner-computes) and the all-gather moves more data
in total: per rank and step it receives, for every Muon parameter split n ways (n: the product of
the sizes of the mesh dims that split its matrices; P: the elements of what is gathered, the
EP-local stack for experts) ``b * (n - 1) / n * P`` bytes, b the NS dtype's bytes (2 for bf16):
the size of one more bf16 FSDP all-gather of the Muon parameters per step. Owner-computes
receives ``b * (n - 1) / n * P`` at the owner and sends as much back, spread over the ranks:
about ``2 / n`` of the gather's total traffic, for n times less NS work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate

from torchmoe import _torch_private as private

__all__ = ["orthogonalize", "whole_matrix_placements"]


def whole_matrix_placements(placements: tuple[Placement, ...], ndim: int) -> tuple[Placement, ...]:
    """`placements` with every shard that splits a matrix replaced by ``Replicate``: a shard of
    dim 0 of an expert stack (`ndim` 3) splits between whole experts and is kept."""
    strided = private.strided_shard_type()

    def splits_matrices(p: Placement) -> bool:
        if not (p.is_shard() or isinstance(p, strided)):
            return False
        return not (ndim == 3 and p.dim == 0)

    return tuple(Replicate() if splits_matrices(p) else p for p in placements)


def orthogonalize(update: torch.Tensor, ns: Callable[[torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """`ns` (Newton-Schulz over whole matrices) applied to `update` (module docstring).

    Args:
        update: a (rows, cols) matrix or (experts, rows, cols) stack, or a DTensor of one.
        ns: takes and returns local whole matrices (or stacks of them) in `dtype`.
        dtype: the NS dtype; a DTensor is cast to it before the gather.
    Returns:
        `ns`'s result: for a DTensor, a DTensor of `update`'s placements (this rank's piece).
    """
    if not isinstance(update, DTensor):
        return ns(update)
    mesh, placements = update.device_mesh, update.placements
    whole = whole_matrix_placements(placements, update.ndim)
    local = update.to(dtype).redistribute(mesh, whole).to_local()
    ortho = ns(local).contiguous()
    gathered = DTensor.from_local(ortho, mesh, whole, run_check=False, shape=update.shape,
                                  stride=_contiguous_stride(update.shape))
    return gathered.redistribute(mesh, placements)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The contiguous stride of `shape`."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))

