"""The shape and behaviour of a mixture-of-experts decoder, as plain data: `ModelArgs`.

    python -c "from torchmoe.arch.registry import FLAVORS; print(FLAVORS['qwen3']['30B-A3B'].param_counts())"

One description serves every family (`family` names it; its flavors live in
``torchmoe/arch/<family>.py``): the model, the Hugging Face mapping, the dry-run planner and the
parallelize pipeline all read it. The defaults are Llama 4 Scout's, the first family torchmoe
trained; each family's options are fields that other families leave off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

# Llama 4's RoPE scaling (the released configs' and torchtitan's `RoPEScalingArgs()`): frequencies
# whose wavelength exceeds 8192 positions are divided by 16. low == high leaves no band to smooth.
LLAMA4_ROPE_SCALING = {
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}


# The auxiliary balance loss coefficient of the released Qwen3-MoE and gpt-oss configs
# (``router_aux_loss_coef``): those families' default, in place of the expert bias their Hugging
# Face models cannot hold.
RELEASED_AUX_LOSS_COEFF = 1e-3

# Fields that set how a model trains or runs, not what it computes from its weights (a checkpoint
# and a run may differ in them), and the length limit (released configs advertise up to 10M
# positions; RoPE extends past any table).
# `mtp_layers` too: the multi-token prediction layers are the training objective's, not the causal
# LM's (a checkpoint may hold more of them than a run trains, which are skipped, or fewer, which
# its tensor check refuses).
NOT_ARCHITECTURE = frozenset({"attn_backend", "use_grouped_mm", "load_balance_coeff", "aux_loss_coeff",
                              "z_loss_coeff", "moe_force_load_balance", "init_std", "max_seq_len",
                              "active_counts_embedding", "mtp_layers", "mtp_loss_coeff", "mtp_supported"})
# Fields that spell a per-layer placement (compared as the placement they give).
_PLACEMENT_SPELLINGS = frozenset({"moe_layers", "interleave_moe_layer_step", "no_rope_layers",
                                  "no_rope_layer_interval"})


@dataclass(kw_only=True)
class ModelArgs:
    """Shape and behaviour of a mixture-of-experts decoder of family `family`.

    Layer ``i`` is an MoE layer when ``i in moe_layer_ids`` and uses RoPE (attention within chunks
    of ``attention_chunk_size`` if set, QK L2-norm if ``use_qk_norm``) when ``rope_layers[i]``;
    otherwise it is a NoPE layer with full causal attention (and attention temperature tuning if
    ``attn_temperature_tuning``), exactly as Hugging Face's ``Llama4TextConfig`` derives them.
    """

    # The family (`arch/registry.py`): which Hugging Face model the weights map to.
    family: str = "llama4"
    dim: int = 5120
    n_layers: int = 48
    n_heads: int = 40
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 202048
    norm_eps: float = 1e-5
    max_seq_len: int = 131072
    # RoPE: base and the llama3 frequency scaling (None = plain RoPE).
    rope_theta: float = 500000.0
    rope_scaling: dict | None = field(default_factory=lambda: dict(LLAMA4_ROPE_SCALING))
    # iRoPE: every `no_rope_layer_interval`-th layer is NoPE unless `no_rope_layers` lists them
    # explicitly (HF convention: 1 = this layer uses RoPE, 0 = NoPE).
    no_rope_layer_interval: int = 4
    no_rope_layers: list[int] | None = None
    attention_chunk_size: int | None = 8192
    use_qk_norm: bool = True  # Llama 4: weightless L2 norm of q and k after RoPE, RoPE layers only
    # Qwen3: RMSNorm with a learned (head_dim,) weight of each query and key head, before RoPE, on
    # every layer.
    qk_rms_norm: bool = False
    # Which coordinates RoPE rotates together: "interleaved" pairs (x0, x1), (x2, x3), ... (Llama 4,
    # Meta's complex form) or "half" pairs (x_i, x_{i + head_dim/2}) (Qwen3, `rotate_half`).
    rope_style: str = "interleaved"
    # DeepSeek's multi-head latent attention (MLA) when `kv_lora_rank` > 0: queries from a rank
    # `q_lora_rank` bottleneck (0: one full-rank projection), keys and values from a shared rank
    # `kv_lora_rank` latent, each head's query/key split into `qk_nope_head_dim` unrotated and
    # `qk_rope_head_dim` rotated coordinates (the rotated key is one, shared by every head), values
    # of `v_head_dim`. `head_dim` is then the query/key head (nope + rope), `n_kv_heads` = `n_heads`.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss: biases on the q/k/v/o projections; a learned per-head logit (`sinks`) in every
    # softmax's denominator (a key no query attends to with a zero value); and the layers listed
    # in `sliding_layers` attending over the last `sliding_window` positions (the query's own
    # included) instead of the whole causal context.
    attention_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: list[int] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    # "sdpa" (scaled_dot_product_attention with explicit masks) or "flex" (FlexAttention block masks).
    attn_backend: str = "sdpa"
    # Feed-forward: dense SwiGLU layers use `ffn_hidden_dim`; experts and the shared expert use
    # `moe_hidden_dim`.
    ffn_hidden_dim: int = 16384
    moe_hidden_dim: int = 8192
    # MoE placement: `moe_layers` overrides the interleave step when set.
    interleave_moe_layer_step: int = 1
    moe_layers: list[int] | None = None
    num_experts: int = 16
    top_k: int = 1
    num_shared_experts: int = 1
    score_func: str = "sigmoid"  # "sigmoid" (Llama 4) or "softmax"
    score_before_experts: bool = True  # Llama 4 scales expert inputs; False scales outputs
    norm_topk_prob: bool = False  # divide the k selected scores by their sum (Qwen3's option)
    # DeepSeek-V3's group-limited routing: the experts form `n_group` equal groups, a token's top_k
    # are chosen within its `topk_group` groups of the highest (two best scores) sums; 1 = off.
    # gpt-oss: a bias on the router's logits; routed experts of `experts_style` "clamped_swiglu" (gate and
    # up projections fused and interleaved, biases on both matmuls, the SwiGLU clamped at
    # `swiglu_limit` with sigmoid gain `swiglu_alpha` and ``up + 1``) rather than "swiglu".
    router_bias: bool = False
    experts_style: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the gates' multiplier (after norm_topk_prob)
    # Where bf16 rounds, as the family's transformers modules round (equal in fp32): DeepSeek-V3's
    # router runs its gate matmul in fp32 (inputs and weight upcast: DeepseekV3TopkRouter), the
    # others' in the compute dtype; gpt-oss's RMSNorms (the blocks' two and the final one, all it
    # has) multiply by their weight before the cast to the input's dtype (GptOssRMSNorm), the
    # others' after it (`nn.rms_norm.RMSNorm`).
    router_gate_fp32: bool = False
    norm_weight_in_fp32: bool = False
    # Load balancing, each family's recipe (the flavors' builders): the aux-loss-free bias's update
    # rate (None disables; Llama 4 as torchtitan trains it, DeepSeek-V3), and the sequence-wise
    # balance loss's coefficient (Qwen3-MoE and gpt-oss, whose Hugging Face models hold no bias).
    load_balance_coeff: float | None = 1e-3
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0  # router z-loss coefficient
    use_grouped_mm: bool = True  # torch._grouped_mm for routed experts (else a per-expert loop)
    moe_force_load_balance: bool = False  # round-robin routing instead of top-k (performance work)
    tie_word_embeddings: bool = False
    # Whether the published active-parameter count includes the input embedding (Llama 4's and
    # DeepSeek's do; gpt-oss's counts only the matmuls a token runs, so not the lookup table).
    active_counts_embedding: bool = True
    # DeepSeek-V3's multi-token prediction: `mtp_layers` sequential modules after the main model,
    # module k (layer ``n_layers + k - 1``, a MoE block) predicting the token k + 1 positions ahead
    # from the previous depth's hidden state and the embedding of the token k positions ahead;
    # their mean loss joins the main loss times `mtp_loss_coeff` (`models.decoder.mtp`).
    mtp_layers: int = 0
    mtp_loss_coeff: float = 0.1
    # Whether the family has a place for multi-token prediction modules (DeepSeek-V3's, in its
    # Hugging Face form too): data the preflight reads instead of the family's name.
    mtp_supported: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        problems = []
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.score_func not in ("sigmoid", "softmax"):
            problems.append(f"score_func ({self.score_func!r}) must be 'sigmoid' or 'softmax'")
        if self.rope_style not in ("interleaved", "half"):
            problems.append(f"rope_style ({self.rope_style!r}) must be 'interleaved' or 'half'")
        if self.experts_style not in ("swiglu", "clamped_swiglu"):
            problems.append(f"experts_style ({self.experts_style!r}) must be 'swiglu' or 'clamped_swiglu'")
        if self.sliding_window < 0 or (self.sliding_layers and not self.sliding_window):
            problems.append(f"sliding_window ({self.sliding_window}) must be positive when sliding_layers are set")
        if self.sliding_layers is not None and any(not 0 <= i < self.n_layers for i in self.sliding_layers):
            problems.append(f"sliding_layers {self.sliding_layers} must lie in [0, {self.n_layers})")
        problems += self._latent_attention_problems() + self._group_routing_problems()
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "llama3") not in ("llama3", "yarn"):
            problems.append(f"rope_scaling's rope_type ({self.rope_scaling['rope_type']!r}) must be 'llama3' or 'yarn'")
        if self.attn_backend not in ("sdpa", "flex"):
            problems.append(f"attn_backend ({self.attn_backend!r}) must be 'sdpa' or 'flex'")
        if self.no_rope_layers is not None and len(self.no_rope_layers) < self.n_layers:
            problems.append(f"no_rope_layers has {len(self.no_rope_layers)} entries, need n_layers={self.n_layers}")
        if self.mtp_layers < 0 or self.mtp_loss_coeff < 0:
            problems.append(f"mtp_layers ({self.mtp_layers}) and mtp_loss_coeff ({self.mtp_loss_coeff}) must be >= 0")
        if self.moe_layers is not None and any(not 0 <= i < self.n_layers for i in self.moe_layers):
            problems.append(f"moe_layers {self.moe_layers} must lie in [0, {self.n_layers})")
        if problems:
            raise ValueError("invalid ModelArgs: " + "; ".join(problems))

    def _latent_attention_problems(self) -> list[str]:
        if not self.kv_lora_rank:
            return []
        problems = []
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            problems.append(f"head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                            f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim}) under latent attention")
        if self.n_kv_heads != self.n_heads:
            problems.append(f"n_kv_heads ({self.n_kv_heads}) must equal n_heads ({self.n_heads}) "
                            "under latent attention")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.v_head_dim <= 0:
            problems.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and positive and "
                            f"v_head_dim ({self.v_head_dim}) positive under latent attention")
        return problems

    def _group_routing_problems(self) -> list[str]:
        if self.n_group == 1 and self.topk_group == 1:
            return []
        per_group = self.num_experts // self.n_group if self.n_group > 0 else 0
        if self.n_group < 1 or self.num_experts % self.n_group or per_group < 2:
            return [f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) into groups of 2 or more"]
        if not 1 <= self.topk_group <= self.n_group or self.top_k > self.topk_group * per_group:
            return [f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}] and hold top_k "
                    f"({self.top_k}) experts ({per_group} per group)"]
        return []

    @property
    def latent_attention(self) -> bool:
        """Whether the attention is DeepSeek's multi-head latent attention (`kv_lora_rank` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def windowed_or_sink_attention(self) -> bool:
        """Whether attention has gpt-oss's sinks or sliding windows (`nn.sink_attention`)."""
        return self.attention_sinks or bool(self.sliding_layers and self.sliding_window)

    @property
    def rope_dim(self) -> int:
        """The coordinates of a query/key head RoPE rotates: all of them, or MLA's rope part."""
        return self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The width of a value head (MLA's `v_head_dim`; else `head_dim`)."""
        return self.v_head_dim if self.latent_attention else self.head_dim

    # ---- per-layer structure (HF Llama4TextConfig.__post_init__ semantics) -------------------

    # Cached: the planner asks for them per block of every layout it scores (the fields are
    # not changed after construction: `replace` makes a new ModelArgs).
    @property
    def mtp_layer_ids(self) -> range:
        """The multi-token prediction blocks' layer indices, after the main model's."""
        return range(self.n_layers, self.n_layers + self.mtp_layers)

    @cached_property
    def moe_layer_ids(self) -> frozenset[int]:
        """The MoE blocks: the main model's placement, and every multi-token prediction block
        (DeepSeek-V3's is a MoE block)."""
        if self.moe_layers is not None:
            main = frozenset(self.moe_layers)
        else:
            step = self.interleave_moe_layer_step
            main = frozenset(range(step - 1, self.n_layers, step))
        return main | frozenset(self.mtp_layer_ids)

    @cached_property
    def rope_layers(self) -> list[bool]:
        """Whether each block (the main model's, then the multi-token prediction ones, which
        rotate) uses RoPE."""
        mtp = [True] * self.mtp_layers
        if self.no_rope_layers is not None:
            return [bool(x) for x in self.no_rope_layers[: self.n_layers]] + mtp
        return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(self.n_layers)] + mtp

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id in self.moe_layer_ids

    def layer_chunk(self, layer_id: int) -> int | None:
        """The chunk length layer `layer_id` attends within (RoPE layers), or None (NoPE layers:
        causal over the whole row)."""
        return self.attention_chunk_size if self.rope_layers[layer_id] else None

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window (positions a query sees, its own included) of layer `layer_id`, or
        None (the whole causal context, or its chunk)."""
        return self.sliding_window if self.sliding_layers and layer_id in self.sliding_layers else None

    def logits_unbounded(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s attention logits are free to grow with its weights: no
        QK-norm bounds them (Qwen3's per-head RMSNorm, Llama 4's L2 norm on RoPE layers; MLA has
        none). QK-Clip watches only such layers (`optim.qk_clip`)."""
        if self.latent_attention:
            return True
        return not self.qk_rms_norm and not (self.use_qk_norm and self.rope_layers[layer_id])

    def attention_spans(self) -> tuple[tuple[int | None, int | None], ...]:
        """Every distinct (`layer_chunk`, `layer_window`) of the model, in layer order: the kinds of
        attention call its layers make (document masking builds a segment table for each, context
        parallelism gives each its mode)."""
        return tuple(dict.fromkeys((self.layer_chunk(i), self.layer_window(i)) for i in range(self.n_layers)))

    def routed_expert_names(self) -> list[str]:
        """Module names of the routed experts (``GroupedExperts``), one per MoE layer."""
        return [f"layers.{i}.moe.experts" for i in range(self.n_layers + self.mtp_layers) if self.is_moe_layer(i)]

    def replace(self, **overrides) -> "ModelArgs":
        return dataclasses.replace(self, **overrides)

    def architecture_differences(self, other: "ModelArgs") -> list[str]:
        """The fields in which `other` computes something else from the same weights (or holds
        other weights), in field order: every field but `NOT_ARCHITECTURE`, the MoE and RoPE
        layer placements compared as placements (``moe_layer_ids``, ``rope_layers``), however
        each spells them."""
        skip = NOT_ARCHITECTURE | _PLACEMENT_SPELLINGS
        differ = [f.name for f in dataclasses.fields(self)
                  if f.name not in skip and getattr(self, f.name) != getattr(other, f.name)]
        return differ + [name for name in ("moe_layer_ids", "rope_layers") if getattr(self, name) != getattr(other, name)]

    # ---- sizes ------------------------------------------------------------------------------

    def _attention_params(self) -> int:
        if self.latent_attention:
            q_out = self.n_heads * self.head_dim
            query = (self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out
                     if self.q_lora_rank else self.dim * q_out)
            latent = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            keys_values = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return query + latent + keys_values + self.n_heads * self.v_head_dim * self.dim
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qk_norms = 2 * self.head_dim if self.qk_rms_norm else 0
        biases = q_out + 2 * kv_out + self.dim if self.attention_bias else 0
        sinks = self.n_heads if self.attention_sinks else 0
        return self.dim * q_out + 2 * self.dim * kv_out + q_out * self.dim + qk_norms + biases + sinks

    def _expert_params(self, routed: bool = True) -> int:
        """One expert's parameters: a routed one (`experts_style`'s) or a shared one (SwiGLU)."""
        biases = 2 * self.moe_hidden_dim + self.dim if routed and self.experts_style == "clamped_swiglu" else 0
        return 3 * self.dim * self.moe_hidden_dim + biases

    def layer_params(self, layer_id: int) -> tuple[int, int]:
        """(total, active) parameters of block `layer_id`; active counts the top_k routed experts."""
        attn = self._attention_params() + 2 * self.dim  # attention + two RMSNorms
        if not self.is_moe_layer(layer_id):
            dense = attn + 3 * self.dim * self.ffn_hidden_dim
            return dense, dense
        router = self.dim * self.num_experts + (self.num_experts if self.router_bias else 0)
        common = attn + self.num_shared_experts * self._expert_params(routed=False) + router
        return common + self.num_experts * self._expert_params(), common + self.top_k * self._expert_params()

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: ``total``, ``active`` (per token: top_k routed experts), ``embedding``.

        ``active`` counts the output head, and the embedding where the family's published count
        does (`active_counts_embedding`: Llama 4's "17B active", DeepSeek-V3's 37B; not gpt-oss's
        5.1B).
        """
        per_layer = [self.layer_params(i) for i in range(self.n_layers)]
        embedding = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        extra = embedding + head + self.dim  # + final norm
        active_extra = extra if self.active_counts_embedding else extra - embedding
        mtp = sum(self.mtp_module_params(i) for i in self.mtp_layer_ids)
        return {"total": sum(t for t, _ in per_layer) + extra + mtp,
                "active": sum(a for _, a in per_layer) + active_extra, "embedding": embedding, "mtp": mtp}

    def mtp_module_params(self, layer_id: int) -> int:
        """A multi-token prediction module's own parameters: its block, the two input norms and
        the projection of their concatenation, its output norm (the embedding and the output head
        are the main model's)."""
        return self.layer_params(layer_id)[0] + 2 * self.dim * self.dim + 3 * self.dim

    def layer_flops_per_token(self, layer_id: int, seq_len: int, *, causal: bool = False) -> int:
        """Training FLOPs per token (forward + backward) of block `layer_id`.

        ``6 * N`` for the matmuls over its active parameters ``N``, plus ``6 * n_heads * (head_dim +
        value_head_dim) * L_eff`` for the attention scores and weighted sum (2 matmuls, x3 for
        backward, x2 multiply-add; ``12 * n_heads * head_dim`` unless MLA's values are narrower),
        where ``L_eff`` is the context a query attends over: ``seq_len`` for full-attention layers
        and ``min(seq_len, attention_chunk_size)`` for chunked ones (``min(seq_len, sliding_window)``
        for sliding-window ones). By default causal masking is
        not halved, following the PaLM/MFU convention so numbers compare across trainers; `causal`
        counts only the keys a query sees (half the square: ``L_eff / 2``), the work a causal
        kernel actually does.
        """
        ctx = seq_len
        if self.rope_layers[layer_id] and self.attention_chunk_size is not None:
            ctx = min(seq_len, self.attention_chunk_size)
        if (window := self.layer_window(layer_id)) is not None:
            ctx = min(ctx, window)
        attention = 6 * self.n_heads * (self.head_dim + self.value_head_dim) * ctx
        return 6 * self.layer_params(layer_id)[1] + (attention // 2 if causal else attention)

    def head_flops_per_token(self) -> int:
        """Training FLOPs per token of the final norm and the output head (the embedding lookup is
        no matmul; a tied head still multiplies by the embedding), once more for each multi-token
        prediction module with its input projection (its block is a layer's)."""
        head = 6 * (self.vocab_size * self.dim + self.dim)
        return head * (1 + self.mtp_layers) + 6 * 2 * self.dim**2 * self.mtp_layers

    def flops_per_token(self, seq_len: int, *, causal: bool = False) -> int:
        """Training FLOPs per token (forward + backward) of the whole model, counting only the
        active experts: every block's `layer_flops_per_token` (the multi-token prediction blocks'
        too) plus the head's."""
        return sum(self.layer_flops_per_token(i, seq_len, causal=causal)
                   for i in range(self.n_layers + self.mtp_layers)) + self.head_flops_per_token()
