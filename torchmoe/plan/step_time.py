"""Predicted step time of a job on a hardware profile: compute, exposed communication, bubble.

    python -c "from torchmoe.config import load_job_config; from torchmoe.plan.step_time import predict; \\
        from torchmoe.plan.hardware import load_profile; \\
        cfg = load_job_config(['--config', 'configs/llama4_16e.toml']); \\
        print(predict(cfg, 64, load_profile('h100')).summary())"

Pure arithmetic over `ModelArgs`, the layout and a `HardwareProfile` (no torch, no process group).
Every term is per rank and per step; with PP the slowest pp rank sets the pace.

Compute. FLOPs per token of each block, by op class, over the class's achieved rate:

    matmul      6 x (attention projections + dense FFN + shared expert + router gate) / tp
                + the output head 6 V D / tp on the last stage
    attention   12 x n_heads x head_dim x L / tp, L the mean keys a causal query sees
                (seq_len / 2, or about chunk / 2 in chunked layers: the causal half a kernel computes),
                at the profile's attention rate, for the fused kernel the device runs in the compute
                dtype (`HardwareProfile.attention_kernel`). Where none takes it (fp64, odd head
                dims, old GPUs) torchmoe's math definition runs instead: 14 x n_heads x head_dim x
                the full window (it computes the masked half too; 7 fp32 matmuls per block, the
                backward recomputing the scores) at the fp32 matmul rate, plus the fp32 score
                matrix's traffic (`_MATH_SCORE_PASSES` passes over it) as elementwise time
    grouped_mm  18 x D x M x top_k / tp (routed experts: EP moves tokens so each rank computes
                its share, MoE TP shards the hidden dim)

FLOPs of float8 linears (and of routed experts in float8) run at the float8 rates. Activation
checkpointing adds the forward again (a third of the block's FLOPs) for recomputed blocks, and
per-op selective AC half of the plain matmuls' forward (it replays the rest of the forward too:
its elementwise passes and kernels count as full AC's). Beside the FLOPs:

    elementwise  4 x the bytes a block saves for backward (`activations.ActivationModel`) over the
                 memory bandwidth: each saved tensor is written in forward, read in backward, and
                 its gradient written and read once more
    kernels      the operators a block runs per micro-batch (`KERNELS`; forward + backward,
                 counted from the eager model; a third under torch.compile, which fuses the
                 elementwise chains) x the profile's fixed cost per kernel
    optimizer    AdamW reads the parameter, gradient and two moments and writes three back:
                 7 x state bytes of the rank's shards over the memory bandwidth. Muon
                 (`plan.muon`): for its parameters 11 passes with nesterov (momentum lerp 3,
                 nesterov lerp 3, weight decay 2, update 3), 8 without, plus its Newton-Schulz
                 FLOPs at the matmul rate of ns_dtype; AdamW's 7 for the rest

Communication, from bytes over the bandwidth of the link each group crosses (`Link.seconds`:
the inter-node link when the group of rank 0 along that dim spans nodes of `gpus_per_node`
ranks, as torchmoe places ranks row-major with tp innermost):

    tp    sequence-parallel all-gathers (`tp_comm.tp_gather_bytes`) and as many reduce-scatters,
          four of each per block per micro-batch, on the critical path (exposed)
    ep    the dispatch and combine all-to-alls of every MoE block, forward and backward (and the
          forward's again when recomputed): exposed
    cp    the key/value all-gathers or halos (`dry_run.context_report`'s bytes): exposed
    pp    each stage's activation and its gradient per micro-batch: exposed
    muon  Muon's per-matrix all-gathers of its update in ns_dtype (`plan.muon`), after the
          backward with nothing left to hide behind: exposed
    fsdp  all-gathers of every FSDP unit in compute dtype (again in backward when resharding
          after forward, per micro-batch under PP) and reduce-scatters of its gradients; DDP and
          HSDP all-reduce gradients over dp_replicate. Prefetching hides them behind compute:
          exposed = max((1 - o) C, C - o x compute) with o the profile's `overlap`

The bubble: with bubble fraction b of the schedule (`pipeline.bubble_fraction`), the pipeline's
busy time (compute and the exposed tp/ep/cp/pp traffic) is stretched by ``b / (1 - b)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.dtypes import DTYPE_BYTES
from torchmoe.config.job_config import JobConfig
from torchmoe.nn.attention_kernel_choice import FLASH, MATH
from torchmoe.plan.activations import ActivationModel
from torchmoe.plan.context import CPLayout
from torchmoe.plan.float8 import selected_by
from torchmoe.plan.hardware import HardwareProfile
from torchmoe.plan.layout import REPLICATED, attention_linears, unit_sizes
from torchmoe.plan.memo import memoised
from torchmoe.plan.memory import (
    autocast_enabled,
    compute_dtype,
    compute_dtype_bytes,
    param_dtype_bytes,
    residual_dtype_bytes,
)
from torchmoe.plan.muon import muon_cost
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import (
    PipelineLayout,
    bubble_fraction,
    job_pipeline_layout,
    microbatches,
    rank_units,
)
from torchmoe.plan.tp_comm import float8_linear_names, tp_gather_bytes

__all__ = ["KERNELS", "StepPrediction", "predict", "predict_layout"]

# Operators one block runs per micro-batch, forward + backward, in eager mode: the leaf aten ops
# torch.profiler records for the tiny flavor (2026-12-02), a dense block (attention + SwiGLU FFN)
# 362 and an MoE block (attention + router, top-k, sort, dispatch, grouped GEMMs, combine, shared
# expert) 994; the final norm, head and loss about 75. Per FSDP unit and pass: its all-gather's
# copy-in/out and hooks; per parameter: AdamW's foreach ops and the gradient-norm reduction.
KERNELS = {"dense_block": 362, "moe_block": 994, "head": 75, "fsdp_unit": 12, "param": 4}
# torch.compile fuses the elementwise chains around the matmuls.
_COMPILED_KERNELS = 1 / 3
# Elementwise passes over each saved byte: written in forward, read in backward, its gradient
# written and read.
_ELEMENTWISE_PASSES = 4
# AdamW: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq.
_OPTIMIZER_PASSES = 7
# Muon: the momentum lerp (read buffer and gradient, write buffer), the nesterov lerp (read both,
# write the update), the weight decay (read, write) and the update (read parameter and result,
# write parameter); 8 without nesterov.
_MUON_PASSES = {True: 11, False: 8}
# The math definition's fp32 score matrix: written and exponentiated in forward; recomputed,
# exponentiated, multiplied into the score gradient and read twice more in backward.
_MATH_SCORE_PASSES = 8


@dataclass(frozen=True)
class StepPrediction:
    """One step of one layout on one profile; times in seconds per step, for the slowest rank.

    Attributes:
        compute: the busy time by part (matmul, attention, grouped_mm, elementwise, kernels,
            optimizer), recomputation included.
        comm: exposed communication by technique (tp, ep, cp, pp, fsdp, ddp; muon under Muon).
        comm_total: the same traffic before overlap, for the report.
        bubble: the pipeline's idle time.
        tokens: tokens the whole job trains on per step.
        world_size: ranks.
        attention_kernel: the kernel attention runs (`torchmoe.nn.attention_kernel_choice`).
        model_flops_per_token: training FLOPs per token in the PaLM convention (what MFU divides).
        peak_flops: the profile's peak FLOP/s in the compute dtype.
    """

    compute: dict[str, float]
    comm: dict[str, float]
    comm_total: dict[str, float]
    bubble: float
    tokens: int
    world_size: int
    model_flops_per_token: float
    peak_flops: float
    attention_kernel: str = FLASH

    @property
    def compute_s(self) -> float:
        return sum(self.compute.values())

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_s / self.world_size

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.model_flops_per_token / self.peak_flops

    def summary(self) -> str:
        return (f"{self.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU {self.mfu:.1%}, step {self.step_s:.3g} s = "
                f"compute {self.compute_s:.3g} + comm {self.comm_s:.3g} + bubble {self.bubble:.3g}")

    def as_dict(self) -> dict:
        return {"tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "step_s": self.step_s,
                "attention_kernel": self.attention_kernel,
                "compute_s": self.compute_s, "exposed_comm_s": self.comm_s, "bubble_s": self.bubble,
                "compute": dict(self.compute), "exposed_comm": dict(self.comm), "comm_before_overlap": dict(self.comm_total)}


@dataclass(frozen=True)
class _Context:
    """What every term needs: the job, its layout and the profile."""

    cfg: JobConfig
    args: ModelArgs
    dims: ParallelDims
    pipe: PipelineLayout
    profile: HardwareProfile
    gpus_per_node: int

    @cached_property
    def attention_kernel(self) -> str:
        return self.profile.attention_kernel(compute_dtype(self.cfg.training), self.args.head_dim)

    def spans_nodes(self, dim: str) -> bool:
        return _spans_nodes(self.dims, dim, self.gpus_per_node)

    def seconds(self, collective: str, dim: str, nbytes: float, calls: float, ranks: int) -> float:
        """`calls` collectives over `dim`'s `ranks`, `nbytes` in all (output size)."""
        if ranks <= 1 or calls <= 0:
            return 0.0
        link = self.profile.link(collective, self.spans_nodes(dim))
        return calls * link.seconds(collective, nbytes / calls, ranks)


