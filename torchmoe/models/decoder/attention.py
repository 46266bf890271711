"""The decoder's attention: the kernels' dispatch every variant shares (`CausalAttention`) and
grouped-query attention (`Attention`: Llama 4's iRoPE, chunks, QK L2-norm and temperature tuning;
Qwen3's per-head QK RMSNorm and half-split RoPE; gpt-oss's projection biases, sinks and sliding
windows). DeepSeek's latent attention is `latent_attention.LatentAttention`.

    python -m pytest -q tests/unit/test_model.py
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.decoder.rotary import apply_rotary_emb
from torchmoe.nn.attention import causal_attention
from torchmoe.nn.document_attention import DocumentSegments, document_attention
from torchmoe.nn.init import Constant, ParamInit, TruncNormal, prefixed
from torchmoe.nn.kv_cache import KVCache
from torchmoe.nn.logit_max import head_logit_max, window_starts
from torchmoe.nn.rms_norm import RMSNorm
from torchmoe.nn.shards import local_shard
from torchmoe.nn.sink_attention import cached_sink_attention, sink_attention

__all__ = ["Attention", "CausalAttention"]


class CausalAttention(nn.Module):
    """What every attention variant shares: causal attention of its heads over the kernels of
    `nn.attention` (within chunks of ``attention_chunk_size`` on chunked layers), under document
    masking, context parallelism (`context_parallel`, set by `apply_cp`) or a decoding cache;
    gpt-oss's sinks (``sinks``: (H,) logits) and sliding window (``window``) by
    `nn.sink_attention` over whole rows, each document's segments under document masking (the
    window counted within the document, the sinks joined to its softmax) and context
    parallelism's pieces alike (the config checks refuse FlexAttention for them). Subclasses
    project the heads and call `_attend` / `_attend_cached`."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.register_parameter("sinks", None)  # gpt-oss's subclass sets it
        self.chunk_size = args.layer_chunk(layer_id)
        self.window = args.layer_window(layer_id)
        self.attn_backend = args.attn_backend
        # Set by context parallelism (`distributed/context_parallel.py`): the local tokens' global
        # positions and the attention over the context they need.
        self.context_parallel = None
        # QK-Clip (`watch_logits`): (H,) fp32, each head's largest logit in training forwards
        # since the step began, this rank's heads at `head_offset` (tensor parallel: its slice).
        self.register_buffer("logit_max", None, persistent=False)
        self.head_offset = 0
        self.logit_index = -1  # this layer's row in QK-Clip's table (`watch_logits`)
        # No QK-norm bounds this layer's logits (`ModelArgs.logits_unbounded`): QK-Clip watches it.
        self.logits_unbounded = args.logits_unbounded(layer_id)

    def watch_logits(self, n_heads: int, index: int) -> None:
        """Record each of the `n_heads` heads' largest pre-softmax logit of every training
        forward into ``logit_max`` (QK-Clip: `optim.qk_clip`, whose table of every rank's
        maxima holds this layer at row `index`); on the meta device as the model is built,
        before it is split and parallelized."""
        self.register_buffer("logit_max", torch.full((n_heads,), float("-inf")), persistent=False)
        self.logit_index = index

    def _observe_logits(self, q: torch.Tensor, k: torch.Tensor, documents: DocumentSegments | None) -> None:
        """Fold this forward's largest logit of each local head into ``logit_max``."""
        starts = window_starts(q.shape[2], q.device, chunk=self.chunk_size, window=self.window, documents=documents)
        local = self.logit_max[self.head_offset:self.head_offset + q.shape[1]]
        local.copy_(torch.maximum(local, head_logit_max(q, k, starts)))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: DocumentSegments | None) -> torch.Tensor:
        if self.logit_max is not None and self.training:
            self._observe_logits(q, k, documents)
        # Under tensor parallel the sinks are sharded as the heads are: this rank's heads'.
        sinks = None if self.sinks is None else local_shard(self.sinks)
        if self.context_parallel is not None:
            return self.context_parallel.attend(q, k, v, self.chunk_size, documents, window=self.window, sinks=sinks)
        if documents is not None:
            return document_attention(q, k, v, documents, chunk=self.chunk_size, window=self.window, sinks=sinks)
        if sinks is not None or self.window is not None:
            return sink_attention(q, k, v, sinks, self.window)
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
        if self.sinks is not None or self.window is not None:
            first = max(0, start + 1 - self.window) if self.window is not None else 0
            prefix_k, prefix_v = cache.append(name, k, v, keep_from=first)
            sinks = None if self.sinks is None else local_shard(self.sinks)
            if start == 0:  # the prompt: training's attention (fused kernels, no score matrix)
                return sink_attention(q, k, v, sinks, self.window)
            return cached_sink_attention(q, torch.cat([prefix_k, k], dim=-2), torch.cat([prefix_v, v], dim=-2), sinks,
                                         self.window)
        first = start // self.chunk_size * self.chunk_size if self.chunk_size is not None else 0
        prefix = cache.append(name, k, v, keep_from=first)
        return causal_attention(q, k, v, chunk=self.chunk_size, start=start,
                                prefix=prefix if start > first else None)


