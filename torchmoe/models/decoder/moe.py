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

Padding is not data: with a mask of the tokens that are (`MoE.forward`'s ``real``, chat data's
windows end in padding), padding takes no part in the token counts (the bias update, the load
metrics), the balance loss or the z-loss, and expert parallelism does not send it to any expert
(its routed output is then zero: no loss reads it, and no data token attends to it, as it ends
its row). A conversation's tokens are data whether or not they are targets: the router routes
them at inference too. Without a mask (pretraining's rows, which hold no padding) every formula
is the one it always was, bit for bit.

``moe_force_load_balance`` replaces the selection by a round-robin over each call's tokens
(`round_robin_experts`). Everything downstream sees that selection: the token counts (so the
bias update sees equal loads and leaves the bias as it is; with padding, which the round-robin
places too, the data's loads are only nearly equal), the dispatch, and the
sequence-wise balance loss (its per-expert fractions are then uniform; its gradient still
reaches the scores).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchmoe.arch.model_args import ModelArgs
from torchmoe.distributed.tensor_parallel import sum_gradient
from torchmoe.nn.dispatch import TokenDispatcher, copies_per_expert
from torchmoe.nn.experts import ClampedSwiGLUExperts, FeedForward, GroupedExperts
from torchmoe.nn.init import Constant, ParamInit, TruncNormal, prefixed
from torchmoe.nn.moe_ops import accumulate_token_counts


class TokenChoiceRouter(nn.Module):
    """Top-k token-choice router.

    Selection uses ``scores + expert_bias`` (bias from aux-loss-free balancing); gate values are
    the unbiased scores. With sigmoid scoring and a zero bias this is exactly Hugging Face's
    Llama 4 router (top-k on logits, sigmoid of the chosen logits), as sigmoid is monotonic.
    With `force_load_balance` the selection is `round_robin_experts` instead (torchtitan's
    debug routing, for performance work); the gate values are still the scores it selects.

    Group-limited routing (DeepSeek-V3, ``n_group`` > 1): the experts form ``n_group`` equal
    groups, each scored by the sum of its two best biased scores, and a token's top-k are chosen
    among the experts of its ``topk_group`` best groups. The gates are then multiplied by
    ``scaling_factor`` (DeepSeek's ``routed_scaling_factor``), after `norm_topk_prob`.

    ``bias``: the gate has a bias (gpt-oss, whose softmax over the top-k logits is softmax scores
    renormalised over the top k). ``fp32_gate``: the gate matmul runs in fp32 whatever the
    compute dtype (DeepSeek-V3's, `Fp32Linear`); else in the compute dtype, and the scores in fp32.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, *,
                 norm_topk_prob: bool = False, force_load_balance: bool = False, n_group: int = 1,
                 topk_group: int = 1, scaling_factor: float = 1.0, bias: bool = False,
                 fp32_gate: bool = False) -> None:
        super().__init__()
        self.gate = (Fp32Linear if fp32_gate else nn.Linear)(dim, num_experts, bias=bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.force_load_balance = force_load_balance
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling_factor = scaling_factor

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
        # (T, E); scores and top-k in fp32 (the gate matmul in the compute dtype unless `fp32_gate`).
        logits = self.gate(x).float()
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = F.softmax(logits, dim=-1)
        if self.force_load_balance:
            selected = round_robin_experts(scores.shape[0], self.top_k, self.num_experts, scores.device)
        else:
            # The choice is indices only: detached, autograd keeps nothing of the selection.
            choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
            if self.n_group > 1:
                choice = self._within_best_groups(choice)
            _, selected = torch.topk(choice, self.top_k, dim=-1)  # (T, k)
        top_scores = scores.gather(-1, selected)  # (T, k)
        if self.norm_topk_prob:  # the gates of a token sum to 1 (Qwen3's and DeepSeek's option)
            top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        if self.scaling_factor != 1.0:
            top_scores = top_scores * self.scaling_factor
        return top_scores, selected, scores, logits

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (T, E) with the experts outside each token's `topk_group` best groups set to
        -inf; a group's score is the sum of its two best choices (DeepSeek-V3)."""
        grouped = choice.view(choice.shape[0], self.n_group, -1)  # (T, G, E / G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        best = group_scores.topk(self.topk_group, dim=-1).indices  # (T, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        inits: dict[str, ParamInit] = {"gate.weight": TruncNormal(init_std)}
        if self.gate.bias is not None:
            inits["gate.bias"] = Constant(0.0)
        return inits


class Fp32Linear(nn.Linear):
    """An ``nn.Linear`` (parameters of the same names and shapes, so every layout, checkpoint and
    TP style treats it as one) that computes in fp32 whatever the dtypes of its input and
    parameters (`_UpcastLinear`). Under bf16 the logits then keep fp32's precision, as transformers'
    DeepSeek-V3 router computes them: logits rounded to bf16 select another expert set for about
    3% of tokens (256 experts, hidden 1024)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) in any dtype -> (..., out) fp32."""
        return _UpcastLinear.apply(x, self.weight, self.bias)


class _UpcastLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` on fp32 upcasts (autocast off), the gradients cast back to their
    operands' dtypes. Saves the operands themselves, not their fp32 copies: the MoE input is saved
    anyway (by the shared expert), the weight is a parameter, so routing in fp32 keeps no more
    bytes for the backward than routing in the compute dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])  # (T, out)
        with torch.autocast(x.device.type, enabled=False):
            grad_x = (grad @ weight.float()).to(x.dtype)
            grad_w = (rows.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        grad_b = rows.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return grad_x, grad_w, grad_b


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

    Buffers:
        expert_bias: (E,) fp32 selection bias, updated by `update_expert_bias` (persistent:
            checkpoints and a recovering replica group's live state carry the router state).
        tokens_per_expert: (E,) fp32 tokens routed to each expert since the last bias update
            (not persistent: zero between steps, and written by every forward).
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
                                        norm_topk_prob=args.norm_topk_prob,
                                        force_load_balance=args.moe_force_load_balance, n_group=args.n_group,
                                        topk_group=args.topk_group, scaling_factor=args.routed_scaling_factor,
                                        bias=args.router_bias, fp32_gate=args.router_gate_fp32)
        if args.experts_style == "clamped_swiglu":
            self.experts = ClampedSwiGLUExperts(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm,
                                                limit=args.swiglu_limit, alpha=args.swiglu_alpha)
        else:
            self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_hidden_dim * args.num_shared_experts)
            if args.num_shared_experts > 0
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        # Out of the state dict: torchft serves a healthy group's live state to a recovering peer
        # while that group already runs the retried step's forward, which adds to this buffer in
        # place, so a peer could take (and sum again) a step's counts (seen under load in CI).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)
        # The trainer sets this to 1 / micro-batches per step so auxiliary-loss gradients match the
        # main loss's normalisation; the last values are kept for metrics.
        self.aux_loss_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        # With padding: the data tokens each micro-batch's shard holds on average this step, a 0-dim
        # device tensor the trainer sets (`training.moe_balance`); the z-loss's sum over a shard's
        # data tokens divided by it and scaled by `aux_loss_grad_scale` is then its mean over the
        # step's data tokens, in every layout. None: each call's own data tokens.
        self.z_loss_tokens: torch.Tensor | None = None
        # Groups whose ranks each route a slice of every sequence: tp under expert parallelism
        # spanning TP, cp under context parallelism.
        self.sequence_shard_groups: list[dist.ProcessGroup] = []
        # Token dispatch hooks: expert parallelism replaces these to move tokens between ranks.
        self.dispatcher: TokenDispatcher = TokenDispatcher(args.num_experts, args.top_k)
        # Set by MoE tensor parallelism when the gates scale the experts' outputs, which are
        # partial sums over each rank's hidden units: the gates' gradients are summed over it.
        self.gate_gradient_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, S, dim) -> (B, S, dim).

        real: (B, S) bool, True where the token is data and False where it is padding (module
        docstring), placed as `x` is: this rank's columns under CP, its sequence shard where EP
        spans TP (the TP plan's input style cuts it), whole under MoE TP (whose input is
        gathered); a host value made with the batch, so nothing here reads the device. None:
        every token is data."""
        bsz, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)  # (T, dim)
        data = real.reshape(-1) if real is not None else None  # (T,)
        # The bias is applied even when balancing is off (it is then zero, or a trained model's).
        top_scores, selected, scores, logits = self.router(tokens, self.expert_bias)
        if self.gate_gradient_mesh is not None:
            top_scores = sum_gradient(top_scores, self.gate_gradient_mesh)
        counts = copies_per_expert(selected, self.num_experts)  # (E,) every token's copies: the experts' rows
        load = counts if data is None else copies_per_expert(selected, self.num_experts, data)  # the data's
        with torch.no_grad():
            accumulate_token_counts(self.tokens_per_expert, load.float())

        # The shared expert needs no routed token: its two halves run between the dispatcher's
        # phases, while under expert parallelism the routed rows travel to their experts' ranks
        # (after `dispatch`) and the experts' outputs travel back (after `run_experts`).
        shared = self.shared_experts
        routed = self.dispatcher.dispatch(tokens, top_scores, selected, counts, self.score_before_experts, data)
        hidden = shared.hidden(tokens) if shared is not None else None
        self.dispatcher.run_experts(routed, self.experts)
        out = shared.project(hidden) if shared is not None else torch.zeros_like(tokens)
        out = out + self.dispatcher.combine(routed)
        out = self._attach_aux_losses(out, scores, selected, logits, bsz, seq_len, real)
        return out.reshape(bsz, seq_len, dim)

    def _attach_aux_losses(self, out: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor,
                           logits: torch.Tensor, bsz: int, seq_len: int, real: torch.Tensor | None) -> torch.Tensor:
        """Sequence-wise balance loss (DeepSeek-V3) and router z-loss (ST-MoE), if enabled, over
        the data tokens (`real`, (B, S) bool; None: all).

        balance = coeff * mean_b sum_e f_be * P_be, with f_be = E / (k * S_b) * tokens of sequence b
        routed to e and P_be = the sum over the sequence of the normalised scores of e / S_b, S_b
        being its data tokens (a sequence without any adds 0).
        z = coeff * mean_t logsumexp(logits_t)^2, t over the data tokens (with padding: of the
        step, `z_loss_tokens`).
        """
        if not (self.aux_loss_coeff or self.z_loss_coeff) or not torch.is_grad_enabled():
            return out
        aux = out.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coeff:
            aux = aux + self.aux_loss_coeff * self._balance_loss(scores, selected, bsz, seq_len, real)
        if self.z_loss_coeff:
            squares = torch.logsumexp(logits, dim=-1).pow(2)  # (T,)
            if real is None:
                aux = aux + self.z_loss_coeff * squares.mean()
            else:
                tokens = self.z_loss_tokens if self.z_loss_tokens is not None else real.sum().clamp(min=1)
                aux = aux + self.z_loss_coeff * torch.where(real.reshape(-1), squares, 0).sum() / tokens
        self.last_aux_loss = aux.detach()
        return _AttachAuxLoss.apply(out, aux, self.aux_loss_grad_scale)

    def _balance_loss(self, scores: torch.Tensor, selected: torch.Tensor, bsz: int, seq_len: int,
                      real: torch.Tensor | None) -> torch.Tensor:
        """The sequence-wise balance loss without its coefficient (`_attach_aux_losses`).

        scores: (B * S, E) fp32, selected: (B * S, k), real: (B, S) bool or None."""
        probs = (scores / scores.sum(-1, keepdim=True)).view(bsz, seq_len, -1)  # (B, S, E)
        copies = selected.view(bsz, -1)  # (B, S * k)
        if real is None:
            weights = torch.ones_like(copies, dtype=torch.float32)
        else:
            probs = probs * real.unsqueeze(-1)
            weights = real.repeat_interleave(self.top_k, dim=1).float()  # each copy's token is data
        prob_sums = probs.sum(1)  # (B, E)
        hits = torch.zeros(bsz, self.num_experts, device=scores.device)
        hits.scatter_add_(1, copies, weights)
        if real is not None:  # each sequence's data tokens, summed over its slices with the hits
            hits = torch.cat([hits, real.sum(1, keepdim=True, dtype=hits.dtype)], dim=1)  # (B, E + 1)
        full_len = seq_len
        for group in self.sequence_shard_groups:
            # Each rank holds a slice of every sequence: sum the per-sequence statistics over
            # the slices so the loss is the full sequences' (the differentiable all-reduce
            # sums the identical per-rank gradients back; the trainer scales each by 1 /
            # the number of slices).
            prob_sums = dist_nn.all_reduce(prob_sums, group=group)
            dist.all_reduce(hits, group=group)
            full_len *= dist.get_world_size(group)
        if real is None:
            f = hits * self.num_experts / (self.top_k * full_len)  # (B, E)
            return (f * prob_sums / full_len).sum(-1).mean()
        hits, lengths = hits[:, :-1], hits[:, -1:].clamp(min=1)  # (B, E), (B, 1): a sequence without data adds 0
        f = hits * self.num_experts / (self.top_k * lengths)
        return (f * prob_sums / lengths).sum(-1).mean()

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