@lru_cache(maxsize=1 << 14)
def _spans_nodes(dims: ParallelDims, dim: str, gpus_per_node: int) -> bool:
    """Whether rank 0's group along `dim` holds ranks of more than one node."""
    members = dims.layout()[dim].members(0)
    return members[0] // gpus_per_node != members[-1] // gpus_per_node


def _recomputed(cfg: JobConfig, position: int) -> float:
    """Fraction of the block at `position` in its stage that backward runs forward again for:
    1 under full AC (or the n-th blocks of selective n), 0 without."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return 1.0
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return float(position % int(ac.selective_ac_option) == 0)
    return 0.0


def _block_flops(ctx: _Context, layer: int, float8: set[str]) -> dict[str, float]:
    """Training FLOPs per local token of block `layer`, by (op class, dtype) key "class:dtype"."""
    m, tp = ctx.args, ctx.dims.tp
    dtype = compute_dtype(ctx.cfg.training)
    hq, d = m.n_heads * m.head_dim, m.dim
    prefix = f"layers.{layer}."

    def linear(name: str, n_in: int, n_out: int, split: int) -> tuple[str, float]:
        kind = "float8" if prefix + name in float8 else dtype
        return f"matmul:{kind}", 6 * n_in * n_out / split

    # A replicated linear (MLA's bottleneck projections) runs on the whole gathered sequence.
    terms = [linear(lin.name, lin.n_in, lin.n_out, 1 if lin.style == REPLICATED else tp)
             for lin in attention_linears(m)]
    window = _window(ctx, layer)
    if ctx.attention_kernel == MATH:
        terms.append(("matmul:float32", 14 * hq * window / tp))
    else:
        terms.append((f"attention:{dtype}", 12 * hq * (window + 1) / 2 / tp))
    if not m.is_moe_layer(layer):
        f = m.ffn_hidden_dim
        terms += [linear("feed_forward.w1", d, f, tp), linear("feed_forward.w3", d, f, tp),
                  linear("feed_forward.w2", f, d, tp)]
    else:
        # MoE TP replicates the gate over the gathered sequence; under EP it scores the rank's shard.
        terms.append(linear("moe.router.gate", d, m.num_experts, 1 if ctx.dims.moe_tp_enabled else tp))
        if m.num_shared_experts:
            s = m.moe_hidden_dim * m.num_shared_experts
            terms += [linear("moe.shared_experts.w1", d, s, tp), linear("moe.shared_experts.w3", d, s, tp),
                      linear("moe.shared_experts.w2", s, d, tp)]
        f8 = ctx.cfg.float8.routed_experts and selected_by(f"{prefix}moe.experts", ctx.cfg.float8.moe_fqns)
        terms.append((f"grouped_mm:{'float8' if f8 else dtype}", 18 * d * m.moe_hidden_dim * m.top_k / tp))
    out: dict[str, float] = {}
    for key, flops in terms:
        out[key] = out.get(key, 0.0) + flops
    return out


def _window(ctx: _Context, layer: int) -> int:
    """Keys the last query of a window sees in `layer`: its chunk, or the sequence."""
    chunk, seq = ctx.args.layer_chunk(layer), ctx.cfg.training.seq_len
    return min(chunk, seq) if chunk is not None else seq


def _math_score_bytes(ctx: _Context, layer: int) -> float:
    """Bytes per local token the math definition's fp32 score matrix moves in `layer`."""
    return _MATH_SCORE_PASSES * 4 * ctx.args.n_heads / ctx.dims.tp * _window(ctx, layer)


