"""Context parallelism at run time: each cp rank attends for its own tokens of every sequence.

    torchrun --nproc_per_node=2 -m torchmoe train --config configs/debug_model.toml \\
        --parallelism.context_parallel_degree 2

The layout (head-tail pieces) and each layer's mode are `plan.context.CPLayout`'s, shared with
the dry run. `apply_cp` gives the model and every attention module a `ContextParallelAttention`:
the model reads the global positions of its tokens from it (RoPE, NoPE temperature tuning), the
attention modules hand it their local queries, keys and values. Everything else in a block works
token by token and needs nothing; the MoE balance loss sums its per-sequence statistics over cp;
the loss is each rank's token sum over the global token count, summed over ranks like dp.

Communication (see the layout's modes): global layers all-gather keys and values (backward sums
their gradients back: a reduce-scatter, or on gloo an all-reduce and a slice); halo layers send
the tail of a piece to the owner of the next piece point to point; local layers send nothing.
gpt-oss's sliding windows take the same modes (a halo of W - 1 keys, or the gathered keys when
a window spans more than a piece), and its sinks join each query's softmax where it is
(`nn.sink_attention`, or each document's under document masking): a piece's queries see its
prefix and its own keys as one span, packed (a copy, as document masking packs them, so that no
gathered or exchanged buffer stays alive through a view of it).
Every send is recorded in `ContextParallelAttention.sent` (forward bytes per mode), so tests
and benchmarks can count them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchmoe.distributed.process_groups import device_backend
from torchmoe.nn.attention import causal_attention, chunked_causal_attention
from torchmoe.nn.document_attention import DocumentSegments, document_attention
from torchmoe.nn.sink_attention import sink_attention
from torchmoe.plan.context import GLOBAL, HALO, LOCAL, CPLayout


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (-2) over a group, ranks in order; backward sums the
    gradients of the gathered tensor over the group and returns this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if device_backend(grad.device.type, ctx.group) == "nccl":
            chunks = list(grad.chunk(ctx.size, dim=-2))
            out = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad.chunk(ctx.size, dim=-2)[ctx.rank].contiguous(), None


class _ExchangeHalos(torch.autograd.Function):
    """Point-to-point halo exchange: send tails of this rank's key/value tensor to other ranks,
    receive halos from others; backward sends the halos' gradients back and adds the ones
    received to the tails' gradients.

    ``sends``: (global rank, start, length) slices of `kv` along dim -2 to send;
    ``recvs``: (global rank, length) halos to receive.
    Returns a copy of `kv` (for the local pieces: a rank that only sends must still run the
    backward, where its peers send it their halos' gradients) and the halos in `recvs` order.
    """

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group: dist.ProcessGroup, sends: tuple, recvs: tuple):
        ctx.group, ctx.sends, ctx.recvs = group, sends, recvs
        halos = [kv.new_empty(*kv.shape[:-2], length, kv.shape[-1]) for _, length in recvs]
        ops = [dist.P2POp(dist.isend, kv.narrow(-2, start, length).contiguous(), peer, group)
               for peer, start, length in sends]
        ops += [dist.P2POp(dist.irecv, buf, peer, group) for (peer, _), buf in zip(recvs, halos)]
        _run(ops)
        return (kv.clone(), *halos)

    @staticmethod
    def backward(ctx, kv_grad: torch.Tensor, *halo_grads: torch.Tensor | None):
        grad = kv_grad.clone()  # the copy always feeds the local pieces
        # Zeros stand in for an unused halo's gradient: the peer waits for it all the same.
        halo_grads = [g if g is not None else grad.new_zeros(*grad.shape[:-2], length, grad.shape[-1])
                      for g, (_, length) in zip(halo_grads, ctx.recvs)]
        tails = [grad.new_empty(*grad.shape[:-2], length, grad.shape[-1]) for _, _, length in ctx.sends]
        ops = [dist.P2POp(dist.isend, g.contiguous(), peer, ctx.group) for (peer, _), g in zip(ctx.recvs, halo_grads)]
        ops += [dist.P2POp(dist.irecv, buf, peer, ctx.group) for (peer, _, _), buf in zip(ctx.sends, tails)]
        _run(ops)
        for (_, start, length), g in zip(ctx.sends, tails):
            grad.narrow(-2, start, length).add_(g)
        return grad, None, None, None


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class ContextParallelAttention:
    """Attention for this cp rank's tokens (the head-tail pieces of `CPLayout`).

    Attributes:
        sent: key/value bytes this rank has sent in forward, per mode (backward sends the same
            amount of gradients back), for tests and benchmarks; counted when not compiled.
    """

    def __init__(self, layout: CPLayout, cp_mesh: DeviceMesh) -> None:
        self.layout = layout
        self.group = cp_mesh.get_group()
        self.rank = cp_mesh.get_local_rank()
        self.sent: Counter[str] = Counter()
        # Position tables per device: CP is applied on the meta device, before the model is
        # materialised.
        self._cache: dict = {}

    def _count(self, mode: str, nbytes: int) -> None:
        """Add `nbytes` to `sent[mode]`, in eager runs only: under torch.compile a Python counter
        changed by the traced code is a guard on its value, failing at every call (a recompile
        each time, until dynamo's limit sends the layer back to eager)."""
        if not torch.compiler.is_compiling():
            self.sent[mode] += nbytes

    def _cached(self, key, build):
        """`build()`, kept for the next call in eager runs. Traced by torch.compile it is not
        stored (its graph holds it): a cache filled by the first compiled step would fail that
        step's guard (the key was missing) at the second, and compile the layer again."""
        if key in self._cache:
            return self._cache[key]
        value = build()
        if not torch.compiler.is_compiling():
            self._cache[key] = value
        return value

    def positions(self, device: torch.device) -> torch.Tensor:
        """(L,) int64 global positions of the local tokens, L = seq_len / cp."""
        return self._cached(("positions", device), lambda: torch.tensor(self.layout.positions(self.rank), device=device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int | None,
               documents: DocumentSegments | None = None, *, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal (chunked when `chunk`, or within a sliding `window`, with `sinks`) attention of
        the local queries, within documents when `documents` is given.

        Args:
            q: (B, H, L, hd), k, v: (B, Hkv, L, hd) for the local tokens, L = seq_len / cp.
            documents: None, or the micro-batch's segment tables, built for this rank's calls
                (`CPLayout.attention_calls`). A piece's first document may have begun in an
                earlier piece: the keys the layer's mode brings (halo, gathered) reach back to its
                chunk's start (or its window's), so they hold that document's earlier keys
                wherever the query may see them.
            window, sinks: gpt-oss's sliding window and (H,) sink logits (`nn.sink_attention`).
        Returns:
            (B, H, L, hd).
        """
        mode, window = self.layout.mode(chunk, window), self.layout.window(window)
        attend = partial(self._attend_piece, chunk=chunk, documents=documents, window=window, sinks=sinks)
        if mode == LOCAL and documents is None:
            # Whole chunks in every piece, or a window of one key: nothing before a piece is seen.
            return chunked_causal_attention(q, k, v, chunk) if window is None else sink_attention(q, k, v, sinks, 1)
        if mode == LOCAL:
            p = self.layout.piece
            return torch.cat([attend(q.narrow(-2, slot * p, p), k.narrow(-2, slot * p, p), v.narrow(-2, slot * p, p),
                                     start=piece * p, prefix=None)
                              for slot, piece in enumerate(self.layout.pieces(self.rank))], dim=-2)
        if mode == HALO:
            return self._attend_with_halos(q, torch.stack([k, v]), chunk, window, attend)
        return self._attend_gathered(q, torch.stack([k, v]), chunk, window, mode, attend)

    @staticmethod
    def _attend_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk: int | None, start: int,
                      prefix: tuple[torch.Tensor, torch.Tensor] | None, documents: DocumentSegments | None,
                      window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """The attention of a local piece's queries at `start` over its keys after `prefix`:
        `causal_attention`, gpt-oss's `sink_attention` (the prefix and the keys packed as one
        span), or within documents. q: (B, H, p, hd), k, v: (B, Hkv, p, hd)."""
        if documents is not None:
            return document_attention(q, k, v, documents, chunk=chunk, start=start, prefix=prefix, window=window,
                                      sinks=sinks)
        if window is None and sinks is None:
            return causal_attention(q, k, v, chunk=chunk, start=start, prefix=prefix)
        # A copy in every mode, as document masking packs them: a view would keep the whole
        # exchanged or gathered buffer alive for the backward.
        if prefix is not None:
            k, v = (torch.cat([before, own], dim=-2) for before, own in zip(prefix, (k, v)))
        else:
            k, v = (t.clone(memory_format=torch.contiguous_format) for t in (k, v))
        return sink_attention(q, k, v, sinks, window)

    def _attend_gathered(self, q: torch.Tensor, kv: torch.Tensor, chunk: int | None, window: int | None, mode: str,
                         attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Keys and values of every rank, gathered and put in global order; each local piece then
        attends over its prefix (global), over its chunks up to itself or its sliding window's
        reach before it (gather), so no rank computes more than its causal share.
        kv: (2, B, Hkv, L, hd)."""
        layout, p = self.layout, self.layout.piece
        self._count(mode, (layout.cp - 1) * _bytes(kv))
        gathered = _GatherSequence.apply(kv, self.group)  # (2, B, Hkv, seq_len, hd), rank order
        order = self._cached(("order", kv.device), lambda: torch.argsort(torch.tensor(
            [pos for r in range(layout.cp) for pos in layout.positions(r)], device=kv.device)))
        gathered = gathered.index_select(-2, order)  # global position order
        outs = []
        for slot, piece in enumerate(layout.pieces(self.rank)):
            start = piece * p
            lo = start - layout.prefix(piece, chunk, window)  # where its first chunk (or window) starts
            outs.append(attend(
                q.narrow(-2, slot * p, p), gathered[0, ..., start:start + p, :], gathered[1, ..., start:start + p, :],
                chunk=None if mode == GLOBAL else chunk, start=start,
                prefix=(gathered[0, ..., lo:start, :], gathered[1, ..., lo:start, :]) if start > lo else None))
        return torch.cat(outs, dim=-2)

    def _attend_with_halos(self, q: torch.Tensor, kv: torch.Tensor, chunk: int | None, window: int | None,
                           attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Per local piece: its keys/values, with the previous piece's tail (the halo) as the
        prefix its first chunk (or sliding window) sees. kv: (2, B, Hkv, L, hd)."""
        layout, p = self.layout, self.layout.piece
        sends, recvs = [], []
        for slot, piece in enumerate(layout.pieces(self.rank)):
            nxt = piece + 1
            if nxt < 2 * layout.cp and layout.halo(nxt, chunk, window) and layout.owner(nxt) != self.rank:
                h = layout.halo(nxt, chunk, window)
                sends.append((dist.get_global_rank(self.group, layout.owner(nxt)), (slot + 1) * p - h, h))
            h = layout.halo(piece, chunk, window) if piece else 0
            if h and layout.owner(piece - 1) != self.rank:
                recvs.append((dist.get_global_rank(self.group, layout.owner(piece - 1)), h))
        self._count(HALO, sum(length for _, _, length in sends) * _bytes(kv) // kv.shape[-2])
        kv, *halos = _ExchangeHalos.apply(kv, self.group, tuple(sends), tuple(recvs))
        received = iter(halos)
        outs = []
        for slot, piece in enumerate(layout.pieces(self.rank)):
            own = kv.narrow(-2, slot * p, p)
            h = layout.halo(piece, chunk, window) if piece else 0
            if h and layout.owner(piece - 1) == self.rank:
                # The previous piece is this rank's other piece (head piece cp - 1): a view of the
                # exchange's output, so backward keeps no second copy of the keys and values.
                halo = kv.narrow(-2, (1 - slot) * p + p - h, h)
            else:
                halo = next(received) if h else None
            outs.append(attend(q.narrow(-2, slot * p, p), own[0], own[1], start=piece * p,
                               prefix=(halo[0], halo[1]) if halo is not None else None))
        return torch.cat(outs, dim=-2)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
