"""Where the model's parameters live: pipeline stages, and each tensor's shard on one rank.

    python -c "from torchmoe.plan.layout import param_specs; from torchmoe.models.llama4 import FLAVORS; \\
        print(*param_specs(FLAVORS['tiny'])[:6], sep='\\n')"

Derived from `ModelArgs` alone (no model is built), mirroring the tensors `models/decoder/model.py`
creates. The sharding rules are the ones the parallelize pipeline applies (DESIGN §4):

- TP (`models/decoder/tensor_parallel.py`): attention wq/wk/wv and dense SwiGLU w1/w3 column-wise
  (dim 0), wo and w2 row-wise (dim 1), the embedding and output head over the vocab (dim 0);
  norms replicated (Qwen3's per-head q/k norms too). Latent attention (DeepSeek): wq / wq_b and
  wkv_b column-wise, wo row-wise, the bottleneck projections wq_a / wkv_a and their norms replicated. The MoE block's own parameters follow the experts: under MoE TP (ep == 1,
  tp > 1) the shared expert is column/row-wise like a dense FFN and the router gate replicated;
  under EP the MoE block runs on each rank's sequence shard and TP leaves them whole.
- Routed experts ``w1, w3: [E, hidden, dim]``, ``w2: [E, dim, hidden]``: EP shards dim 0; under
  MoE TP hidden is sharded instead (dim 1 of w1/w3, dim 2 of w2).
- FSDP2 shards dim 0 of each rank's TP/EP-local tensor over dp_shard_cp (dense) or efsdp
  (experts), padding it to a multiple of the group size. Experts shard dim 1 instead when a rank
  holds fewer experts than the efsdp group has ranks (`expert_fsdp_shard_dim`), since padding
  dim 0 would leave a whole expert on every rank.
- PP (`plan/pipeline.py`) splits the blocks into contiguous stages; a pp rank holds its stages'
  blocks, the embedding with the first stage and the final norm and output head with the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from torchmoe.arch.model_args import ModelArgs
from torchmoe.plan.memo import memoised
from torchmoe.plan.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model and how it is sharded.

    Attributes:
        fqn: its name in ``Transformer.state_dict()``.
        shape: the full (unsharded) shape.
        tp_dim: the dim TP shards, None if replicated over tp.
        kind: "dense"; "moe" (router gate and shared expert: TP-sharded only under MoE TP);
            "expert" (routed experts: EP shards dim 0, TP only under MoE TP, FSDP over efsdp).
        layer: the block index, or None for the embedding, final norm and output head.
    """

    fqn: str
    shape: tuple[int, ...]
    tp_dim: int | None
    kind: str = "dense"
    layer: int | None = None

    @property
    def expert(self) -> bool:
        return self.kind == "expert"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def fsdp_unit(self) -> str:
        """The FSDP2 module this parameter is gathered with: its block, the embedding or the head."""
        if self.layer is not None:
            return f"layers.{self.layer}"
        return "tok_embeddings" if self.fqn.startswith("tok_embeddings") else "head"


def _swiglu(prefix: str, dim: int, hidden: int, layer: int, kind: str) -> list[ParamSpec]:
    return [
        ParamSpec(f"{prefix}.w1.weight", (hidden, dim), 0, kind, layer),
        ParamSpec(f"{prefix}.w2.weight", (dim, hidden), 1, kind, layer),
        ParamSpec(f"{prefix}.w3.weight", (hidden, dim), 0, kind, layer),
    ]


def param_specs(args: ModelArgs) -> list[ParamSpec]:
    """Every parameter of ``Transformer(args)``, in module order (memoised by the arguments' text:
    the layout search asks for the same model's list thousands of times)."""
    return list(memoised(_SPECS, repr(args), lambda: tuple(_param_specs(args)), limit=32))


_SPECS: dict[str, tuple[ParamSpec, ...]] = {}


COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated"


@dataclass(frozen=True)
class AttentionLinear:
    """One linear of a block's attention: its name in the block (``attention.wq``), its input and
    output widths, and its TP style: column-wise (output features split), row-wise (input
    features split: a partial output, reduce-scattered) or replicated (whole on every rank)."""

    name: str
    n_in: int
    n_out: int
    style: str


def attention_linears(args: ModelArgs) -> list[AttentionLinear]:
    """The attention's linears, in module order, with their TP styles
    (`models.decoder.tensor_parallel`): grouped-query (wq/wk/wv column-wise, wo row-wise), or
    latent attention (the projections into heads column-wise, the bottleneck projections
    replicated)."""
    d, q_out = args.dim, args.n_heads * args.head_dim
    if not args.latent_attention:
        kv_out = args.n_kv_heads * args.head_dim
        return [AttentionLinear("attention.wq", d, q_out, COLWISE), AttentionLinear("attention.wk", d, kv_out, COLWISE),
                AttentionLinear("attention.wv", d, kv_out, COLWISE), AttentionLinear("attention.wo", q_out, d, ROWWISE)]
    r, heads = args.kv_lora_rank, args.n_heads
    query = ([AttentionLinear("attention.wq_a", d, args.q_lora_rank, REPLICATED),
              AttentionLinear("attention.wq_b", args.q_lora_rank, q_out, COLWISE)]
             if args.q_lora_rank else [AttentionLinear("attention.wq", d, q_out, COLWISE)])
    return [*query, AttentionLinear("attention.wkv_a", d, r + args.qk_rope_head_dim, REPLICATED),
            AttentionLinear("attention.wkv_b", r, heads * (args.qk_nope_head_dim + args.v_head_dim), COLWISE),
            AttentionLinear("attention.wo", heads * args.v_head_dim, d, ROWWISE)]