def _rate(ctx: _Context, key: str) -> float:
    op, dtype = key.split(":")
    return ctx.profile.rate(op, dtype)


def _compute(ctx: _Context, pp_rank: int, tokens: float, n_mb: int, act: ActivationModel,
             float8: set[str]) -> dict[str, float]:
    """Busy seconds of `pp_rank` for `tokens` local tokens per step in `n_mb` micro-batches."""
    cfg, m, prof = ctx.cfg, ctx.args, ctx.profile
    parts = dict.fromkeys(("matmul", "attention", "grouped_mm", "elementwise", "kernels", "optimizer"), 0.0)
    kernels = 0.0
    sac_op = cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "op"
    for stage in ctx.pipe.ranks[pp_rank]:
        for position, layer in enumerate(ctx.pipe.layers[stage]):
            again = _recomputed(cfg, position)
            for key, flops in _block_flops(ctx, layer, float8).items():
                extra = again / 3 + (1 / 6 if sac_op and key.startswith("matmul") else 0.0)
                parts[key.split(":")[0]] += tokens * flops * (1 + extra) / _rate(ctx, key)
            # Per-op selective AC replays the whole forward in backward, skipping only the saved
            # ops' compute: its elementwise traffic and kernels are full AC's.
            replayed = 1.0 if sac_op else again
            parts["elementwise"] += (_ELEMENTWISE_PASSES * (1 + replayed / 2) * act.block_full(layer) * tokens
                                     / (prof.memory_bandwidth_gbs * 1e9))
            if ctx.attention_kernel == MATH:
                parts["elementwise"] += _math_score_bytes(ctx, layer) * tokens / (prof.memory_bandwidth_gbs * 1e9)
            block = KERNELS["moe_block" if m.is_moe_layer(layer) else "dense_block"]
            kernels += block * (1 + replayed / 3) * n_mb
        if stage == ctx.pipe.num_stages - 1:
            dtype = compute_dtype(cfg.training)
            head = f"matmul:{'float8' if 'output' in float8 else dtype}"
            parts["matmul"] += tokens * 6 * m.vocab_size * m.dim / ctx.dims.tp / _rate(ctx, head)
            parts["elementwise"] += _ELEMENTWISE_PASSES * act.head() * tokens / (prof.memory_bandwidth_gbs * 1e9)
            kernels += KERNELS["head"] * n_mb
    if cfg.compile.enable:
        kernels *= _COMPILED_KERNELS
    params = _rank_params(ctx, pp_rank)
    parts["optimizer"] = _optimizer_seconds(ctx, pp_rank, params.stored)
    kernels += KERNELS["param"] * params.tensors
    if ctx.dims.fsdp_enabled:
        kernels += KERNELS["fsdp_unit"] * (params.units[False] + params.units[True]) * n_mb
    parts["kernels"] = kernels * prof.kernel_overhead_us * 1e-6
    return parts


