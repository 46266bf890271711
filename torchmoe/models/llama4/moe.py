"""Mixture-of-experts layer: token-choice router, grouped routed experts, shared expert.

    python -m pytest -q tests/unit/test_moe.py

Dropless: every token reaches its top-k experts. Routed experts are one module holding
``[num_experts, ...]`` weights, run with ``torch._grouped_mm`` over tokens sorted expert-major;
the per-expert loop is kept as the reference the grouped path is tested against.

Routed tokens go through a `TokenDispatcher` in three phases (`dispatch`, `run_experts`,
`combine`); the layer runs the shared expert's two halves between them, where expert parallelism
has its all-to-alls in flight (`torchmoe/distributed/expert_parallel.py`). On one rank the phases
run the same operations as one call would: the outputs and gradients are the same bit for bit.

Load balancing is DeepSeek-V3's auxiliary-loss-free expert bias: the bias only changes which
experts are *selected*, never the gate values, and is updated once per optimizer step from the
token counts accumulated in ``tokens_per_expert`` over all micro-batches (see `update_expert_bias`).

``moe_force_load_balance`` replaces the selection by a round-robin over each call's tokens
(`round_robin_experts`). Everything downstream sees that selection: the token counts (so the
bias update sees equal loads and leaves the bias as it is), the dispatch, and the sequence-wise
balance loss (its per-expert fractions are then uniform; its gradient still reaches the scores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchmoe.models.init import ParamInit, TruncNormal, prefixed
from torchmoe.models.llama4.args import ModelArgs
from torchmoe.models.llama4.moe_ops import accumulate_token_counts, grouped_mm
from torchmoe.regions import region

# On CUDA, grouped GEMM kernels want every expert's row block to start at a multiple of 16 rows
# (bf16 tensor-core tiles), and float8 grouped GEMMs need it on any device; else no padding.
_GROUP_ALIGN = 16


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``. Used for dense layers and the shared expert."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim)."""
        return self.project(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated hidden activation ``silu(w1 x) * w3 x``: (..., dim) -> (..., hidden_dim).
        The MoE layer runs it and `project` as separate steps (see `MoE.forward`)."""
        with region("ffn"):
            return F.silu(self.w1(x)) * self.w3(x)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """``w2 h``: (..., hidden_dim) -> (..., dim)."""
        with region("ffn"):
            return self.w2(h)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w1.weight": TruncNormal(0.02), "w2.weight": TruncNormal(init_std), "w3.weight": TruncNormal(init_std)}


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights.

    Weights follow ``nn.Linear`` (out, in) per expert: ``w1, w3: [E, hidden, dim]``,
    ``w2: [E, dim, hidden]``, so tensor parallel shards dim 1 of w1/w3 and dim 2 of w2, and expert
    parallel shards dim 0 of all three.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Set by `distributed.float8.convert_float8_experts`: (rows, w, offsets) -> rows @ w[e].T
        # per expert block, in float8.
        self.float8_grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous block of rows.

        Args:
            x: (rows, dim) tokens sorted expert-major; expert e owns the next
                ``num_tokens_per_expert[e]`` rows. Rows past the last block are ignored.
            num_tokens_per_expert: (num_local_experts,) integer row counts.
        Returns:
            (rows, dim); rows past the last block are unspecified.
        """
        with region("routed_experts"):
            w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
            if _autocast_on(x):
                # autocast has no rule for _grouped_mm (it would run in fp32, or fail on mixed
                # dtypes): cast the operands as autocast casts a matmul's.
                dtype = compute_dtype(x)
                x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            if self.use_grouped_mm:
                return _grouped_swiglu(x, w1, w2, w3, num_tokens_per_expert, self.float8_grouped_mm)
            return _looped_swiglu(x, w1, w2, w3, num_tokens_per_expert)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"w1": TruncNormal(0.02), "w2": TruncNormal(init_std), "w3": TruncNormal(init_std)}