def _attention_specs(args: ModelArgs, i: int) -> list[ParamSpec]:
    """Block `i`'s attention parameters: gpt-oss's sinks (one per head, split with the heads), its
    linears (`attention_linears`) with their biases (gpt-oss: a column-wise linear's split with its
    outputs, a row-wise one's whole) and norms, replicated over tp (Qwen3's per-head norms: each
    rank normalises its heads with the whole weight; MLA's bottleneck norms)."""
    p = f"layers.{i}"
    tp_dim = {COLWISE: 0, ROWWISE: 1, REPLICATED: None}
    specs = [ParamSpec(f"{p}.attention.sinks", (args.n_heads,), 0, layer=i)] if args.attention_sinks else []
    # MLA's bottleneck norms follow their projections (module order); per-head norms come last.
    after = {"attention.wq_a": ("q_norm", args.q_lora_rank), "attention.wkv_a": ("kv_norm", args.kv_lora_rank)}
    for lin in attention_linears(args):
        specs.append(ParamSpec(f"{p}.{lin.name}.weight", (lin.n_out, lin.n_in), tp_dim[lin.style], layer=i))
        if args.attention_bias:
            specs.append(ParamSpec(f"{p}.{lin.name}.bias", (lin.n_out,), 0 if lin.style == COLWISE else None, layer=i))
        if args.latent_attention and lin.name in after:
            norm, size = after[lin.name]
            specs.append(ParamSpec(f"{p}.attention.{norm}.weight", (size,), None, layer=i))
    if args.qk_rms_norm and not args.latent_attention:
        specs += [ParamSpec(f"{p}.attention.{n}.weight", (args.head_dim,), None, layer=i) for n in ("q_norm", "k_norm")]
    return specs


def _moe_specs(args: ModelArgs, i: int) -> list[ParamSpec]:
    """Block `i`'s router and routed experts (`nn.experts`: SwiGLU's w1/w2/w3, or gpt-oss's fused
    w13 and w2 with their biases), each expert parameter on the dim MoE TP shards."""
    p, d, e, h = f"layers.{i}.moe", args.dim, args.num_experts, args.moe_hidden_dim
    specs = [ParamSpec(f"{p}.router.gate.weight", (e, d), None, "moe", i)]
    if args.router_bias:
        specs.append(ParamSpec(f"{p}.router.gate.bias", (e,), None, "moe", i))
    if args.experts_style == "clamped_swiglu":
        experts = [("w13", (e, 2 * h, d), 1), ("b13", (e, 2 * h), 1), ("w2", (e, d, h), 2), ("b2", (e, d), 1)]
    else:
        experts = [("w1", (e, h, d), 1), ("w2", (e, d, h), 2), ("w3", (e, h, d), 1)]
    return specs + [ParamSpec(f"{p}.experts.{name}", shape, tp_dim, "expert", i) for name, shape, tp_dim in experts]


def _param_specs(args: ModelArgs) -> list[ParamSpec]:
    d = args.dim
    specs = [ParamSpec("tok_embeddings.weight", (args.vocab_size, d), 0)]
    for i in range(args.n_layers + args.mtp_layers):  # the multi-token prediction blocks last
        p = f"layers.{i}"
        specs += _attention_specs(args, i)
        specs += [
            ParamSpec(f"{p}.attention_norm.weight", (d,), None, layer=i),
            ParamSpec(f"{p}.ffn_norm.weight", (d,), None, layer=i),
        ]
        if not args.is_moe_layer(i):
            specs += _swiglu(f"{p}.feed_forward", d, args.ffn_hidden_dim, i, "dense")
            continue
        specs += _moe_specs(args, i)
        if args.num_shared_experts:
            specs += _swiglu(f"{p}.moe.shared_experts", d, args.moe_hidden_dim * args.num_shared_experts, i, "moe")
    specs.append(ParamSpec("norm.weight", (d,), None))
    if not args.tie_word_embeddings:
        specs.append(ParamSpec("output.weight", (args.vocab_size, d), 0))
    for i in args.mtp_layer_ids:  # each module's norms and input projection, replicated over tp
        specs += [ParamSpec(f"mtp.{i}.enorm.weight", (d,), None), ParamSpec(f"mtp.{i}.hnorm.weight", (d,), None),
                  ParamSpec(f"mtp.{i}.eh_proj.weight", (d, 2 * d), None), ParamSpec(f"mtp.{i}.norm.weight", (d,), None)]
    return specs


# ---- per-rank shards ---------------------------------------------------------------------------