def _optimizer_seconds(ctx: _Context, pp_rank: int, stored: int) -> float:
    """Seconds of the optimizer step of `pp_rank`'s `stored` elements: elementwise passes, and
    under Muon its Newton-Schulz matmuls."""
    opt, bandwidth = ctx.cfg.optimizer, ctx.profile.memory_bandwidth_gbs * 1e9
    p = param_dtype_bytes(ctx.cfg.training)
    if opt.name != "Muon":
        return _OPTIMIZER_PASSES * p * stored / bandwidth
    cost = muon_cost(ctx.args, ctx.dims, opt, rank_units(ctx.pipe, pp_rank))
    passes = _MUON_PASSES[opt.nesterov] * cost.muon_stored + _OPTIMIZER_PASSES * (stored - cost.muon_stored)
    return p * passes / bandwidth + cost.ns_flops / ctx.profile.rate("matmul", opt.ns_dtype)


def _muon_comm(ctx: _Context, pp_rank: int) -> float:
    """Seconds of Muon's gathers on `pp_rank`: one all-gather per parameter and split dim."""
    by_dim: dict[tuple[str, int], list[int]] = {}
    for dim, ranks, nbytes in muon_cost(ctx.args, ctx.dims, ctx.cfg.optimizer, rank_units(ctx.pipe, pp_rank)).gathers:
        by_dim.setdefault((dim, ranks), []).append(nbytes)
    return sum(ctx.seconds("all_gather", dim, sum(sizes), len(sizes), ranks) for (dim, ranks), sizes in by_dim.items())


@dataclass(frozen=True)
class _RankParams:
    """What one rank of a pp rank holds: elements stored (sharded), parameter tensors, and per
    kind (False: dense, True: routed experts) the TP/EP-local elements FSDP gathers and its units."""

    stored: int
    tensors: int
    unsharded: dict[bool, int]
    units: dict[bool, int]


