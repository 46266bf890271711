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
parallelism's exchanges; the decoding cache) then runs MLA as it runs grouped-query attention,
and the padding's output columns are exactly zero, so nothing else changes.

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
from torchmoe.nn.document_attention import DocumentSegments
from torchmoe.nn.init import ParamInit, TruncNormal, prefixed
from torchmoe.nn.kv_cache import KVCache
from torchmoe.nn.rms_norm import RMSNorm

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
        `Attention.forward`'s -> (B, S, dim)."""
        bsz, seq_len, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 head counts: under tensor parallel each rank holds a slice of the heads.
        q_nope, q_rope = q.view(bsz, seq_len, -1, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rope_key_gradient_mesh is not None:
            k_rope = sum_gradient(k_rope, self.rope_key_gradient_mesh)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq_len, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, S, H, nope), (B, S, H, v)
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(2), freqs_cis, self.rope_style)
        heads = k_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, S, H, hd)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
        v = F.pad(v, (0, self.head_dim - self.v_dim))  # one head width for every kernel
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        out = self._attend_cached(q, k, v, cache, name) if cache is not None else self._attend(q, k, v, documents)
        out = out[..., : self.v_dim].transpose(1, 2).reshape(bsz, seq_len, -1)  # (B, S, H * v)
        return self.wo(out)

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
