"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 §2.1; V3 and Kimi K2 keep it).

    python -m pytest -q tests/unit/test_hf_parity_deepseek_v3.py

Queries come through a rank ``q_lora_rank`` bottleneck (or one full-rank projection), keys and
values from one shared latent of rank ``kv_lora_rank``; each query/key head is ``qk_nope_head_dim``
unrotated coordinates followed by ``qk_rope_head_dim`` rotated ones, whose key part is a single
head shared by all (computed with the latent):

    q                = wq(x)  or  wq_b(q_norm(wq_a(x)))                  (B, S, H, nope + rope)
    latent, k_rope   = split(wkv_a(x), [kv_lora_rank, rope])             (B, S, r), (B, S, rope)
    k_nope, v        = split(wkv_b(kv_norm(latent)), [nope, v_head_dim])  per head
    q_rope, k_rope   rotated (interleaved pairs), k = [k_nope, k_rope repeated over heads]
    out              = wo(softmax(q k^T * head_dim^-0.5 * mscale^2) v)   (B, S, dim)

``mscale`` is YaRN's correction of the softmax scale (`rotary.yarn_softmax_scale`); it is applied
to the queries, so the kernels keep their default scale. The values are zero-padded to the
query/key head width before attention and the padding dropped after: every kernel path
(CUDA flash wants one head width for q, k and v; document masking's varlen kernel; context
parallelism's exchanges; a prompt's forward when decoding) then runs MLA as it runs grouped-query
attention, and the padding's output columns are exactly zero, so nothing else changes.

