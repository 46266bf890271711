"""Muon: orthogonalised momentum for the hidden matrices, torch's AdamW for every other parameter,
in one optimizer (one state dict, one LR schedule, one checkpoint).

    optimizer = Muon([{"params": matrices, "algorithm": "muon"},
                      {"params": others, "algorithm": "adamw", "weight_decay": 0.0}],
                     lr=0.02, adamw={"lr": 8e-4, "betas": (0.9, 0.95)})

A Muon parameter is a matrix ``(out, in)`` (an ``nn.Linear`` weight: attention and MLA
projections, dense and shared-expert MLPs, optionally the router), or a stack of routed experts'
matrices ``(experts, out, in)``, each orthogonalised on its own (never the stack as one matrix),
all local experts in one batched Newton-Schulz. Each step, per parameter, as ``torch.optim.Muon``:

    buf = lerp(buf, grad, 1 - momentum)                     (state["momentum_buffer"])
    update = lerp(grad, buf, momentum) if nesterov else buf
    O = NS(update)                                          (per matrix; in ns_dtype)
    p *= 1 - lr * weight_decay                              (the unadjusted lr, as torch does)
    p -= adjust_lr(lr, (out, in)) * O

On one process every matrix's update equals ``torch.optim.Muon``'s with the same settings, bit
for bit, and every expert's equals ``torch.optim.Muon`` run on that expert's matrix alone
(``tests/unit/test_muon.py``). One difference, on purpose: torch normalises the momentum buffer
in place when the parameters are bf16 and nesterov is off (its NS casts with ``.bfloat16()``, a
no-op that aliases the buffer, then divides in place); here the NS never writes into its input.

Parameters may be DTensors of any layout; `muon_distributed.orthogonalize` gathers what a matrix
needs (its docstring and docs/muon.md give the scheme and its communication).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchmoe.nn.dtypes import torch_dtype
from torchmoe.optim.muon_distributed import orthogonalize

__all__ = ["ADJUST_LR_FNS", "Muon", "NS_COEFFICIENTS", "adjust_lr", "newton_schulz"]

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalise `update` by `steps` quintic Newton-Schulz iterations, as torch.optim.Muon does
    (cast to `dtype`, on the wide orientation, normalised by the Frobenius norm clamped at `eps`).

    Args:
        update: one matrix (rows, cols), or a stack (experts, rows, cols) orthogonalised per matrix.
    Returns:
        A new tensor of `update`'s shape in `dtype` (`update` itself is never written to).
    """
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        mm, addmm, norm = torch.mm, torch.addmm, x.norm()
    else:
        # One norm per matrix, and one batched GEMM over the stack: each matrix's slice computes
        # exactly what the 2-D path computes for it alone.
        mm, addmm, norm = torch.bmm, torch.baddbmm, x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = mm(x, x.mT)
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def adjust_lr(lr: float, fn: str | None, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's shape-based LR of one (out, in) matrix: 'original' (or None) scales by
    sqrt(max(1, out / in)), 'match_rms_adamw' by 0.2 * sqrt(max(out, in))."""
    rows, cols = shape
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn {fn!r} is not one of {ADJUST_LR_FNS}")


class Muon(torch.optim.Optimizer):
    """Muon over the groups whose ``"algorithm"`` is ``"muon"``, ``torch.optim.AdamW`` over those
    whose ``"algorithm"`` is ``"adamw"`` (module docstring).

    A Muon group holds torch.optim.Muon's keys (lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn) plus ns_dtype (a dtype name); its state is
    torch's: ``momentum_buffer`` per parameter. The AdamW groups are run by a torch AdamW that
    shares this optimizer's group dicts and state (``exp_avg``, ``exp_avg_sq``, ``step``), so a
    checkpoint reads like the two torch optimizers' together.

    Args:
        params: group dicts, each with "params" and "algorithm"; other keys override the defaults.
        lr ... adjust_lr_fn: torch.optim.Muon's arguments and defaults, for the Muon groups.
        ns_dtype: dtype name the Newton-Schulz iterations run in ('bfloat16', torch's; 'float32'
            makes the step insensitive to ~1e-7 differences of the gradients between layouts).
        adamw: torch.optim.AdamW's keyword arguments for the AdamW groups.
    """

    def __init__(self, params: Iterable[dict[str, Any]], *, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS,
                 ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None, ns_dtype: str = "bfloat16",
                 adamw: dict[str, Any] | None = None) -> None:
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not one of {ADJUST_LR_FNS}")
        muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                             adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        groups = [dict(g) for g in params]
        for g in groups:
            if g.get("algorithm") not in ("muon", "adamw"):
                raise ValueError(f"a Muon param group's algorithm is {g.get('algorithm')!r}, not 'muon' or 'adamw'")
            if g["algorithm"] == "muon":
                for k, v in muon_defaults.items():
                    g.setdefault(k, v)
        adamw_groups = [g for g in groups if g["algorithm"] == "adamw"]
        # torch's AdamW fills its defaults into these very dicts, which this optimizer then holds.
        self._adamw = torch.optim.AdamW(adamw_groups, **(adamw or {})) if adamw_groups else None
        super().__init__(groups, {})
        for g in self.param_groups:
            if g["algorithm"] == "muon":
                for p in g["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon takes matrices (2-D) and stacks of experts' matrices (3-D), "
                                         f"not a parameter of shape {tuple(p.shape)}")
        self._link_adamw()

    def _link_adamw(self) -> None:
        """Point the AdamW at this optimizer's AdamW groups and state (again after a load, which
        replaces both)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link_adamw()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        dtype = torch_dtype(group["ns_dtype"])
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = orthogonalize(update, lambda u: newton_schulz(
                u, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype), dtype)
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-adjust_lr(lr, group["adjust_lr_fn"], tuple(p.shape[-2:])))