def _rank_params(ctx: _Context, pp_rank: int) -> _RankParams:
    def compute() -> _RankParams:
        sizes = unit_sizes(ctx.args, ctx.dims)
        local = [sizes[unit] for unit in rank_units(ctx.pipe, pp_rank)]
        kinds = (False, True)
        return _RankParams(
            stored=sum(u.stored for u in local), tensors=sum(sum(u.tensors) for u in local),
            unsharded={k: sum(u.local[k] for u in local) for k in kinds},
            units={k: sum(u.tensors[k] > 0 for u in local) for k in kinds})

    return memoised(_RANK_PARAMS, (repr(ctx.args), ctx.dims, ctx.pipe.key, pp_rank), compute)


_RANK_PARAMS: dict[tuple, _RankParams] = {}


def _reshards(ctx: _Context) -> bool:
    """FSDP frees each unit's gathered parameters after forward (`data_parallel`'s rule)."""
    policy = ctx.cfg.parallelism.fsdp_reshard_after_forward
    return policy == "always" or (policy == "default" and not ctx.dims.pp_enabled)


def _critical_comm(ctx: _Context, pp_rank: int, tokens: float, n_mb: int) -> dict[str, float]:
    """Exposed seconds of the collectives on the critical path: TP, EP, CP and PP."""
    cfg, m, dims = ctx.cfg, ctx.args, ctx.dims
    a, r = compute_dtype_bytes(cfg.training), residual_dtype_bytes(dims, cfg.training)
    layers = [(layer, pos) for s in ctx.pipe.ranks[pp_rank] for pos, layer in enumerate(ctx.pipe.layers[s])]
    out = dict.fromkeys(("tp", "ep", "cp", "pp"), 0.0)
    if dims.tp_enabled:
        gathered = tp_gather_bytes(cfg, dims, m, ctx.pipe)
        # Received bytes -> output bytes; the reduce-scatters move the high-precision tensors again.
        output = gathered.total * dims.tp / (dims.tp - 1)
        scatter = gathered.high_precision * dims.tp / (dims.tp - 1)  # always in high precision
        calls = 4 * n_mb * sum(1 + _recomputed(cfg, pos) / 2 for _, pos in layers)
        out["tp"] = (ctx.seconds("all_gather", "tp", output, calls, dims.tp)
                     + ctx.seconds("reduce_scatter", "tp", scatter, calls, dims.tp))
    moe = [(layer, pos) for layer, pos in layers if m.is_moe_layer(layer)]
    if dims.ep_enabled and moe:
        routed = tokens / dims.tp * m.top_k * m.dim * a  # bytes one all-to-all moves per MoE block
        passes = sum(4 + 2 * _recomputed(cfg, pos) for _, pos in moe)
        out["ep"] = ctx.seconds("all_to_all", "ep", routed * passes, passes * n_mb, dims.ep)
    if dims.cp_enabled:
        layout = CPLayout(cfg.training.seq_len, dims.cp)
        kv = 2 * a * m.n_kv_heads * m.head_dim / dims.tp
        sequences = tokens * dims.cp / cfg.training.seq_len
        for layer, pos in layers:
            chunk, window = m.layer_chunk(layer), m.layer_window(layer)
            mode = layout.mode(chunk, window)
            received = layout.bytes_received(mode, chunk, kv, window) * sequences * (2 + _recomputed(cfg, pos))
            if mode in ("global", "gather"):
                out["cp"] += ctx.seconds("all_gather", "cp", received * dims.cp / (dims.cp - 1), 3 * n_mb, dims.cp)
            elif mode == "halo":
                out["cp"] += ctx.seconds("p2p", "cp", received, 3 * n_mb, 2)
    if dims.pp_enabled:
        boundary = tokens * m.dim * r / dims.tp  # one stage's output (and its gradient) per step
        stages = len(ctx.pipe.ranks[pp_rank])
        out["pp"] = ctx.seconds("p2p", "pp", 2 * boundary * stages, 2 * n_mb * stages, 2)
    return out


