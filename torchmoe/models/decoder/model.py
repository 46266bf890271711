"""The mixture-of-experts decoder every family builds (`ModelArgs` says which options it uses):
GQA attention (Llama 4's iRoPE, chunks and QK L2-norm; Qwen3's per-head QK RMSNorm and half-split
RoPE), interleaved dense and MoE feed-forward.

    python -c "import torch; from torchmoe.models.llama4 import Transformer, FLAVORS; \\
        m = Transformer(FLAVORS['tiny']); m.init_weights(seed=0); print(m(torch.zeros(1, 8, dtype=torch.long)).shape)"

Numerics follow each family's Hugging Face model operation for operation (``Llama4ForCausalLM``:
norms and rotary embeddings in fp32, interleaved-pair complex RoPE, QK L2-norm after RoPE,
temperature tuning of NoPE queries; ``Qwen3MoeForCausalLM``: RMSNorm of each q/k head before
half-split RoPE), so logits match them to fp32 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.decoder.moe import MoE
from torchmoe.nn.attention import causal_attention
from torchmoe.nn.document_attention import DocumentSegments, document_attention
from torchmoe.nn.experts import FeedForward
from torchmoe.nn.init import ONES, Normal, ParamInit, TruncNormal, init_parameters, prefixed
from torchmoe.nn.kv_cache import KVCache
from torchmoe.regions import region


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalised in fp32 and cast back before the weight (as HF does)."""

    def __init__(self, dim: int, eps: float, *, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight if self.weight is not None else out

    def param_inits(self) -> dict[str, ParamInit]:
        return {"weight": ONES} if self.weight is not None else {}


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) fp32, with Llama 3's long-context scaling.

    llama3 scaling divides low frequencies (wavelength > original_max / low_freq_factor) by
    ``factor``, keeps high frequencies, and interpolates smoothly in between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low) if high != low else torch.zeros_like(wavelen)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def precompute_freqs_cis(args: ModelArgs, seq_len: int, device: torch.device | None = None, *,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    """Complex rotations (S, head_dim // 2) for positions 0..seq_len-1, or for `positions` (S,)."""
    inv_freq = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    freqs = torch.outer(positions.float(), inv_freq)  # (S, hd/2)
    return torch.polar(torch.ones_like(freqs), freqs)


def _rotate(x: torch.Tensor, fc: torch.Tensor, style: str) -> torch.Tensor:
    """`x` (B, S, H, hd) rotated by `fc` (1, S, 1, hd/2) complex, pairs as `style` says."""
    if style == "interleaved":
        out = torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * fc)
        return out.flatten(3).type_as(x)
    # "half": pair i is (x_i, x_{i + hd/2}); the real and imaginary parts go back to the halves.
    half = x.shape[-1] // 2
    pairs = torch.stack((x[..., :half].float(), x[..., half:].float()), dim=-1)  # (B, S, H, hd/2, 2)
    out = torch.view_as_real(torch.view_as_complex(pairs) * fc)
    return torch.cat((out[..., 0], out[..., 1]), dim=-1).type_as(x)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, style: str = "interleaved"):
    """Rotate pairs of q/k coordinates: interleaved (x0, x1), (x2, x3), ... (Llama 4), or half-split
    (x_i, x_{i + hd/2}) (Qwen3, Hugging Face's `rotate_half`).

    xq: (B, S, H, hd), xk: (B, S, Hkv, hd), freqs_cis: (S, hd/2) complex. (Complex, not real
    (cos, sin) pairs: FSDP's and DDP's mixed precision cast every floating-point argument of a
    block to the compute dtype, and complex tensors are left alone.)
    """
    fc = freqs_cis[None, :, None, :]  # (1, S, 1, hd/2)
    return _rotate(xq, fc, style), _rotate(xk, fc, style)


