"""Bytes the tensor-parallel all-gathers move per training step: what the dry run prints for TP,
and what float8 TP saves.

Under sequence parallelism (`distributed.tensor_parallel`) every all-gather rebuilds a full
(tokens, dim) activation or gradient from its tp sequence shards, so each rank receives
``(tp - 1) / tp * tokens * dim`` elements. Per block and micro-batch:

    forward   attention input                 float8 when wq, wk, wv are all float8 (tensorwise TP);
                                              high precision under latent attention (MLA)
              dense FFN input                 float8 when w1, w3 are both float8
              MoE input (MoE TP)              high precision (the router and routed experts read it)
    backward  gradient of wo's output         float8 (e5m2) when wo is float8 (the backward of its
              gradient of the dense w2's        reduce-scatter; torchao casts before the gather)
              gradient of the MoE output      high precision
    recompute the forward's gathers again for blocks under full AC, every n-th block under
              selective AC n, every block under per-op selective AC (it saves no all-gather)

plus, on the first stage, the backward gather of the embedding's output gradient and, on the
last, the forward gather of the output head's input (and of the logits when loss parallel is off).
High precision is the residual stream's dtype (`memory.residual_dtype_bytes`); logits are in the
compute dtype. Expert parallelism alongside TP gathers nothing for MoE blocks (EP moves the
tokens). The count is per rank of the pp rank that moves the most.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.job_config import JobConfig
from torchmoe.plan.float8 import float8_linear_eligible, float8_tp_enabled
from torchmoe.plan.layout import param_specs
from torchmoe.plan.memo import memoised
from torchmoe.plan.memory import compute_dtype_bytes, residual_dtype_bytes
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import PipelineLayout

FLOAT8_BYTES = 1


@dataclass(frozen=True)
class TPGatherBytes:
    """Bytes one rank receives through TP all-gathers in a step (`total`), split by pass, and
    what plain (high-precision) TP styles would move for the same step (`high_precision`)."""

    forward: float
    backward: float
    recompute: float
    high_precision: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def float8_linear_names(args: ModelArgs, filter_fqns: list[str]) -> set[str]:
    """Module names of the nn.Linear layers float8 conversion swaps (`float8.float8_linear_eligible`,
    on their (out, in) shapes before any sharding)."""
    return {s.fqn.removesuffix(".weight") for s in param_specs(args)
            if len(s.shape) == 2 and not s.fqn.startswith("tok_embeddings") and s.fqn.endswith(".weight")
            and float8_linear_eligible(s.fqn.removesuffix(".weight"), *s.shape, filter_fqns)}


def tp_gather_bytes(cfg: JobConfig, dims: ParallelDims, args: ModelArgs, pipe: PipelineLayout) -> TPGatherBytes:
    """The TP all-gather bytes of one step on one rank (see the module docstring); zeros without TP."""
    if not dims.tp_enabled:
        return TPGatherBytes(0.0, 0.0, 0.0, 0.0)
    rows = max(cfg.training.global_batch_size, 0) // dims.dp or cfg.training.local_batch_size
    # Elements one rank receives per all-gather of a (tokens, dim) tensor, over the whole step.
    per_gather = rows * cfg.training.seq_len / dims.cp * args.dim * (dims.tp - 1) / dims.tp
    r, a = residual_dtype_bytes(dims, cfg.training), compute_dtype_bytes(cfg.training)
    per_block = _gathers_per_block(args, dims, cfg, r)
    ac = cfg.activation_checkpoint
    loss_parallel = not cfg.parallelism.disable_loss_parallel
    best: TPGatherBytes | None = None
    for pp_rank, stages in enumerate(pipe.ranks):
        fwd = bwd = rec = hp = 0.0
        for stage in stages:
            for position, layer in enumerate(pipe.layers[stage]):
                (block_fwd, block_bwd), (plain_fwd, plain_bwd) = per_block[layer]
                recomputed = ac.mode == "full" or (ac.mode == "selective" and (
                    ac.selective_ac_option == "op" or position % int(ac.selective_ac_option) == 0))
                fwd, bwd, rec = fwd + block_fwd, bwd + block_bwd, rec + block_fwd * recomputed
                hp += plain_fwd * (1 + recomputed) + plain_bwd
            if stage == 0:  # the embedding's output gradient
                bwd, hp = bwd + r, hp + r
            if stage == pipe.num_stages - 1:  # the head's input, and the logits without loss parallel
                head = r + (0 if loss_parallel else a * args.vocab_size / args.dim)
                fwd, hp = fwd + head, hp + head
        result = TPGatherBytes(fwd * per_gather, bwd * per_gather, rec * per_gather, hp * per_gather)
        if best is None or result.total > best.total:
            best = result
    return best


def _gathers_per_block(args: ModelArgs, dims: ParallelDims, cfg: JobConfig, r: int
                       ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """`_block_gathers` of every block, with the job's float8 linears and with plain styles;
    memoised by what they depend on (the search asks for it in every layout of a family)."""
    float8_tp = float8_tp_enabled(cfg.float8)

    def compute() -> list[tuple[tuple[int, int], tuple[int, int]]]:
        float8 = float8_linear_names(args, cfg.float8.filter_fqns) if float8_tp else set()
        return [(_block_gathers(args, i, dims, float8, r), _block_gathers(args, i, dims, set(), r))
                for i in range(args.n_layers + args.mtp_layers)]

    key = (repr(args), dims.moe_tp_enabled, float8_tp and tuple(cfg.float8.filter_fqns), r)
    return memoised(_GATHERS, key, compute)


_GATHERS: dict[tuple, list[tuple[tuple[int, int], tuple[int, int]]]] = {}


def _block_gathers(args: ModelArgs, layer: int, dims: ParallelDims, float8: set[str], r: int) -> tuple[int, int]:
    """Bytes per gathered element of block `layer`, (forward, backward), summed over its
    all-gathers; `float8` names the float8 linears when TP runs in float8 (empty: plain styles)."""
    prefix = f"layers.{layer}."

    def elem(*names: str) -> int:
        return FLOAT8_BYTES if all(prefix + n in float8 for n in names) else r

    # MLA's input is gathered in high precision: its replicated readers take no float8 tensor.
    fwd = r if args.latent_attention else elem("attention.wq", "attention.wk", "attention.wv")
    bwd = elem("attention.wo")
    if not args.is_moe_layer(layer):
        fwd, bwd = fwd + elem("feed_forward.w1", "feed_forward.w3"), bwd + elem("feed_forward.w2")
    elif dims.moe_tp_enabled:
        fwd, bwd = fwd + r, bwd + r
    return fwd, bwd
