"""DeepSeek-V3's multi-token prediction (MTP): D sequential modules after the main model, module k
predicting the token k + 1 positions ahead (`ModelArgs.mtp_layers`).

    python -m pytest -q tests/unit/test_mtp.py

Module k at position t (DeepSeek-V3 technical report, section 2.2) combines the previous depth's
hidden state with the embedding of the token k positions ahead, runs one transformer block (a MoE
block: the model's layer ``n_layers + k - 1``) and the shared output head:

    h'_t = eh_proj(cat(enorm(Emb(x_{t+k})), hnorm(h^{k-1}_t)))
    h^k  = Block_k(h')                      (causal over the same positions)
    P^k_t = OutHead(norm_k(h^k_t))          (a distribution over x_{t+k+1})

The embedding and output head are the main model's. ``h^0`` is the main model's final-normed
hidden state and ``h^k`` the block's output before ``norm_k``: what the inference engines that
serve the released MTP weights (vLLM, SGLang) feed the module. The embedding comes first in the
concatenation, as the released ``eh_proj`` is laid out.

The loss (`mtp_targets`): depth k's targets are the labels shifted left by k, the last k positions
of a row having none (``IGNORE``), nor a position whose next k labels are not all targets (chat
data: another conversation, or past the supervised span); its summed cross entropy over the global batch's token count is
the report's ``L^k`` (normalised by T, the row length), and the objective is ``L_main +
mtp_loss_coeff * mean_k L^k``. Context parallelism (a row's tokens split over ranks) and pipeline
parallelism (the modules need the first stage's embedding on the last stage) are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.arch.model_args import ModelArgs
from torchmoe.nn.init import ParamInit, TruncNormal, prefixed
from torchmoe.nn.rms_norm import RMSNorm

__all__ = ["IGNORE", "MTPModule", "mtp_inputs", "mtp_targets"]

# The cross entropy's ignore_index: positions without a target.
IGNORE = -100


class MTPModule(nn.Module):
    """Module k's own parameters but its block (the model's ``layers[n_layers + k - 1]``, so every
    per-block parallelism wraps it as any other): the two input norms, the projection of their
    concatenation (2 dim -> dim) and the output norm before the shared head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.init_std = args.init_std

    def combine(self, embedded: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The block's input h' (B, S, dim) from the embeddings (B, S, dim) of the tokens k
        positions ahead and the previous depth's hidden states (B, S, dim)."""
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))

    def param_inits(self) -> dict[str, ParamInit]:
        std = self.init_std
        return {**prefixed("enorm", self.enorm.param_inits()), **prefixed("hnorm", self.hnorm.param_inits()),
                "eh_proj.weight": TruncNormal(std, a=-3 * std, b=3 * std), **prefixed("norm", self.norm.param_inits())}


def mtp_inputs(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth `depth`'s input tokens (B, S): position t's is x_{t+depth}, the row's tokens (B, S)
    shifted left by depth; the last depth positions, whose outputs have no target (`mtp_targets`)
    and which no earlier position attends to, get token 0. From the tokens, not the labels: a
    masked label (chat data's -100) is no token."""
    return torch.cat([tokens[:, depth:], tokens.new_zeros(tokens.shape[0], depth)], dim=1)


def mtp_targets(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth `depth`'s targets (B, S): x_{t+depth+1} at t, the labels shifted left by depth, where
    the labels of positions t .. t+depth are all targets; else `IGNORE` (the last depth positions
    too). Labels (chat data) are targets only within one conversation's supervised span, so a
    position never predicts a token of another conversation, nor past a span's end; pretraining's
    labels are all targets, and its depth-k targets are the labels shifted."""
    shifted = torch.cat([labels[:, depth:], labels.new_full((labels.shape[0], depth), IGNORE)], dim=1)
    ignored = labels == IGNORE
    chain = ignored.clone()
    for k in range(1, depth):  # any ignored label among t .. t+depth-1 (t+depth is the target itself)
        chain[:, :-k] |= ignored[:, k:]
    return shifted.masked_fill(chain, IGNORE)