@lru_cache(maxsize=1 << 16)
def local_shape(spec: ParamSpec, dims: ParallelDims) -> tuple[int, ...]:
    """The shape one rank holds after TP and EP, before FSDP (what FSDP all-gathers back).

    Uneven splits take the larger piece (ceil), the shard of the fullest rank.
    """
    shape = list(spec.shape)
    tp = dims.tp if spec.kind == "dense" else dims.etp
    if spec.expert:
        shape[0] = math.ceil(shape[0] / dims.ep)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)
    return tuple(shape)


def fsdp_group_size(spec: ParamSpec, dims: ParallelDims) -> int:
    """Ranks FSDP shards `spec` over (1 when FSDP is not applied)."""
    if not dims.fsdp_enabled:
        return 1
    return dims.efsdp if spec.expert else dims.dp_shard_cp


def expert_fsdp_shard_dim(local_experts: int, efsdp: int) -> int:
    """The dim FSDP should shard routed-expert weights on: 0 (experts) when every efsdp rank gets
    at least one local expert, else 1 (hidden of w1/w3, dim of w2)."""
    return 0 if local_experts >= efsdp else 1


@lru_cache(maxsize=1 << 16)
def shard_numel(spec: ParamSpec, dims: ParallelDims) -> int:
    """Elements of `spec` one rank stores: TP/EP-local, then FSDP-sharded with padding."""
    shape = local_shape(spec, dims)
    n = fsdp_group_size(spec, dims)
    # Only expert-parallel experts form their own FSDP unit with that placement rule; under MoE TP
    # they sit in their block's unit, sharded on dim 0 like every other parameter.
    dim = expert_fsdp_shard_dim(shape[0], n) if spec.expert and dims.ep_enabled else 0
    return math.ceil(shape[dim] / n) * math.prod(shape) // shape[dim]


# ---- per-unit totals ---------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitSize:
    """What one rank holds of one FSDP unit (a block, the embedding, or the final norm and head).

    Attributes:
        stored: elements stored after TP/EP and FSDP sharding, padding included (`shard_numel`).
        local: TP/EP-local elements, what FSDP all-gathers: (dense parameters, routed experts).
        tensors: parameter tensors: (dense, routed experts).
        matmul_local: TP/EP-local elements of the matmul weights, what autocast casts (norms are
            not matmul weights, nor an untied embedding, which is a lookup).
    """

    stored: int
    local: tuple[int, int]
    tensors: tuple[int, int]
    matmul_local: int


def unit_sizes(args: ModelArgs, dims: ParallelDims) -> dict[str, UnitSize]:
    """`UnitSize` of every FSDP unit of ``Transformer(args)`` under `dims`, in module order.

    Memoised, and blocks with the same parameter shapes (all dense blocks, all MoE blocks) are
    summed once: the layout search asks for hundreds of layouts of a 48-block model.
    """
    def compute() -> dict[str, UnitSize]:
        by_shapes: dict[tuple, UnitSize] = {}
        out = {}
        for unit, specs in _units(args).items():
            shapes = tuple((s.shape, s.tp_dim, s.kind, s.fqn == "tok_embeddings.weight") for s in specs)
            if shapes not in by_shapes:
                by_shapes[shapes] = _unit_size(specs, dims, args)
            out[unit] = by_shapes[shapes]
        return out

    return memoised(_UNIT_SIZES, (repr(args), dims), compute)


_UNIT_SIZES: dict[tuple, dict[str, UnitSize]] = {}


def _units(args: ModelArgs) -> dict[str, tuple[ParamSpec, ...]]:
    """The parameters of each FSDP unit, in module order (memoised by the arguments' text)."""
    def compute() -> dict[str, tuple[ParamSpec, ...]]:
        out: dict[str, list[ParamSpec]] = {}
        for spec in param_specs(args):
            out.setdefault(spec.fsdp_unit, []).append(spec)
        return {unit: tuple(specs) for unit, specs in out.items()}

    return memoised(_UNITS, repr(args), compute, limit=32)


_UNITS: dict[str, dict[str, tuple[ParamSpec, ...]]] = {}


def autocast_casts(fqn: str, args: ModelArgs) -> bool:
    """Autocast makes a compute-dtype copy of the matrix `fqn` of ``Transformer(args)`` in each
    forward: not of an untied embedding (a lookup), nor of an fp32 router gate
    (`router_gate_fp32`: it multiplies its fp32 weight itself)."""
    if fqn == "tok_embeddings.weight":
        return args.tie_word_embeddings
    return not (args.router_gate_fp32 and fqn.endswith("moe.router.gate.weight"))


def _unit_size(specs: tuple[ParamSpec, ...], dims: ParallelDims, args: ModelArgs) -> UnitSize:
    local = [0, 0]
    tensors = [0, 0]
    matmul = 0
    for spec in specs:
        n = math.prod(local_shape(spec, dims))
        local[spec.expert] += n
        tensors[spec.expert] += 1
        if len(spec.shape) >= 2 and autocast_casts(spec.fqn, args):
            matmul += n
    return UnitSize(sum(shard_numel(s, dims) for s in specs), (local[0], local[1]), (tensors[0], tensors[1]), matmul)