class Attention(CausalAttention):
    """Grouped-query attention.

    RoPE layers: rotary embeddings, QK L2-norm (``use_qk_norm``), causal attention within chunks
    of ``attention_chunk_size``. NoPE layers: no rotation, full causal attention, queries scaled by
    ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (temperature tuning).
    ``qk_rms_norm``: each query and key head is RMS-normalised with a learned (hd,) weight
    (`q_norm`, `k_norm`) before RoPE. ``attention_bias``: the four projections have biases;
    ``attention_sinks``: a learned logit per head (`sinks`) joins each softmax (gpt-oss).
    """

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__(args, layer_id)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.use_rope = args.rope_layers[layer_id]
        self.rope_style = args.rope_style
        self.qk_norm = RMSNorm(args.head_dim, args.norm_eps, elementwise_affine=False) if (
            args.use_qk_norm and self.use_rope) else None
        self.temperature = (args.floor_scale, args.attn_scale) if (
            args.attn_temperature_tuning and not self.use_rope) else None
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        if args.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(args.n_heads))
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
            # In v's dtype: under autocast the fp32 weights promote the norms' outputs to fp32,
            # which SDPA's autocast would cast back, but document masking's varlen kernel is
            # no autocast op and refuses q/k/v of mixed dtypes.
            xq, xk = self.q_norm(xq).type_as(xv), self.k_norm(xk).type_as(xv)
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

    def qk_clip_factors(self, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row factors that multiply each head's logits by `gamma` (H,) (QK-Clip,
        `optim.qk_clip`): {parameter name: (rows,)}. A key head with one query head (MHA)
        takes sqrt(gamma) on both sides, as Kimi K2 splits it; a key head shared by a group of
        query heads (GQA) is left alone and each query head takes its whole gamma, so that no
        other head's weights or logits change. Biases are scaled with their rows."""
        group = self.n_heads // self.n_kv_heads
        key = gamma.sqrt() if group == 1 else torch.ones(self.n_kv_heads, device=gamma.device)
        query = (gamma / key.repeat_interleave(group)).repeat_interleave(self.head_dim)
        key = key.repeat_interleave(self.head_dim)
        factors = {"wq.weight": query, "wk.weight": key}
        if self.wq.bias is not None:
            factors.update({"wq.bias": query, "wk.bias": key})
        return factors

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Projections into heads at std 0.02; the output projection and the sinks at the block's
        depth-scaled std; biases at 0; per-head norms at 1."""
        inits: dict[str, ParamInit] = {"wq.weight": TruncNormal(0.02), "wk.weight": TruncNormal(0.02),
                                       "wv.weight": TruncNormal(0.02), "wo.weight": TruncNormal(init_std)}
        if self.wq.bias is not None:
            inits.update({f"w{p}.bias": Constant(0.0) for p in "qkvo"})
        if self.sinks is not None:
            inits["sinks"] = TruncNormal(init_std)
        if self.q_norm is not None:
            inits.update({**prefixed("q_norm", self.q_norm.param_inits()),
                          **prefixed("k_norm", self.k_norm.param_inits())})
        return inits


_BLOCK_MASKS: dict = {}


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


