"""Causal attention without mask tensors: every layout's attention, as fused kernels accept it.

    python -m pytest -q tests/unit/test_attention.py

Fused GPU attention kernels refuse what a dense boolean mask expresses: flash attention takes no
mask at all, and the memory-efficient kernel no grouped-query heads. With a mask SDPA falls back
to its math kernel, which materialises the (queries x keys) score matrix in fp32. So no path here
hands attention a mask. Every attention torchmoe runs is causal, within chunks (iRoPE's chunked
layers) or over the whole prefix (NoPE layers), for a contiguous run of queries whose keys are
available from the start of the first query's chunk:

    queries at positions [start, start + n),  keys at [start, start + n) (`k`, `v`),
    plus a `prefix`: the keys at [c, start), c the start of the first query's chunk (0 without
    chunks): what the first queries see before their own position.

`causal_attention` cuts the queries at chunk boundaries. Whole chunks are independent causal
attentions: folded into the batch, one mask-free ``is_causal`` SDPA call. A last partial chunk is
one more such call. The first chunk, when it began before `start`, sees two key blocks: the
prefix, entirely (no mask), and its own keys, causally (``is_causal`` on a square block). Those
two are one `prefixed_causal_attention`: each block's attention comes from a fused kernel that
also returns its log-sum-exp, and the two are merged exactly (the softmax over both blocks):

    lse = logaddexp(lse_p, lse_d),  out = exp(lse_p - lse) * out_p + exp(lse_d - lse) * out_d.

Its backward runs each block's kernel backward with the merged output and log-sum-exp (which give
the probabilities of the whole softmax), and sums the query gradients. Which kernels run is
`attention_kernel.choose`'s rule (`nn.attention_kernels`): CUDA's flash kernel, its
memory-efficient kernel (key/value heads repeated for it), torch's CPU flash kernel or the math
definition, each called with its log-sum-exp, under the layout contract CUDA's kernels assume.

What autograd keeps for a prefixed block: q, both key/value blocks (views of the caller's
tensors), the merged output and the fp32 log-sum-exp: what a flash kernel keeps, no mask and no
score matrix (`plan.activations` counts it so).

Why not torch's public ``varlen_attn``, which takes a prefix too (FlashAttention-2 aligns its
causal mask bottom right): it wants the prefix and the block's keys in one tensor, a copy of
both per call; under context parallelism a global layer would keep that copy beside the gathered
keys it was cut from (up to 1.5x its keys and values). The public SDPA returns no log-sum-exp,
so the two kernels are private aten operators (`torchmoe._torch_private`, called only under the
contract); the op is a custom operator, so torch.compile and selective activation checkpointing
see one node. Document masking, whose segments only cumulative lengths express, does use
``varlen_attn`` (`nn.segment_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchmoe.nn.attention_kernels import accumulation_dtype, prefixed_block_backward, prefixed_block_forward

__all__ = ["PREFIXED_ATTENTION", "causal_attention", "chunked_causal_attention", "prefixed_causal_attention"]

def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal attention within consecutive chunks of `chunk` tokens (the length a multiple of it).

    Independent causal attention per chunk: the chunks are folded into the batch for the
    mask-free causal kernel. q: (B, H, S, hd), k, v: (B, Hkv, S, hd) -> (B, H, S, hd).
    """
    bsz, heads, seq_len, hd = q.shape
    fold = lambda t: t.reshape(bsz, t.shape[1], seq_len // chunk, chunk, hd).transpose(1, 2).reshape(
        -1, t.shape[1], chunk, hd)
    out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), is_causal=True, enable_gqa=True)
    return out.reshape(bsz, seq_len // chunk, heads, chunk, hd).transpose(1, 2).reshape(bsz, heads, seq_len, hd)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk: int | None = None,
                     start: int = 0, prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention (within chunks of `chunk` positions when given) of queries at positions
    ``[start, start + n)``, without a mask tensor (module docstring).

    Args:
        q: (B, H, n, hd) queries; k, v: (B, Hkv, n, hd) the keys and values at the same positions.
        chunk: chunk length (chunks start at multiples of it); None: one causal span from 0.
        start: the global position of the first query.
        prefix: (k, v), each (B, Hkv, m, hd): the keys and values at ``[start - m, start)``, where
            ``start - m`` is the start of the first query's chunk (0 without chunks). None when
            m = 0 (`start` begins a chunk, or is 0).
    Returns:
        (B, H, n, hd).
    """
    n = q.shape[-2]
    m = prefix[0].shape[-2] if prefix is not None else 0
    expected = start % chunk if chunk is not None else start
    if m != expected:
        raise ValueError(f"causal_attention: queries from position {start} (chunk {chunk}) see {expected} earlier "
                         f"keys, but the prefix holds {m}")
    # The first chunk's queries (those before the next chunk boundary) see the prefix.
    head = min(n, chunk - start % chunk if chunk is not None else n) if m else 0
    outs = []
    if head:
        outs.append(prefixed_causal_attention(q[..., :head, :], *prefix, k[..., :head, :], v[..., :head, :]))
    rest = n - head
    whole = rest // chunk * chunk if chunk is not None else 0  # whole chunks after the first
    if whole:
        span = slice(head, head + whole)
        outs += _whole_chunks(q[..., span, :], k[..., span, :], v[..., span, :], chunk)
    if rest > whole:
        span = slice(head + whole, n)
        outs.append(_causal(q[..., span, :], k[..., span, :], v[..., span, :]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _whole_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Outputs of independent causal attentions over consecutive whole chunks: one folded call
    when folding the chunks into the batch is a view of q, k and v; else one call per chunk (on a
    slice of a longer sequence, folding would copy q, k and v, and backward would keep the copies).
    q: (B, H, W, hd), k, v: (B, Hkv, W, hd), W a multiple of `chunk`."""
    if all(_foldable(t) for t in (q, k, v)):
        return [chunked_causal_attention(q, k, v, chunk)]
    return [_causal(q[..., i:i + chunk, :], k[..., i:i + chunk, :], v[..., i:i + chunk, :])
            for i in range(0, q.shape[-2], chunk)]


def _foldable(t: torch.Tensor) -> bool:
    """(B, heads, W, hd) -> (B * chunks, heads, chunk, hd) is a view: the batch stride spans W rows."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[-2] * t.stride(-2)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal SDPA of a square block (the kernel's own mask-free causal mode)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def prefixed_causal_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> torch.Tensor:
    """Queries that see every key of a prefix block and their own block causally.

    Args:
        q: (B, H, n, hd); k_prefix, v_prefix: (B, Hkv, m, hd), seen entirely; k, v: (B, Hkv, n, hd)
            at the queries' own positions, seen causally.
    Returns:
        (B, H, n, hd): softmax attention over the m + n keys (the key at the query's position last).
    """
    return torch.ops.torchmoe.prefixed_causal_attention(q, k_prefix, v_prefix, k, v)[0]


# ---- the custom operator ----------------------------------------------------------------------


@torch.library.custom_op("torchmoe::prefixed_causal_attention", mutates_args=())
def _prefixed_forward(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, n, hd) in q's dtype, lse (B, H, n) fp32): `prefixed_causal_attention` and the
    log-sum-exp of its scores (what the backward needs)."""
    # The result is contiguous whatever layout the kernels chose, as the fake kernel promises.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, prefixed_block_forward(q, k_prefix, v_prefix, k, v, out)


@_prefixed_forward.register_fake
def _(q, k_prefix, v_prefix, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1],
                                                                                   dtype=accumulation_dtype(q))


@torch.library.custom_op("torchmoe::prefixed_causal_attention_backward", mutates_args=())
def _prefixed_backward(grad: torch.Tensor, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """Gradients [dq, dk_prefix, dv_prefix, dk, dv] of `prefixed_causal_attention` for the output
    gradient `grad` (B, H, n, hd), from the forward's merged `out` and `lse`."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grads = prefixed_block_backward(grad, q, k_prefix, v_prefix, k, v, out, lse, dq)
    # Contiguous, as the fake kernel promises (the kernels return their own layouts).
    return [dq, *(g.contiguous() for g in grads)]


@_prefixed_backward.register_fake
def _(grad, q, k_prefix, v_prefix, k, v, out, lse):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k_prefix, v_prefix, k, v)]


def _setup_context(ctx, inputs, output) -> None:
    out, lse = output
    ctx.save_for_backward(*inputs, out, lse)


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
    # The log-sum-exp is an output for the backward's sake only: nothing differentiates it.
    return tuple(torch.ops.torchmoe.prefixed_causal_attention_backward(grad_out.contiguous(), *ctx.saved_tensors))


_prefixed_forward.register_autograd(_backward, setup_context=_setup_context)
# The operator as dispatch modes see it (selective activation checkpointing's policy saves it).
PREFIXED_ATTENTION = torch.ops.torchmoe.prefixed_causal_attention.default