def _data_parallel_comm(ctx: _Context, pp_rank: int, accumulation: int, n_pipe: int) -> float:
    """Seconds of FSDP gathers and reduce-scatters and of DDP/HSDP all-reduces, before overlap:
    FSDP gathers per accumulation step (per pipeline micro-batch too when resharding) and
    reduce-scatters per accumulation step; dp_replicate all-reduces once per step (the trainer
    syncs replicas in the last micro-batch only)."""
    cfg, dims = ctx.cfg, ctx.dims
    params = _rank_params(ctx, pp_rank)
    c = DTYPE_BYTES[cfg.training.mixed_precision_param] if not autocast_enabled(dims, cfg.training) \
        else param_dtype_bytes(cfg.training)
    reduce = DTYPE_BYTES[cfg.training.mixed_precision_reduce]
    seconds = 0.0
    if dims.fsdp_enabled:
        gathers = accumulation * (2 * n_pipe if _reshards(ctx) else 1)
        for expert, dim, ranks in ((False, "dp_shard_cp", dims.dp_shard_cp), (True, "efsdp", dims.efsdp)):
            numel, units = params.unsharded[expert], params.units[expert]
            if not units or ranks <= 1:
                continue
            seconds += ctx.seconds("all_gather", dim, c * numel * gathers, units * gathers, ranks)
            seconds += ctx.seconds("reduce_scatter", dim, reduce * numel * accumulation, units * accumulation, ranks)
    if dims.dp_replicate > 1:
        seconds += ctx.seconds("all_reduce", "dp_replicate", reduce * params.stored, 1 + params.tensors // 64,
                               dims.dp_replicate)
    return seconds


def predict_layout(cfg: JobConfig, dims: ParallelDims, profile: HardwareProfile, gpus_per_node: int,
                   *, args: ModelArgs | None = None, pipe: PipelineLayout | None = None) -> StepPrediction:
    """The step of `cfg` on the resolved layout `dims` (a config that passed the preflight)."""
    args = args or model_args_from_config(cfg.model)
    pipe = pipe or job_pipeline_layout(args, dims, cfg.parallelism, cfg.training, cfg.optimizer)
    ctx = _Context(cfg, args, dims, pipe, profile, gpus_per_node)
    t = cfg.training
    accumulation = t.global_batch_size // (t.local_batch_size * dims.dp) if t.global_batch_size > 0 else 1
    n_pipe = microbatches(t, cfg.parallelism)[0] if dims.pp_enabled else 1
    n_mb = accumulation * n_pipe  # forward passes through each block per step
    tokens = accumulation * t.local_batch_size * t.seq_len / dims.cp
    act = ActivationModel(args, dims, compute_dtype_bytes(t), cfg.compile.enable, seq_len=t.seq_len,
                          loss_parallel=dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
                          autocast=autocast_enabled(dims, t), document_masking=t.document_masking)
    float8 = float8_linear_names(args, cfg.float8.filter_fqns) if cfg.float8.enable else set()
    model_flops = args.flops_per_token(t.seq_len)
    best: StepPrediction | None = None
    bubble = bubble_fraction(cfg.parallelism.pipeline_parallel_schedule, dims.pp, pipe.num_stages, n_pipe)
    for pp_rank in range(dims.pp):
        compute = _compute(ctx, pp_rank, tokens, n_mb, act, float8)
        critical = _critical_comm(ctx, pp_rank, tokens, n_mb)
        busy = sum(compute.values()) + sum(critical.values())
        overlappable = _data_parallel_comm(ctx, pp_rank, accumulation, n_pipe)
        o = profile.overlap
        exposed = max((1 - o) * overlappable, overlappable - o * sum(compute.values()))
        name = "fsdp" if dims.fsdp_enabled else "ddp"
        comm = {**critical, name: exposed}
        total = {**critical, name: overlappable}
        if cfg.optimizer.name == "Muon":  # after the pipeline drains: not stretched by the bubble
            comm["muon"] = total["muon"] = _muon_comm(ctx, pp_rank)
        pred = StepPrediction(
            compute=compute, comm=comm, comm_total=total, bubble=busy * bubble / (1 - bubble),
            tokens=accumulation * t.local_batch_size * dims.dp * t.seq_len, world_size=dims.world_size,
            model_flops_per_token=model_flops,
            peak_flops=profile.peak(compute_dtype(t)), attention_kernel=ctx.attention_kernel)
        if best is None or pred.step_s > best.step_s:
            best = pred
    return best


def predict(cfg: JobConfig, world_size: int, profile: HardwareProfile, gpus_per_node: int | None = None) -> StepPrediction:
    """`predict_layout` for `cfg`'s own degrees on `world_size` ranks."""
    dims = ParallelDims(**resolve_degrees(cfg.parallelism, world_size), world_size=world_size)
    return predict_layout(cfg, dims, profile, gpus_per_node or profile.gpus_per_node)
