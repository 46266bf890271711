"""The mixture-of-experts decoder every family builds (`ModelArgs` says which options it uses):
attention (`attention.Attention`, grouped-query: Llama 4's iRoPE, chunks and QK L2-norm, Qwen3's
per-head QK RMSNorm; or DeepSeek's `latent_attention.LatentAttention`), interleaved dense and MoE
feed-forward.

    python -c "import torch; from torchmoe.models.llama4 import Transformer, FLAVORS; \\
        m = Transformer(FLAVORS['tiny']); m.init_weights(seed=0); print(m(torch.zeros(1, 8, dtype=torch.long)).shape)"

Numerics follow each family's Hugging Face model operation for operation (``Llama4ForCausalLM``:
norms and rotary embeddings in fp32, interleaved-pair complex RoPE, QK L2-norm after RoPE,
temperature tuning of NoPE queries; ``Qwen3MoeForCausalLM``: RMSNorm of each q/k head before
half-split RoPE; ``DeepseekV3ForCausalLM``: latent attention, YaRN, group-limited sigmoid
routing), so logits match them to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.decoder.attention import Attention
from torchmoe.models.decoder.latent_attention import LatentAttention
from torchmoe.models.decoder.moe import MoE
from torchmoe.models.decoder.mtp import MTPModule, mtp_inputs
from torchmoe.models.decoder.rotary import precompute_freqs_cis
from torchmoe.nn.document_attention import DocumentSegments
from torchmoe.nn.experts import FeedForward
from torchmoe.nn.init import Normal, ParamInit, TruncNormal, init_parameters, prefixed
from torchmoe.nn.kv_cache import KVCache
from torchmoe.nn.lora import adapter_param_inits
from torchmoe.nn.profiler_regions import region
from torchmoe.nn.rms_norm import RMSNorm

# The RoPE table's cap (positions): released configs advertise up to 10M (gigabytes of table).
_MAX_ROPE_CACHE = 65536



class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn_or_moe(norm(h))``."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = LatentAttention(args, layer_id) if args.latent_attention else Attention(args, layer_id)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, weight_in_fp32=args.norm_weight_in_fp32)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, weight_in_fp32=args.norm_weight_in_fp32)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of output projections keeps the residual stream's variance bounded.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: DocumentSegments | None = None,
                cache: KVCache | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, S, dim), freqs_cis: (S, hd/2) complex, documents and cache: as
        `Attention.forward`'s, real: as `MoE.forward`'s -> (B, S, dim)."""
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
            # The mask as a keyword only when there is one: TP's input styles place a tensor, not None.
            return h + (self.moe(normed) if real is None else self.moe(normed, real=real))

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
        # The multi-token prediction modules' blocks follow the main model's (`models.decoder.mtp`):
        # every per-block parallelism (TP, EP, FSDP, AC, compile) wraps them as it wraps the others.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers + args.mtp_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, weight_in_fp32=args.norm_weight_in_fp32)
        # Tied embeddings reuse tok_embeddings.weight in forward rather than sharing a Parameter:
        # shared Parameters come apart under to_empty() and per-module sharding.
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # The rest of each multi-token prediction module, keyed by its block's layer index.
        self.mtp = nn.ModuleDict({str(i): MTPModule(args) for i in args.mtp_layer_ids}) if args.mtp_layers else None
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
                cache: KVCache | None = None, labels: torch.Tensor | None = None, real: torch.Tensor | None = None):
        """tokens: (B, S) int64 ids (or (B, S, dim) hidden states on later pipeline stages)
        -> logits (B, S, vocab) (or hidden states when this stage has no output head).

        labels: training's (B, S) next tokens, for the multi-token prediction modules: the
        return is then (logits, [depth k's logits (B, S, vocab), k = 1 .. mtp_layers]).

        documents: None (causal attention over the row), or document masking: the micro-batch's
        segment tables (`nn.document_attention.document_segments` of the whole rows' document
        starts, built on the host). Positions stay global: RoPE counts from the row start
        either way.

        real: (B, S) bool, True where the token is data and False where it is padding, which then
        takes no part in the MoE routers' statistics, balance losses or dispatch (`MoE.forward`);
        None: every token is data (pretraining's rows, generation).

        cache: decoding (`nn.kv_cache.KVCache`): `tokens` are the positions after the cached
        ones; every layer appends its keys and values, and the logits equal the full forward's
        at those positions.

        Under ``autocast_dtype`` the logits come out in it and the hidden states in fp32 (the
        residual stream is a sum autocast leaves in fp32); the loss upcasts the logits."""
        if self.autocast_dtype is None:
            return self._forward(tokens, documents, cache, labels, real)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype):
            return self._forward(tokens, documents, cache, labels, real)

    def _forward(self, tokens: torch.Tensor, documents: DocumentSegments | None, cache: KVCache | None,
                 labels: torch.Tensor | None, real: torch.Tensor | None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        start = cache.length if cache is not None else 0
        freqs_cis = self._rotations(start + h.shape[1])[start:]
        for name, layer in self.layers.items():
            if int(name) >= self.args.n_layers:  # the multi-token prediction blocks
                break
            h = layer(h, freqs_cis, documents, real=real) if cache is None else layer(h, freqs_cis, cache=cache)
        if cache is not None:
            cache.advance(h.shape[1])
        if self.norm is None:  # not the last pipeline stage
            return h
        h = self.norm(h)
        logits = self._head(h)
        if labels is None:
            return logits
        depths = []
        for depth, (name, module) in enumerate((self.mtp or {}).items(), start=1):
            h = module.combine(self.tok_embeddings(mtp_inputs(tokens, depth)), h)
            h = self.layers[name](h, freqs_cis, documents, real=real)
            depths.append(self._head(module.norm(h)))
        return logits, depths

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The output head: (B, S, dim) normed hidden states -> (B, S, vocab) logits."""
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
        for name, module in (self.mtp or {}).items():
            inits.update(prefixed(f"mtp.{name}", module.param_inits()))
        inits.update(adapter_param_inits(self))  # LoRA's, when `models.decoder.lora` added them
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