class Attention(nn.Module):
    """Grouped-query attention.

    RoPE layers: rotary embeddings, QK L2-norm (``use_qk_norm``), causal attention within chunks
    of ``attention_chunk_size``. NoPE layers: no rotation, full causal attention, queries scaled by
    ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (temperature tuning).
    ``qk_rms_norm``: each query and key head is RMS-normalised with a learned (hd,) weight
    (`q_norm`, `k_norm`) before RoPE.
    """

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.use_rope = args.rope_layers[layer_id]
        self.rope_style = args.rope_style
        self.qk_norm = RMSNorm(args.head_dim, args.norm_eps, elementwise_affine=False) if (
            args.use_qk_norm and self.use_rope) else None
        self.chunk_size = args.layer_chunk(layer_id)
        self.temperature = (args.floor_scale, args.attn_scale) if (
            args.attn_temperature_tuning and not self.use_rope) else None
        self.attn_backend = args.attn_backend
        # Set by context parallelism (`distributed/context_parallel.py`): the local tokens' global
        # positions and the attention over the context they need.
        self.context_parallel = None
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Learned per-head norms (Qwen3); under tensor parallel each rank normalises its own heads.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_rms_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_rms_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: DocumentSegments | None = None,
                cache: KVCache | None = None, name: str = "") -> torch.Tensor:
        """x: (B, S, dim), freqs_cis: (S, hd/2) complex, documents: None, or with document
        masking the micro-batch's segment tables (`nn.document_attention`) -> (B, S, dim).
        cache: decoding (`nn.kv_cache`): x holds positions ``[cache.length, + S)``, and this
        layer (`name`) adds its keys and values to the cache and attends over the cached ones."""
        bsz, seq_len, _ = x.shape
        # -1 head counts: under tensor parallel each rank holds a slice of the heads.
        xq = self.wq(x).view(bsz, seq_len, -1, self.head_dim)  # (B, S, H, hd)
        xk = self.wk(x).view(bsz, seq_len, -1, self.head_dim)  # (B, S, Hkv, hd)
        xv = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis, self.rope_style)
        if self.qk_norm is not None:
            xq, xk = self.qk_norm(xq), self.qk_norm(xk)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            cp = self.context_parallel
            start = cache.length if cache is not None else 0
            pos = (cp.positions(x.device) if cp is not None else
                   torch.arange(start, start + seq_len, device=x.device)).float()
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0  # (S,)
            xq = (xq * scale.view(1, seq_len, 1, 1)).to(xq.dtype)
        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H, S, hd)
        if cache is not None:
            out = self._attend_cached(q, k, v, cache, name)
        else:
            out = self._attend(q, k, v, documents)  # (B, H, S, hd)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: DocumentSegments | None) -> torch.Tensor:
        if self.context_parallel is not None:
            return self.context_parallel.attend(q, k, v, self.chunk_size, documents)
        if documents is not None:
            return document_attention(q, k, v, documents, chunk=self.chunk_size)
        seq_len = q.shape[2]
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < seq_len else None
        if self.attn_backend == "flex":
            return _flex_attention(q, k, v, chunk)
        return causal_attention(q, k, v, chunk=chunk)

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                       name: str) -> torch.Tensor:
        """Queries at ``[L, L + S)`` (L = cache.length) over the cached keys from the first query's
        chunk start (or 0) as the prefix, and their own causally: training's attention over a
        piece of the row, so the logits are the full forward's."""
        start = cache.length
        first = start // self.chunk_size * self.chunk_size if self.chunk_size is not None else 0
        prefix = cache.append(name, k, v, keep_from=first)
        return causal_attention(q, k, v, chunk=self.chunk_size, start=start,
                                prefix=prefix if start > first else None)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Projections into heads at std 0.02; the output projection at the block's depth-scaled std;
        per-head norms at 1."""
        inits = {"wq.weight": TruncNormal(0.02), "wk.weight": TruncNormal(0.02), "wv.weight": TruncNormal(0.02),
                 "wo.weight": TruncNormal(init_std)}
        if self.q_norm is not None:
            inits.update({**prefixed("q_norm", self.q_norm.param_inits()),
                          **prefixed("k_norm", self.k_norm.param_inits())})
        return inits


_BLOCK_MASKS: dict = {}
_MAX_ROPE_CACHE = 65536


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """FlexAttention with a (chunked) causal block mask, cached per (length, chunk, device)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seq_len = q.shape[2]
    key = (seq_len, chunk, q.device)
    if key not in _BLOCK_MASKS:
        if chunk is None:
            mask_mod = lambda b, h, qi, ki: qi >= ki
        else:
            mask_mod = lambda b, h, qi, ki: (qi >= ki) & (qi // chunk == ki // chunk)
        _BLOCK_MASKS[key] = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=q.device)
    return flex_attention(q, k, v, block_mask=_BLOCK_MASKS[key], enable_gqa=True)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn_or_moe(norm(h))``."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, layer_id)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of output projections keeps the residual stream's variance bounded.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: DocumentSegments | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """x: (B, S, dim), freqs_cis: (S, hd/2) complex, documents and cache: as
        `Attention.forward`'s -> (B, S, dim)."""
        normed = self.attention_norm(x)
        with region("attention"):
            if cache is None:
                h = x + self.attention(normed, freqs_cis, documents)
            else:
                h = x + self.attention(normed, freqs_cis, cache=cache, name=str(self.layer_id))
        normed = self.ffn_norm(h)
        if not self.moe_enabled:
            return h + self.feed_forward(normed)
        # What the MoE layer runs outside its experts' own regions (routed and shared) is routing,
        # dispatch and combine.
        with region("router"):
            return h + self.moe(normed)

    def param_inits(self) -> dict[str, ParamInit]:
        ffn_name = "moe" if self.moe_enabled else "feed_forward"
        return {**prefixed("attention_norm", self.attention_norm.param_inits()),
                **prefixed("ffn_norm", self.ffn_norm.param_inits()),
                **prefixed("attention", self.attention.param_inits(self.weight_init_std)),
                **prefixed(ffn_name, getattr(self, ffn_name).param_inits(self.weight_init_std))}


