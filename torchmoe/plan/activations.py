"""The planner's activation model: the bytes each block and the head save for backward, per token,
under activation checkpointing, and the peak of a pp rank's activations (`plan.memory` adds them to
the per-rank estimate).

    act = ActivationModel(args, dims, a=2, compiled=False, loss_parallel=False, seq_len=8192)
    act.block_full(0), act.head()       # bytes per token saved by block 0 and by the head

Activations: bytes saved for backward per token, per block, from the tensors `model.py` keeps
alive (eager autograd, flash-style attention kernels that save q, k, v, out and the fp32
log-sum-exp rather than probabilities: no path hands attention a mask, which would send it to the
math kernel and its score matrix, see `nn.attention`). ``a`` = compute dtype
bytes, ``r`` residual-stream bytes (``a``, or 4 under autocast), ``D`` dim,
``Hq = n_heads*head_dim``, ``Hkv = n_kv_heads*head_dim``, ``F`` ffn_hidden_dim, ``M`` moe_hidden_dim,
``Ms = M * num_shared_experts``, ``E`` experts, ``k`` top_k. TP shards heads and hidden dims
(``/tp``) and, with sequence parallelism, the residual stream and norms (``/tp``); the matmul
inputs are the all-gathered sequence (full ``D``).

    norm(n)   = (4 + r)*n + 4               fp32 upcast (the input itself when r = 4) + normalised
                                            output (before the weight) + rstd; (4 + 4)*n + 4 when
                                            the weight multiplies before the cast (gpt-oss's
                                            `norm_weight_in_fp32`: its fp32 operand is saved);
                r*n + 4 with torch.compile   (fused: the input and rstd)
    x(n)      = a, or n*a under autocast    a matmul input read by n matmuls: autocast casts it
                                            for each (eager; compile may merge the casts)
    attention = norm(D)/tp + x(3)*D         attention_norm, gathered wq/wk/wv input
              + a*(Hq + 2*Hkv)/tp           sdpa's q, k, v
              + a*Hq/tp + 4*n_heads/tp      sdpa output (also wo's input: its transpose is free), lse
              + (4*(Hq + Hkv) + 4*(n_heads + n_kv_heads))/tp   QK L2-norm (RoPE layers, use_qk_norm)
              + ((4 + a)*(Hq + Hkv) + 4*(n_heads + n_kv_heads))/tp   per-head QK RMSNorm (qk_rms_norm,
                                        Qwen3): a*(Hq + Hkv) with torch.compile
              + cp                      with cp > 1, or a chunk that does not divide the sequence
                                        (`ActivationModel._cp_attention`): gathered K/V, or the
                                        received halos; the output again (no mask: `nn.attention`)
    dense FFN = norm(D)/tp + x(2)*D + 4*a*F/tp              w1/w3 input; w1 out, silu out, w3
                                                            out, product
    MoE       = norm(D)/tp + f*x(1 + 2s)*D                  ffn_norm, MoE input (router gate and,
                                                            s = 1 with a shared expert, its w1/w3;
                                                            DeepSeek-V3's fp32 gate keeps the input
                                                            itself, 4 bytes under autocast)
              + f*(4*E + 16*k)                              fp32 router scores, top-k indices
              + f*4*(b + z)                                 the balance loss's per-token score sums
                                                            (b = 1 when aux_loss_coeff > 0), the
                                                            z-loss's log-sum-exp (z likewise)
              + f*k * (4*D + 2*a*D + X + 12)                per routed copy: fp32 operand of the
                                                            gate multiply, the expert input and
                                                            output (kept by the index_add back
                                                            to tokens), the expert's activation
                                                            (X = 4*a*M/etp for SwiGLU, gpt-oss's
                                                            clamped SwiGLU 7*a*M/etp + 8), index
                                                            + gate
              + 4*a*Ms/tp                                   shared expert SwiGLU
        f = 1/tp under EP with TP (the MoE block runs on its sequence shard, and the shared
        expert is not TP-sharded), else 1 (MoE TP gathers the sequence); etp = tp under MoE TP
        (ep == 1), else 1.
    head      = norm(D)/tp + a*D + V'*(a + u + 4)           final norm, output input, logits, their
                                                            fp32 upcast (u = 4, or 0 when a = 4) and
                                                            the loss's fp32 log-softmax
        V' = vocab/tp with loss parallel (tp > 1, not disabled), else vocab.

Activation checkpointing (per block, as `distributed/activation_checkpoint.py` applies it; the
head is never checkpointed):
    none:      the block's full bytes are saved
    full:      only its input, r*D/tp
    selective: "op" saves the input and what the op policy marks must-save (sdpa output + lse,
               grouped-GEMM outputs, TP reduce-scatter and EP all-to-all outputs) plus half of the
               plain matmul outputs (it saves every second mm) but those of the shapes
               per_op_sac_force_recompute_mm_shapes_by_fqns names (always recomputed); an
               integer n fully checkpoints blocks 0, n, 2n, ... of the stage and saves the
               others whole. early_stop changes neither what is saved nor the working set below.

Peak activations of a pp rank = the most saved bytes of (stage, micro-batch) pairs alive at once
+ the backward working set of the largest block (2 x full - saved: recomputed activations and
their gradients) + the head on the last stage, all times T = micro-batch sequences x seq_len / cp
tokens. Without PP one pair (the whole local batch) is alive; with PP the pairs alive are read off
the schedule's own action list for the rank (`plan.pipeline.peak_activations_in_flight`): GPipe
holds every micro-batch, 1F1B ``pp - r`` on pp rank r, the interleaved and zero-bubble schedules
what their warm-up leaves in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.job_config import ActivationCheckpoint
from torchmoe.plan.context import HALO, LOCAL, CPLayout
from torchmoe.plan.layout import COLWISE, attention_linears
from torchmoe.plan.memo import memoised
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import PipelineLayout, peak_activations_in_flight

# ---- activations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationModel:
    """Per-token bytes saved for backward by each block and by the head (see module docstring).

    Attributes:
        args: the model's shape.
        dims: the layout (tp, cp, ep shard the tensors).
        a: bytes per element of the compute dtype.
        autocast: the forward runs under torch.autocast (no FSDP/DDP policy casts the
            parameters): the residual stream stays fp32 and matmul inputs are cast per use.
        compiled: blocks run under torch.compile (fused norms).
        loss_parallel: the loss runs on vocab-sharded logits.
        seq_len: tokens per whole sequence (context parallelism decides what attention keeps
            from it; unused with cp == 1).
        recompute_mm_fqns: ``per_op_sac_force_recompute_mm_shapes_by_fqns``: the per-op policy
            recomputes every matmul with the weight shape of a linear these name.
        document_masking: attention within documents (`nn.document_attention`): see
            `_packed_attention`.
    """

    args: ModelArgs
    dims: ParallelDims
    a: int
    compiled: bool
    loss_parallel: bool
    seq_len: int = 0
    autocast: bool = False
    recompute_mm_fqns: tuple[str, ...] = ()
    document_masking: bool = False

    @property
    def key(self) -> tuple:
        """A hashable summary of every field (the planner's memo tables key on it)."""
        return (repr(self.args), self.dims, self.a, self.compiled, self.loss_parallel, self.seq_len, self.autocast,
                self.recompute_mm_fqns, self.document_masking)

    @property
    def r(self) -> int:
        """Bytes per element of the residual stream: fp32 under autocast, else the compute dtype."""
        return 4 if self.autocast else self.a

    def _matmul_input(self, readers: int) -> float:
        """Bytes per element saved for a tensor that `readers` matmuls take as input: one copy in
        the compute dtype, or under autocast one cast copy per matmul."""
        return self.a * (readers if self.autocast else 1)

    def _norm(self, n: int) -> float:
        normalised = 4 if self.args.norm_weight_in_fp32 else self.r  # the weight multiply's other operand
        return (self.r * n if self.compiled else (4 + normalised) * n) + 4

    def _moe_tokens(self) -> float:
        """Fraction of the block's tokens the MoE block runs on: its sequence shard under EP with
        TP (no all-gather), else all of them (gathered under MoE TP)."""
        return 1 / self.dims.tp if self.dims.ep_enabled else 1.0

    def _reduce_scatters(self) -> float:
        """Bytes per token of one TP reduce-scatter output (a block's residual-stream shard)."""
        return self.a * self.args.dim / self.dims.tp if self.dims.tp_enabled else 0.0

    def block_input(self) -> float:
        return self.r * self.args.dim / self.dims.tp

    def _latent_norm(self, n: int) -> float:
        """A norm of a matmul's output (a bytes): fp32 upcast, normalised output, rstd (compiled:
        the input and rstd), as `_norm` of a residual-stream input."""
        return (self.a * n if self.compiled else (4 + self.a) * n) + 4

    def _latent_attention(self, layer: int) -> float:
        """MLA (`models.decoder.latent_attention`): the bottleneck projections are replicated, so
        what they save is not divided by tp; the values are padded to the query/key heads'
        width, so sdpa's v and output are head_dim wide; the output projection's input is a copy
        (the padding sliced off)."""
        m, tp, a = self.args, self.dims.tp, self.a
        hq = m.n_heads * m.head_dim
        total = self._norm(m.dim) / tp + self._matmul_input(2) * m.dim  # read by wq / wq_a and wkv_a
        if m.q_lora_rank:  # q_norm, then wq_b's input
            total += self._latent_norm(m.q_lora_rank) + self._matmul_input(1) * m.q_lora_rank
        total += self._latent_norm(m.kv_lora_rank) + self._matmul_input(1) * m.kv_lora_rank  # kv_norm, wkv_b's input
        if self.a == 4 or self.compiled:  # kv_norm keeps its input: a view of wkv_a's whole output, k_rope too
            total += self.a * m.qk_rope_head_dim
        total += a * 3 * hq / tp + a * hq / tp + 4 * m.n_heads / tp  # sdpa's q, k, v, output, lse
        return total + a * m.n_heads * m.v_head_dim / tp + self._cp_attention(layer)

    def _attention(self, layer: int) -> float:
        m, tp, a = self.args, self.dims.tp, self.a
        if m.latent_attention:
            return self._latent_attention(layer)
        hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        total = self._norm(m.dim) / tp + self._matmul_input(3) * m.dim + a * (hq + 2 * hkv) / tp
        total += a * hq / tp + 4 * m.n_heads / tp + self._cp_attention(layer)
        if m.use_qk_norm and m.rope_layers[layer]:
            total += (4 * (hq + hkv) + 4 * (m.n_heads + m.n_kv_heads)) / tp
        if m.qk_rms_norm:  # the heads' RMSNorm: norm(n) of the projections' outputs (a bytes)
            per_head = a * (hq + hkv) if self.compiled else (4 + a) * (hq + hkv)
            total += (per_head + 4 * (m.n_heads + m.n_kv_heads)) / tp
        return total

    def _ffn(self, layer: int) -> float:
        m, tp, a = self.args, self.dims.tp, self.a
        if not m.is_moe_layer(layer):
            return self._norm(m.dim) / tp + self._matmul_input(2) * m.dim + 4 * a * m.ffn_hidden_dim / tp
        f, k = self._moe_tokens(), m.top_k
        readers = 1 + 2 * (m.num_shared_experts > 0)  # router gate, shared expert w1 and w3
        moe_input = self._matmul_input(readers)
        if m.router_gate_fp32 and self.autocast:  # the fp32 gate keeps the fp32 input itself, no cast copy
            moe_input = self._matmul_input(readers - 1) + 4
        total = self._norm(m.dim) / tp + moe_input * m.dim * f + (4 * m.num_experts + 16 * k) * f
        if m.norm_topk_prob:  # the division's fp32 numerator (the k gates) and denominator
            total += (4 * k + 4) * f
        # The balance loss's per-token score sums (its divisor), the z-loss's log-sum-exp: fp32.
        total += 4 * f * ((m.aux_loss_coeff > 0) + (m.z_loss_coeff > 0))
        total += k * f * (4 * m.dim + 2 * a * m.dim + self._expert_activation() + 12)
        return total + 4 * a * m.moe_hidden_dim * m.num_shared_experts / tp

    def _expert_activation(self) -> float:
        """Bytes one routed copy saves inside its expert (`nn.experts`): SwiGLU's w1 and w3
        outputs, silu's output and the product (4 x M); gpt-oss's clamped SwiGLU its fused
        gate/up output (2 x M), the clamped gate, its sigmoid, up + 1, their product and the
        down projection's input (5 x M more), and the copy's expert index (int64, for the biases)."""
        per_hidden = self.a * self.args.moe_hidden_dim / self.dims.etp
        return 7 * per_hidden + 8 if self.args.experts_style == "clamped_swiglu" else 4 * per_hidden

    def _plain_matmuls(self, layer: int) -> dict[str, tuple[tuple[int, int], float]]:
        """Block `layer`'s plain matmuls by their linear's name in the block: its weight's full
        (in, out) shape (what the per-op policy matches) and the output's bytes per token."""
        m, tp, a = self.args, self.dims.tp, self.a
        dim = m.dim
        mms = self._attention_matmuls()
        if not m.is_moe_layer(layer):
            ffn = m.ffn_hidden_dim
            return {**mms, "feed_forward.w1": ((dim, ffn), a * ffn / tp), "feed_forward.w3": ((dim, ffn), a * ffn / tp),
                    "feed_forward.w2": ((ffn, dim), a * dim)}
        f, etp = self._moe_tokens(), self.dims.etp
        logits = 4 if m.router_gate_fp32 else a
        mms["moe.router.gate"] = ((dim, m.num_experts), f * logits * m.num_experts)
        if m.num_shared_experts:
            shared = m.moe_hidden_dim * m.num_shared_experts
            mms.update({"moe.shared_experts.w1": ((dim, shared), f * a * shared / etp),
                        "moe.shared_experts.w3": ((dim, shared), f * a * shared / etp),
                        "moe.shared_experts.w2": ((shared, dim), f * a * dim)})
        return mms

    def _attention_matmuls(self) -> dict[str, tuple[tuple[int, int], float]]:
        """`_plain_matmuls` of the attention: a column-wise linear writes its rank's share, a
        row-wise one (wo) its whole output before the TP reduce-scatter, a replicated one (MLA's
        bottleneck projections) its whole output on every rank."""
        tp, a = self.dims.tp, self.a
        return {lin.name: ((lin.n_in, lin.n_out), a * lin.n_out / (tp if lin.style == COLWISE else 1))
                for lin in attention_linears(self.args)}

    def _op_sac(self, layer: int) -> float:
        """Saved by the per-op policy besides the block input: sdpa, grouped GEMMs, reduce-scatters,
        all-to-alls in full, and (alternating) half of the plain matmul outputs not forced to be
        recomputed (`recompute_mm_fqns`, matched by weight shape as the policy does)."""
        m, tp, a = self.args, self.dims.tp, self.a
        always = a * m.n_heads * m.head_dim / tp + 4 * m.n_heads / tp + self._reduce_scatters()
        mms = self._plain_matmuls(layer)
        forced = {shape for name, (shape, _) in mms.items()
                  if any(f in f"layers.{layer}.{name}" for f in self.recompute_mm_fqns)}
        mm = sum(nbytes for shape, nbytes in mms.values() if shape not in forced)
        if not m.is_moe_layer(layer):
            return always + self._reduce_scatters() + mm / 2
        routed, etp = m.top_k * self._moe_tokens(), self.dims.etp
        always += routed * a * (2 * m.moe_hidden_dim / etp + m.dim)  # grouped GEMMs
        if self.dims.ep_enabled:
            always += 2 * routed * a * m.dim  # dispatch and combine all-to-alls
        else:
            always += self._reduce_scatters()
        return always + mm / 2

    def block_full(self, layer: int) -> float:
        """Everything block `layer` saves without activation checkpointing."""
        return self._attention(layer) + self._ffn(layer)

    def block_op_sac(self, layer: int) -> float:
        """What per-op selective AC (`distributed/activation_checkpoint.py`) keeps of block `layer`."""
        return self.block_input() + self._op_sac(layer)

    def head(self) -> float:
        m, tp, a = self.args, self.dims.tp, self.a
        vocab = m.vocab_size / tp if self.loss_parallel else m.vocab_size
        upcast = 0 if a == 4 else 4  # logits.float() is a no-op on fp32 logits
        # Each multi-token prediction depth has its logits and loss too (its block is a layer's).
        return (self._norm(m.dim) / tp + a * m.dim + vocab * (a + upcast + 4)) * (1 + m.mtp_layers)

    def _cp_attention(self, layer: int) -> float:
        """Bytes per local token that context parallelism, or chunks that do not divide the
        sequence, add to what attention saves (`plan.context` modes; nothing in local mode), for
        the fullest cp rank. No mask or score matrix in any mode (`nn.attention`):
          - global / gather: the whole sequence's keys and values (cp x a rank's own);
          - halo: the previous pieces' tails received from other ranks (a halo from the rank's
            own other piece is a view of its keys and values);
          - the attention output once more: pieces (and chunks cut at a piece or sequence end)
            are attended separately and concatenated, so the output projection's input is a copy.
        Document masking, and gpt-oss's attention under CP: `_packed_attention`.
        """
        m, cp = self.args, self.dims.cp
        if self.document_masking or (cp > 1 and m.windowed_or_sink_attention):
            return self._packed_attention(layer)
        chunk = m.layer_chunk(layer)
        output = self.a * m.n_heads * m.head_dim / self.dims.tp
        if cp == 1:
            cut = chunk is not None and chunk < self.seq_len and self.seq_len % chunk
            return output if cut else 0.0
        layout = CPLayout(self.seq_len, cp)
        mode, tokens = layout.mode(chunk), self.seq_len // cp
        if mode == LOCAL:
            return 0.0
        kv = 2 * self.a * m.n_kv_heads * m.head_dim / self.dims.tp  # per token
        if mode == HALO:
            received = max(sum(layout.halo(j, chunk) for j in layout.pieces(r) if j and layout.owner(j - 1) != r)
                           for r in range(cp))
            return (kv * received + output * tokens) / tokens
        return kv * (cp - 1) + output

    def _packed_attention(self, layer: int) -> float:
        """What attention within documents (`nn.document_attention`), and gpt-oss's sink and
        window attention under CP (`nn.sink_attention`), add: without CP nothing (document
        masking's segment tables live on the host; the whole rows' queries, keys and values go to
        the kernel as views). Under CP, each piece's keys and values go packed with the prefix its
        mode brings (halo, gathered; a copy, in every mode, so that no gathered or exchanged
        buffer stays alive through a view): the rank's keys and values once more than its own
        by the prefixes' length, for the fullest rank; and the pieces' outputs concatenated, so
        the output projection's input is a copy."""
        m, cp = self.args, self.dims.cp
        if cp == 1:
            return 0.0
        layout, chunk, window = CPLayout(self.seq_len, cp), m.layer_chunk(layer), m.layer_window(layer)
        kv = 2 * self.a * m.n_kv_heads * m.head_dim / self.dims.tp
        prefixes = max(sum(layout.prefix(piece, chunk, window) for piece in layout.pieces(r)) for r in range(cp))
        return kv * prefixes / (self.seq_len // cp) + self.a * m.n_heads * m.head_dim / self.dims.tp


def _saved_per_block(act: ActivationModel, layers: list[int], ac_cfg: ActivationCheckpoint) -> list[float]:
    """Per-token saved bytes of each block of one stage, in order, under the AC config."""
    if ac_cfg.mode == "none":
        return [act.block_full(i) for i in layers]
    if ac_cfg.mode == "full":
        return [act.block_input() for _ in layers]
    if ac_cfg.selective_ac_option == "op":
        return [act.block_op_sac(i) for i in layers]
    every = int(ac_cfg.selective_ac_option)
    return [act.block_input() if pos % every == 0 else act.block_full(i) for pos, i in enumerate(layers)]


def activation_bytes(act: ActivationModel, pipe: PipelineLayout, pp_rank: int, tokens: int, microbatches: int,
                      schedule: str, ac_cfg: ActivationCheckpoint) -> int:
    key = (act.key, pipe.key, pp_rank, tokens, microbatches, schedule, ac_cfg.mode, ac_cfg.selective_ac_option)
    return memoised(_ACTIVATIONS, key, lambda: _activation_bytes_of(act, pipe, pp_rank, tokens, microbatches,
                                                                    schedule, ac_cfg))


_ACTIVATIONS: dict[tuple, int] = {}


def _activation_bytes_of(act: ActivationModel, pipe: PipelineLayout, pp_rank: int, tokens: int, microbatches: int,
                         schedule: str, ac_cfg: ActivationCheckpoint) -> int:
    stages = pipe.ranks[pp_rank]
    saved_of: dict[int, float] = {}
    stage_saved: dict[int, float] = {}
    for s in stages:
        per_block = _saved_per_block(act, pipe.layers[s], ac_cfg)
        saved_of.update(zip(pipe.layers[s], per_block))
        stage_saved[s] = sum(per_block)
    saved = peak_activations_in_flight(schedule, act.dims.pp, pipe.num_stages, microbatches, pp_rank, stage_saved)
    working = max((2 * act.block_full(i) - b for i, b in saved_of.items()), default=0.0)
    head = act.head() if pipe.has_last_stage(pp_rank) else 0.0
    return int((saved + working + head) * tokens)