Decoding (`nn.kv_cache`) keeps per position only what transformers keeps: the normed latent and
the rotated shared key, r + rope elements per layer (not 2 x heads x head_dim: 85x more at 671B).
The positions after the prompt attend from it with the up-projections absorbed (DeepSeek-V2
§2.1.2): per head, q_nope · W_UK (W_UK: wkv_b's key rows) is a query against the latent, so the
keys are [latent, k_rope], one head shared by every query head; the same tensor serves as the
values, whose latent part of the output, times W_UV (wkv_b's value rows), is each head's output:

    scores = [q_nope W_UK, q_rope] · [latent, k_rope]^T,  out = (softmax(scores) latent) W_UV^T

Under tensor parallelism (`models.decoder.tensor_parallel`) the heads are split (wq / wq_b and
wkv_b column-wise, wo row-wise) while the bottleneck projections and their norms are replicated;
the rotated key is shared by every head, so each rank's gradient of it covers its own heads
only and is summed over tp (`rope_key_gradient_mesh`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchmoe.arch.model_args import ModelArgs
from torchmoe.distributed.tensor_parallel import sum_gradient
from torchmoe.models.decoder.attention import CausalAttention
from torchmoe.models.decoder.rotary import apply_rotary_emb, yarn_softmax_scale
from torchmoe.nn.attention import causal_attention
from torchmoe.nn.document_attention import DocumentSegments
from torchmoe.nn.init import ParamInit, TruncNormal, prefixed
from torchmoe.nn.kv_cache import KVCache
from torchmoe.nn.rms_norm import RMSNorm
from torchmoe.nn.shards import local_shard

__all__ = ["LatentAttention"]

# The bottleneck norms' epsilon: DeepSeek's reference code and Hugging Face leave them at the
# norm's default whatever the config's rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class LatentAttention(CausalAttention):
    """Multi-head latent attention (module docstring); causal over the whole row."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__(args, layer_id)
        self.head_dim = args.head_dim  # query/key head: nope + rope
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.rope_style = args.rope_style
        self.query_scale = yarn_softmax_scale(args.rope_scaling)
        q_out = args.n_heads * args.head_dim
        if args.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # Set by tensor parallelism: the mesh the shared rotated key's gradient is summed over.
        self.rope_key_gradient_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: DocumentSegments | None = None,
                cache: KVCache | None = None, name: str = "") -> torch.Tensor:
        """x: (B, S, dim), freqs_cis: (S, rope/2) complex; documents and cache as
        `Attention.forward`'s (the cache keeps the normed latent and rotated key: module
        docstring) -> (B, S, dim)."""
        bsz, seq_len, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 head counts: under tensor parallel each rank holds a slice of the heads.
        q_nope, q_rope = q.view(bsz, seq_len, -1, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rope_key_gradient_mesh is not None:
            k_rope = sum_gradient(k_rope, self.rope_key_gradient_mesh)
        latent = self.kv_norm(latent)
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), freqs_cis, self.rope_style)
        if self.query_scale != 1.0:
            q_nope, q_rope = q_nope * self.query_scale, q_rope * self.query_scale
        if cache is not None and cache.length > 0:
            out = self._attend_latent(q_nope, q_rope, latent, k_rope.squeeze(2), cache, name)
            return self.wo(out.reshape(bsz, seq_len, -1))
        kv = self.wkv_b(latent).view(bsz, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        heads = k_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, S, H, hd)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
        v = F.pad(v, (0, self.head_dim - self.v_dim))  # one head width for every kernel
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        if cache is not None:  # the prompt: training's attention; the cache keeps the latent (in q's dtype)
            cache.append(name, torch.cat((latent, k_rope.squeeze(2)), dim=-1).unsqueeze(1).to(q.dtype), keep_from=0)
            out = causal_attention(q, k, v)
        else:
            out = self._attend(q, k, v, documents)
        out = out[..., : self.v_dim].transpose(1, 2).reshape(bsz, seq_len, -1)  # (B, S, H * v)
        return self.wo(out)

    def _attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                       cache: KVCache, name: str) -> torch.Tensor:
        """Attention of queries at ``[L, L + S)`` (L = cache.length > 0) over the cached positions
        and their own, computed from the latent (module docstring: one key head of width
        r + rope shared by every query head, the up-projections absorbed into the queries and
        the output). q_nope: (B, S, H, nope), q_rope: (B, S, H, rope) rotated and scaled;
        latent: (B, S, r) normed, k_rope: (B, S, rope) rotated -> (B, S, H, v)."""
        start, rank = cache.length, self.kv_lora_rank
        # wkv_b's rows per head: nope rows that make its keys, then v rows that make its values.
        w = local_shard(self.wkv_b.weight).view(-1, self.nope_dim + self.v_dim, rank)
        w_key, w_value = w.split([self.nope_dim, self.v_dim], dim=1)  # (H, nope, r), (H, v, r)
        q = torch.cat((torch.einsum("bshn,hnr->bshr", q_nope, w_key), q_rope), dim=-1)  # (B, S, H, r + rope)
        # The kernels scale by (r + rope)^-0.5: the heads' own scale is head_dim^-0.5.
        q = (q * ((rank + self.rope_dim) / self.head_dim) ** 0.5).transpose(1, 2)  # (B, H, S, r + rope)
        kv = torch.cat((latent, k_rope), dim=-1).unsqueeze(1).to(q.dtype)  # (B, 1, S, r + rope)
        (prefix,) = cache.append(name, kv, keep_from=0)
        # The keys serve as the values too: the latent part of the output is what the values
        # give; the rope part, attention over the rotated keys, is dropped.
        if q.shape[2] == 1:
            # One new position (decoding): its heads are queries of the one key head, folded
            # into the query axis, over every key, none masked. A kernel that repeats key heads
            # for grouped queries (CUDA's memory-efficient one) would copy the keys H times.
            keys = torch.cat((prefix, kv), dim=-2)  # (B, 1, L + 1, r + rope)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, keys)[..., :rank]  # (B, 1, H, r)
            return torch.einsum("bshr,hvr->bshv", out, w_value)
        out = causal_attention(q, kv, kv, start=start, prefix=(prefix, prefix))[..., :rank]  # (B, H, S, r)
        return torch.einsum("bhsr,hvr->bshv", out, w_value)

    def qk_clip_factors(self, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row factors that multiply each head's logits by `gamma` (H,), as Kimi K2 clips
        MLA: each head's unrotated query and key rows (wq or wq_b; wkv_b's key rows) by
        sqrt(gamma), its rotated query rows by gamma, and the rotated key, one head shared by
        all (wkv_a), not at all; the value rows stay. {parameter name: (rows,)}."""
        heads, root = gamma.shape[0], gamma.sqrt().unsqueeze(1)
        query = torch.cat([root.expand(heads, self.nope_dim), gamma.unsqueeze(1).expand(heads, self.rope_dim)], dim=1)
        kv = torch.cat([root.expand(heads, self.nope_dim), torch.ones(heads, self.v_dim, device=gamma.device)], dim=1)
        return {"wq.weight" if self.wq is not None else "wq_b.weight": query.reshape(-1), "wkv_b.weight": kv.reshape(-1)}

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Projections into the latents and heads at std 0.02, the output projection at the
        block's depth-scaled std, norms at 1."""
        names = ["wkv_a", "wkv_b"] + (["wq"] if self.wq is not None else ["wq_a", "wq_b"])
        inits: dict[str, ParamInit] = {f"{n}.weight": TruncNormal(0.02) for n in names}
        inits["wo.weight"] = TruncNormal(init_std)
        inits.update(prefixed("kv_norm", self.kv_norm.param_inits()))
        if self.wq is None:
            inits.update(prefixed("q_norm", self.q_norm.param_inits()))
        return inits