class Transformer(nn.Module):
    """Token embedding -> blocks -> final norm -> output head.

    ``layers`` is a ModuleDict keyed by the global layer index so pipeline stages can drop layers
    (and set ``tok_embeddings`` / ``norm`` / ``output`` to None; a stage without ``norm`` returns
    hidden states) while names stay stable for checkpoints.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward rather than sharing a Parameter:
        # shared Parameters come apart under to_empty() and per-module sharding.
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: derived from args, recomputed by init_weights on the real device. Capped
        # because released configs advertise up to 10M positions (gigabytes of table).
        self.register_buffer("freqs_cis", precompute_freqs_cis(args, self._rope_cache_len()), persistent=False)
        # Set by context parallelism: the global positions of this rank's tokens.
        self.context_parallel = None
        # Set by the parallelize pipeline when no FSDP/DDP policy casts the parameters and the
        # compute dtype is below theirs: forward runs under torch.autocast in this dtype (None:
        # in the parameters' dtype).
        self.autocast_dtype: torch.dtype | None = None

    def _rope_cache_len(self) -> int:
        return min(self.args.max_seq_len, _MAX_ROPE_CACHE)

    def forward(self, tokens: torch.Tensor, documents: DocumentSegments | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens: (B, S) int64 ids (or (B, S, dim) hidden states on later pipeline stages)
        -> logits (B, S, vocab) (or hidden states when this stage has no output head).

        documents: None (causal attention over the row), or document masking: the micro-batch's
        segment tables (`nn.document_attention.document_segments` of the whole rows' document
        starts, built on the host). Positions stay global: RoPE counts from the row start
        either way.

        cache: decoding (`nn.kv_cache.KVCache`): `tokens` are the positions after the cached
        ones; every layer appends its keys and values, and the logits equal the full forward's
        at those positions.

        Under ``autocast_dtype`` the logits come out in it and the hidden states in fp32 (the
        residual stream is a sum autocast leaves in fp32); the loss upcasts the logits."""
        if self.autocast_dtype is None:
            return self._forward(tokens, documents, cache)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype):
            return self._forward(tokens, documents, cache)

    def _forward(self, tokens: torch.Tensor, documents: DocumentSegments | None, cache: KVCache | None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        start = cache.length if cache is not None else 0
        freqs_cis = self._rotations(start + h.shape[1])[start:]
        for layer in self.layers.values():
            h = layer(h, freqs_cis, documents) if cache is None else layer(h, freqs_cis, cache=cache)
        if cache is not None:
            cache.advance(h.shape[1])
        if self.norm is None:  # not the last pipeline stage
            return h
        h = self.norm(h)
        if self.output is None:  # tied embeddings
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def _rotations(self, seq_len: int) -> torch.Tensor:
        """RoPE rotations (S, hd/2) complex of this rank's tokens: positions 0..S-1, or under
        context parallelism the global positions of the local pieces."""
        table = self.freqs_cis
        if self.context_parallel is not None:
            positions = self.context_parallel.positions(table.device)
            # The layout's length, not positions.max(): reading a device value would sync the host.
            if self.context_parallel.layout.seq_len <= table.shape[0]:
                return table[positions]
            return precompute_freqs_cis(self.args, seq_len, table.device, positions=positions)
        if seq_len <= table.shape[0]:
            return table[:seq_len]
        # Longer than the cached table (capped, see __init__): compute on the fly.
        return precompute_freqs_cis(self.args, seq_len, table.device)

    def init_weights(self, *, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise parameters in place from `seed` and rebuild buffers.

        A parameter's values depend on the seed and its name only (`nn/init.py`), so every
        layout (sharded, a pipeline stage of this model, CPU or CUDA) holds the same full weights.
        Works after ``to_empty(device=...)`` from the meta device; ``buffer_device`` places
        buffers elsewhere than parameters (e.g. CUDA buffers with CPU-offloaded parameters).
        """
        self.init_buffers(buffer_device or self.freqs_cis.device)
        init_parameters(self, self.param_inits(), seed=seed)

    def param_inits(self) -> dict[str, ParamInit]:
        """Each parameter's distribution, by its name in the full model (a pipeline stage
        declares the parameters it holds, under the same names)."""
        inits: dict[str, ParamInit] = {}
        if self.tok_embeddings is not None:
            inits["tok_embeddings.weight"] = Normal(1.0)
        for name, layer in self.layers.items():
            inits.update(prefixed(f"layers.{name}", layer.param_inits()))
        if self.norm is not None:
            inits.update(prefixed("norm", self.norm.param_inits()))
        if self.output is not None:
            std = self.args.dim**-0.5
            inits["output.weight"] = TruncNormal(std, a=-3 * std, b=3 * std)
        return inits

    def init_buffers(self, device: torch.device | str) -> None:
        """Rebuild every buffer on `device`: the RoPE table and fresh (zero) MoE router state.

        Used alone when parameters come from a checkpoint (their buffers are loaded after)."""
        with torch.no_grad():
            self.freqs_cis = precompute_freqs_cis(self.args, self._rope_cache_len(), torch.device(device))
        for moe in self.moe_layers():
            moe.reset_router_state(device)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules of this model (or pipeline stage), in layer order."""
        return [layer.moe for layer in self.layers.values() if layer.moe_enabled]