def _autocast_on(x: torch.Tensor) -> bool:
    """autocast is enabled for x's device (devices without autocast, such as meta, never are)."""
    device = x.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` computes in: autocast's when it is on for x's device, else x's."""
    return torch.get_autocast_dtype(x.device.type) if _autocast_on(x) else x.dtype


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (TP/EP place experts so each rank's shard is
    self-contained), or the tensor itself."""
    return w.to_local() if isinstance(w, DTensor) else w


def _grouped_swiglu(x, w1, w2, w3, counts, float8_mm=None) -> torch.Tensor:
    """One grouped GEMM per projection; no host-device synchronisation. `float8_mm`, when set,
    runs them in float8; else bf16 runs torch's ``_grouped_mm`` (which the compiler lowers to its
    kernels) and other dtypes run it through the ``torchmoe::grouped_mm`` custom op, which the
    compiler can trace (see `moe_ops`)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,) end row of each expert
    native = x.dtype == torch.bfloat16

    def mm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if float8_mm is not None:
            return float8_mm(rows, w, offsets)
        return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offsets) if native else grouped_mm(rows, w, offsets)

    h = F.silu(mm(x, w1)) * mm(x, w3)  # (rows, hidden)
    return mm(h, w2)  # (rows, dim)


def _looped_swiglu(x, w1, w2, w3, counts) -> torch.Tensor:
    """Reference path: a Python loop over experts (``tolist`` syncs; fine for a reference)."""
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        h = F.silu(rows @ w1[e].T) * (rows @ w3[e].T)
        out[start : start + n] = h @ w2[e].T
        start += n
    return out


class TokenChoiceRouter(nn.Module):
    """Top-k token-choice router.

    Selection uses ``scores + expert_bias`` (bias from aux-loss-free balancing); gate values are
    the unbiased scores. With sigmoid scoring and a zero bias this is exactly Hugging Face's
    Llama 4 router (top-k on logits, sigmoid of the chosen logits), as sigmoid is monotonic.
    With `force_load_balance` the selection is `round_robin_experts` instead (torchtitan's
    debug routing, for performance work); the gate values are still the scores it selects.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, *,
                 force_load_balance: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.force_load_balance = force_load_balance

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: (T, dim) tokens.
            expert_bias: (E,) selection bias or None.
        Returns:
            top_scores (T, k) gate values, selected (T, k) expert ids, scores (T, E) all
            expert scores (fp32, for the auxiliary loss), logits (T, E) (fp32, for the z-loss).
        """
        # (T, E); scores and top-k in fp32 (the gate matmul itself runs in the compute dtype).
        logits = self.gate(x).float()
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = F.softmax(logits, dim=-1)
        if self.force_load_balance:
            selected = round_robin_experts(scores.shape[0], self.top_k, self.num_experts, scores.device)
        else:
            choice = scores if expert_bias is None else scores + expert_bias
            _, selected = torch.topk(choice, self.top_k, dim=-1)  # (T, k)
        top_scores = scores.gather(-1, selected)  # (T, k)
        return top_scores, selected, scores, logits

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        return {"gate.weight": TruncNormal(init_std)}


def round_robin_experts(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """(T, k) experts of torchtitan's forced balance: token t's j-th copy goes to expert
    ``(t * k + j) mod E``, so any T * k copies that are a multiple of E fill every expert equally."""
    slots = torch.arange(num_tokens * top_k, device=device, dtype=torch.int64)
    return (slots % num_experts).view(num_tokens, top_k)


class _AttachAuxLoss(torch.autograd.Function):
    """Pass ``x`` through unchanged; in backward, feed ``grad_scale`` as the auxiliary loss's
    gradient. This adds the loss to the objective without changing the model's outputs, so it
    works unchanged under gradient accumulation, activation checkpointing and pipeline stages."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return x

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.grad_scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, aux_grad, None


class MoE(nn.Module):
    """Router + routed experts + shared expert, with load-balancing state.

    Buffers (persistent, so checkpoints carry the router state):
        expert_bias: (E,) fp32 selection bias, updated by `update_expert_bias`.
        tokens_per_expert: (E,) fp32 tokens routed to each expert since the last bias update.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_before_experts = args.score_before_experts
        self.aux_loss_coeff = args.aux_loss_coeff
        self.z_loss_coeff = args.z_loss_coeff
        self.load_balance_coeff = args.load_balance_coeff
        self.router = TokenChoiceRouter(args.dim, args.num_experts, args.top_k, args.score_func,
                                        force_load_balance=args.moe_force_load_balance)
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_hidden_dim * args.num_shared_experts)
            if args.num_shared_experts > 0
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32))
        # The trainer sets this to 1 / micro-batches per step so auxiliary-loss gradients match the
        # main loss's normalisation; the last values are kept for metrics.
        self.aux_loss_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        # Groups whose ranks each route a slice of every sequence: tp under expert parallelism
        # spanning TP, cp under context parallelism.
        self.sequence_shard_groups: list[dist.ProcessGroup] = []
        # Token dispatch hooks: expert parallelism replaces these to move tokens between ranks.
        self.dispatcher: TokenDispatcher = TokenDispatcher(args.num_experts, args.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S, dim) -> (B, S, dim)."""
        bsz, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)  # (T, dim)
        # The bias is applied even when balancing is off (it is then zero, or a trained model's).
        top_scores, selected, scores, logits = self.router(tokens, self.expert_bias)
        flat_expert = selected.reshape(-1)  # (T*k,)
        # scatter_add rather than bincount: bincount sizes its output from the data (a host sync).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        with torch.no_grad():
            accumulate_token_counts(self.tokens_per_expert, counts.float())

        # The shared expert needs no routed token: its two halves run between the dispatcher's
        # phases, while under expert parallelism the routed rows travel to their experts' ranks
        # (after `dispatch`) and the experts' outputs travel back (after `run_experts`).
        shared = self.shared_experts
        routed = self.dispatcher.dispatch(tokens, top_scores, selected, counts, self.score_before_experts)
        hidden = shared.hidden(tokens) if shared is not None else None
        self.dispatcher.run_experts(routed, self.experts)
        out = shared.project(hidden) if shared is not None else torch.zeros_like(tokens)
        out = out + self.dispatcher.combine(routed)
        out = self._attach_aux_losses(out, scores, selected, logits, bsz, seq_len)
        return out.reshape(bsz, seq_len, dim)

    def _attach_aux_losses(self, out, scores, selected, logits, bsz, seq_len) -> torch.Tensor:
        """Sequence-wise balance loss (DeepSeek-V3) and router z-loss (ST-MoE), if enabled.

        balance = coeff * mean_b sum_e f_be * P_be, with f_be = E / (k * S) * tokens of sequence b
        routed to e and P_be = mean over the sequence of the normalised scores of e.
        z = coeff * mean_t logsumexp(logits_t)^2.
        """
        if not (self.aux_loss_coeff or self.z_loss_coeff) or not torch.is_grad_enabled():
            return out
        aux = out.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coeff:
            probs = (scores / scores.sum(-1, keepdim=True)).view(bsz, seq_len, -1)  # (B, S, E)
            prob_sums = probs.sum(1)  # (B, E)
            hits = torch.zeros(bsz, self.num_experts, device=out.device)
            hits.scatter_add_(1, selected.view(bsz, -1), torch.ones_like(selected.view(bsz, -1), dtype=hits.dtype))
            full_len = seq_len
            for group in self.sequence_shard_groups:
                # Each rank holds a slice of every sequence: sum the per-sequence statistics over
                # the slices so the loss is the full sequences' (the differentiable all-reduce
                # sums the identical per-rank gradients back; the trainer scales each by 1 /
                # the number of slices).
                prob_sums = dist_nn.all_reduce(prob_sums, group=group)
                dist.all_reduce(hits, group=group)
                full_len *= dist.get_world_size(group)
            f = hits * self.num_experts / (self.top_k * full_len)  # (B, E)
            aux = aux + self.aux_loss_coeff * (f * prob_sums / full_len).sum(-1).mean()
        if self.z_loss_coeff:
            aux = aux + self.z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.last_aux_loss = aux.detach()
        return _AttachAuxLoss.apply(out, aux, self.aux_loss_grad_scale)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Router and routed/shared experts; `init_std` is the block's depth-scaled std."""
        inits = {**prefixed("router", self.router.param_inits(init_std)),
                 **prefixed("experts", self.experts.param_inits(init_std))}
        if self.shared_experts is not None:
            inits.update(prefixed("shared_experts", self.shared_experts.param_inits(init_std)))
        return inits

    def reset_router_state(self, device: torch.device | str) -> None:
        """Zero expert bias and token counts (fp32) on `device`."""
        with torch.no_grad():
            self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32, device=device)


@dataclass
class Routed:
    """A micro-batch's routed copies between the phases of a `TokenDispatcher`.

    Attributes:
        token_of: (T*k,) source token of each copy; the copies are sorted expert-major.
        gates: (T*k, 1) fp32 gate value of each copy.
        gate_outputs: the gates scale the experts' outputs (``score_before_experts`` off); else
            they scaled the rows before the experts.
        num_tokens: T.
        rows: (T*k, dim) in the compute dtype: the copies after `dispatch`, their experts'
            outputs after `run_experts` (expert parallelism leaves the copies there: the
            outputs arrive through `exchange`).
        counts: (E,) int64 copies per expert.
        exchange: the dispatcher's state between phases (expert parallelism: the all-to-all
            under way), or None.
    """

    token_of: torch.Tensor
    gates: torch.Tensor
    gate_outputs: bool
    num_tokens: int
    rows: torch.Tensor
    counts: torch.Tensor
    exchange: object | None = None


class TokenDispatcher:
    """Single-rank dispatch in three phases: `dispatch` sorts the routed copies expert-major,
    `run_experts` runs the experts on them, `combine` sums each token's gated outputs.

    Expert parallelism subclasses this to exchange rows with the ranks owning the experts: it
    launches the exchange at the end of one phase and waits for it at the start of the next, so
    what the caller runs between phases overlaps the exchange. Everything here is index
    arithmetic on device: no host sync.
    """

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k

    def dispatch(self, tokens: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                 counts: torch.Tensor, score_before_experts: bool) -> Routed:
        """Sort each token's top-k copies expert-major and cast them to the compute dtype.

        Args:
            tokens: (T, dim); top_scores, selected: (T, k); counts: (E,) int64 routed copies per
                expert.
        """
        flat_expert = selected.reshape(-1)  # (T*k,) expert of each routed copy
        order = torch.argsort(flat_expert, stable=True)  # routed copies sorted expert-major
        token_of = order // self.top_k  # (T*k,) source token of each sorted row
        rows = tokens[token_of]  # (T*k, dim)
        gates = top_scores.reshape(-1)[order].unsqueeze(-1)  # (T*k, 1) fp32
        # The experts compute in `dtype`; under autocast the tokens are the fp32 residual stream,
        # so rows are cast before they travel (EP's all-to-all moves half the bytes in bf16).
        dtype = compute_dtype(tokens)
        rows = (rows.float() * gates).to(dtype) if score_before_experts else rows.to(dtype)
        return Routed(token_of, gates, not score_before_experts, tokens.shape[0], rows, counts)

    def run_experts(self, routed: Routed, experts: GroupedExperts) -> None:
        """Replace ``routed.rows`` by their experts' outputs."""
        routed.rows = self.run_local_experts(routed.rows, routed.counts, experts)

    def combine(self, routed: Routed) -> torch.Tensor:
        """Each token's gate-weighted sum of its top-k expert outputs: (T, dim)."""
        return self._weighted_sum(routed, routed.rows)

    @staticmethod
    def _weighted_sum(routed: Routed, out: torch.Tensor) -> torch.Tensor:
        """out: (T*k, dim) expert outputs in the copies' order -> (T, dim)."""
        if routed.gate_outputs:
            out = (out.float() * routed.gates).to(out.dtype)
        result = torch.zeros(routed.num_tokens, out.shape[1], dtype=out.dtype, device=out.device)
        return result.index_add_(0, routed.token_of, out)

    def run_local_experts(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """Run this rank's experts on rows sorted by local expert, padding expert blocks to the
        kernel's alignment on CUDA and for float8. rows: (R, dim), counts: (local experts,) -> (R, dim)."""
        align = _GROUP_ALIGN if rows.is_cuda or experts.float8_grouped_mm is not None else 1
        padded_rows, positions, padded_counts = pad_expert_blocks(rows, counts, align)
        out = experts(padded_rows, padded_counts)
        return out[positions] if positions is not None else out


def pad_expert_blocks(rows: torch.Tensor, counts: torch.Tensor, align: int):
    """Place each expert's block of rows at an offset that is a multiple of `align` (CUDA grouped
    GEMM kernels want 16-row-aligned groups).

    Args:
        rows: (R, dim) sorted by expert; counts: (E,) rows per expert.
    Returns:
        The padded rows (R + E * (align - 1), dim) — a static size, so no host sync — with zero
        rows in the gaps; the index (R,) of each original row in them (None when align is 1, the
        rows are then returned as they are); and the per-expert counts including padding.
    """
    if align == 1:
        return rows, None, counts
    padded = (counts + align - 1) // align * align  # (E,)
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                            output_size=rows.shape[0])
    rank_in_expert = torch.arange(rows.shape[0], device=rows.device) - start[sorted_expert]
    positions = padded_start[sorted_expert] + rank_in_expert  # (R,)
    buffer = rows.new_zeros(rows.shape[0] + counts.numel() * (align - 1), rows.shape[1])
    buffer[positions] = rows
    return buffer, positions, padded


def update_expert_bias(moe_layers: list[MoE], counts: list[torch.Tensor] | None = None) -> None:
    """Aux-loss-free load balancing: once per optimizer step, nudge each layer's selection bias
    towards under-loaded experts and reset the counts.

    ``bias += coeff * sign(mean(load) - load)``, centred to zero mean so the bias never drifts as
    a whole. ``counts`` (one (E,) tensor per layer) overrides the local buffers when the caller has
    reduced them over data/expert-parallel ranks, so every replica applies the same update.
    """
    with torch.no_grad():
        for i, moe in enumerate(moe_layers):
            load = counts[i] if counts is not None else moe.tokens_per_expert
            if moe.load_balance_coeff:
                delta = moe.load_balance_coeff * torch.sign(load.mean() - load)
                moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()
