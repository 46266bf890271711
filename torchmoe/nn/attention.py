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
the probabilities of the whole softmax), and sums the query gradients. Kernels: on CPU torch's
flash kernel; on CUDA flash attention for fp16/bf16 (grouped-query heads natively), else the
memory-efficient kernel (key/value heads repeated for it); elsewhere the math definition.

What autograd keeps for a prefixed block: q, both key/value blocks (views of the caller's
tensors), the merged output and the fp32 log-sum-exp: what a flash kernel keeps, no mask and no
score matrix (`plan.memory` counts it so).

The kernels are private aten operators (the public SDPA returns no log-sum-exp; they are
`torchmoe._torch_private`'s); the op is a custom operator, so torch.compile and selective
activation checkpointing see one node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchmoe import _torch_private as private

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


def prefixed_block_forward(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes `prefixed_causal_attention` of q into `out` (B, H, n, hd) and returns the log-sum-exp
    (B, H, n) of its scores, in the accumulation dtype: each block by its fused kernel, merged."""
    out_p, lse_p = block_forward(q, k_prefix, v_prefix, causal=False)
    out_d, lse_d = block_forward(q, k, v, causal=True)
    lse = torch.logaddexp(lse_p, lse_d).contiguous()
    # Weights exp(lse_i - lse) in (0, 1]: each block's share of the softmax's denominator.
    acc = accumulation_dtype(q)
    out.copy_(torch.exp(lse_p - lse).unsqueeze(-1) * out_p.to(acc) + torch.exp(lse_d - lse).unsqueeze(-1) * out_d.to(acc))
    return lse


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


def prefixed_block_backward(grad: torch.Tensor, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            dq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Writes the query gradient of `prefixed_causal_attention` into `dq` and returns
    (dk_prefix, dv_prefix, dk, dv): each block's kernel backward with the merged `out` and `lse`."""
    dq_p, dk_p, dv_p = block_backward(grad, q, k_prefix, v_prefix, out, lse, causal=False)
    dq_d, dk_d, dv_d = block_backward(grad, q, k, v, out, lse, causal=True)
    dq.copy_(dq_p.to(accumulation_dtype(q)) + dq_d.to(accumulation_dtype(q)))
    return dk_p, dv_p, dk_d, dv_d


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


# ---- one key block: a fused kernel and its log-sum-exp ------------------------------------------


def accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """What log-sum-exps and merges are computed in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _flash_on_cuda(q: torch.Tensor) -> bool:
    """CUDA's flash kernel takes this query: fp16/bf16, head_dim a multiple of 8 up to 256."""
    hd = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256 and \
        torch.backends.cuda.flash_sdp_enabled()


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, S, hd) -> (B, heads, S, hd): each key/value head for its group of query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: (B, H, S, hd) summed over each group -> (B, Hkv, S, hd)."""
    b, h, s, hd = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, hd).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key block: (out (B, H, n, hd), lse (B, H, n) fp32)."""
    n = q.shape[-2]
    if q.device.type == "cpu":
        out, lse = private.flash_attention_cpu(q, k, v, causal)
    elif q.device.type == "cuda" and _flash_on_cuda(q):
        out, lse = private.flash_attention_cuda(q, k, v, causal)
    elif q.device.type == "cuda" and torch.backends.cuda.mem_efficient_sdp_enabled():
        heads = q.shape[1]
        out, lse = private.efficient_attention_cuda(q, _repeat_heads(k, heads), _repeat_heads(v, heads), causal)
        lse = lse[..., :n]  # the kernel pads the log-sum-exp's length to a multiple of 32
    else:
        return _math_forward(q, k, v, causal=causal)
    return out, lse.to(accumulation_dtype(q))


def block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one key block's share of an attention whose whole output and log-sum-exp
    are `out` and `lse`: the kernel recomputes the probabilities from `lse`, so they are the
    merged softmax's, and ``D = rowsum(grad * out)`` is the merged output's."""
    if q.device.type == "cpu":
        return private.flash_attention_cpu_backward(grad, q, k, v, out, lse, causal)
    if q.device.type == "cuda" and _flash_on_cuda(q):
        return private.flash_attention_cuda_backward(grad, q, k, v, out, lse, causal)
    if q.device.type == "cuda" and torch.backends.cuda.mem_efficient_sdp_enabled():
        heads, kv_heads = q.shape[1], k.shape[1]
        padded = F.pad(lse, (0, -q.shape[-2] % 32))  # the kernel's own layout of it (see `block_forward`)
        dq, dk, dv = private.efficient_attention_cuda_backward(grad, q, _repeat_heads(k, heads),
                                                               _repeat_heads(v, heads), out, padded, causal)
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)
    return _math_backward(grad, q, k, v, out, lse, causal=causal)


# ---- the math definition (devices without a fused kernel, and the reference) ----------------------


def _probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, *, causal: bool):
    """Scores (B, H, n, m) of q against k (heads repeated) in the accumulation dtype, causal on
    a square block, and exp(scores - lse) when `lse` is given."""
    acc = accumulation_dtype(q)
    scores = q.to(acc) @ _repeat_heads(k, q.shape[1]).to(acc).transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores if lse is None else torch.exp(scores - lse.unsqueeze(-1))


def _math_forward(q, k, v, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _probabilities(q, k, None, causal=causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ _repeat_heads(v, q.shape[1]).to(scores.dtype)
    return out.to(q.dtype), lse


def _math_backward(grad, q, k, v, out, lse, *, causal: bool):
    p = _probabilities(q, k, lse, causal=causal)  # (B, H, n, m), the merged softmax's share
    acc = p.dtype
    g, vx = grad.to(acc), _repeat_heads(v, q.shape[1]).to(acc)
    dv = p.transpose(-2, -1) @ g
    ds = p * (g @ vx.transpose(-2, -1) - (g * out.to(acc)).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = ds @ _repeat_heads(k, q.shape[1]).to(acc)
    dk = ds.transpose(-2, -1) @ q.to(acc)
    kv_heads = k.shape[1]
    return dq.to(q.dtype), _sum_heads(dk, kv_heads).to(k.dtype), _sum_heads(dv, kv_heads).to(v.dtype)
