"""Semi-synchronous training across replica groups (`fault_tolerance.semi_sync_method`): local
SGD, DiLoCo and streaming DiLoCo on `ReplicaGroups`.

    semi = SemiSync(groups, cfg, named_params=local_params, named_biases=expert_biases, layer_ids=range(8))
    report = semi.after_step(step, position)     # a sync's {"ft_synced": ..., "ft_fragment": ...}, or None
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import FaultTolerance
from torchmoe.distributed.fault_tolerance import ReplicaGroups

_BLOCK = re.compile(r"(?:^|\.)(?:layers|mtp)\.(\d+)\.")


def check_fragments(n_fragments: int, n_blocks: int) -> None:
    """`fault_tolerance.num_fragments` fits a model of `n_blocks` blocks (transformer blocks and
    multi-token prediction modules): a fragment is one or more blocks. The preflight asks it
    (the dry run too), and `fragments_of`.

    Raises:
        ConfigError: more fragments than blocks.
    """
    if n_fragments > n_blocks:
        raise ConfigError("fault_tolerance.num_fragments", n_fragments,
                          f"must be at most the model's {n_blocks} blocks: a fragment is one or more blocks",
                          f"use 1 .. {n_blocks}")


def fragments_of(names: Sequence[str], layer_ids: Sequence[int], n_fragments: int) -> list[list[int]]:
    """The indices of `names` (parameter names, in order) in each of `n_fragments` fragments: the
    blocks (`layer_ids`, the whole model's, in order) in contiguous runs of near-equal length,
    the embedding with the first run and everything after the blocks (final norm, head) with
    the last. A block's multi-token-prediction module goes with it.

    Raises:
        ConfigError: more fragments than blocks.
    """
    check_fragments(n_fragments, len(layer_ids))
    position = {layer: i for i, layer in enumerate(layer_ids)}
    out: list[list[int]] = [[] for _ in range(n_fragments)]
    for index, name in enumerate(names):
        block = _BLOCK.search(name)
        if block is not None:
            fragment = position[int(block.group(1))] * n_fragments // len(layer_ids)
        else:
            fragment = 0 if "tok_embeddings" in name else n_fragments - 1
        out[fragment].append(index)
    return out


class SemiSync:
    """Semi-synchronous training across replica groups (`semi_sync_method`): each group steps on its
    own, and every `sync_steps` steps the groups meet in a quorum and

    - ``local_sgd``: average their parameters (and the MoE expert biases, which route tokens: a
      model is both);
    - ``diloco``: average the pseudo-gradient ``Δ = anchor - θ`` (anchor: the parameters after the
      last sync) and apply it to the anchor with an outer SGD,
      ``m = μ m + Δ; θ = anchor - lr (Δ + μ m)`` with Nesterov (``- lr m`` without), as
      `torch.optim.SGD` with dampening 0 does; expert biases are averaged (an outer step of lr 1
      without momentum: they are no gradient's).

    Streaming DiLoCo (``num_fragments`` F > 1): the blocks are split into F fragments
    (`fragments_of`) and one fragment syncs every ``sync_steps / F`` steps, in turn, so each
    syncs every ``sync_steps`` and a sync moves 1/F of the model. With ``fragment_sync_delay`` τ
    its pseudo-gradient is taken and its average started τ steps before its sync, and the outer
    step applies it then (the inner steps between overlap the transfer); the parameters become
    ``(1 - α) θ_outer + α θ_local`` (``fragment_update_alpha`` α; 0 keeps the groups equal).
    A block's expert bias is its fragment's, under the same rule: taken τ steps before the
    sync, averaged, and mixed ``(1 - α) average + α b_local`` with the bias as it is at the
    sync; the other fragments' biases keep their own progress, as their parameters do.
    ``should_quantize`` sends the pseudo-gradients quantized (torchft's, on CUDA).

    A sync that does not commit (a peer failed, too few groups) changes nothing: the groups go on
    from their own parameters and try again at the next sync. Works on every rank's local shards,
    so any layout inside a group; the anchor and the outer momentum are state (`state_dict`).

    Args:
        groups: the replica groups (`ReplicaGroups`).
        cfg: the `[fault_tolerance]` section.
        named_params: gives this rank's parameter shards (DTensors' local tensors) with their
            names, always in one order (asked at each sync: FSDP swaps the tensors a module holds
            between steps).
        named_biases: this rank's MoE expert biases with their names (``layers.<i>.…``: each
            syncs with its block's fragment).
        layer_ids: the whole model's block indices, in order (where fragments split).
    """

    def __init__(self, groups: ReplicaGroups, cfg: FaultTolerance,
                 named_params: Callable[[], list[tuple[str, torch.Tensor]]],
                 named_biases: list[tuple[str, torch.Tensor]], layer_ids: Sequence[int]) -> None:
        self.groups, self.cfg, self.named_params = groups, cfg, named_params
        self.biases = [b for _, b in named_biases]
        self.diloco = cfg.semi_sync_method == "diloco"
        named = named_params()
        self.fragments = fragments_of([n for n, _ in named], layer_ids, cfg.num_fragments)
        self.bias_fragments = fragments_of([n for n, _ in named_biases], layer_ids, cfg.num_fragments)
        self.period = cfg.sync_steps // cfg.num_fragments  # steps between two fragments' syncs
        self.anchor = [p.detach().clone() for _, p in named] if self.diloco else []
        # Zeros: the first outer step's m = μ·0 + Δ = Δ is torch SGD's first buffer; and the state
        # has the same tensors before the first sync as after (what checkpoints load into).
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        # A fragment's started sync (`fragment_sync_delay`): (fragment, shared tensors, wait).
        self._pending: tuple[int, list[torch.Tensor], Callable[[], None]] | None = None

    def local_params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_params()]

    def anchor_here(self) -> None:
        """Start DiLoCo from the parameters as they are now (after loading initial weights)."""
        if not self.diloco:
            return
        with torch.no_grad():
            for anchor, param, m in zip(self.anchor, self.local_params(), self.momentum, strict=True):
                anchor.copy_(param)
                m.zero_()

    def fragment_at(self, step: int) -> int | None:
        """The fragment whose sync completes at `step`, if one does."""
        if step % self.period:
            return None
        return (step // self.period - 1) % len(self.fragments)

    def after_step(self, step: int, position: list[float]) -> dict[str, Any] | None:
        """After inner step `step`: start a fragment's sync that is due (`fragment_sync_delay`
        steps before it completes), and complete one that is due; `position` (this group's rows
        now, `replica_state.encode_position`) rides in a started sync and counts once it commits.
        Returns a completed sync's metrics (``ft_synced``, ``ft_fragment``), else None."""
        ahead = self.fragment_at(step + self.cfg.fragment_sync_delay)
        if ahead is not None:
            self._start(ahead, position)
        fragment = self.fragment_at(step)
        if fragment is None or self._pending is None:  # (a run resumed between a start and its sync)
            return None
        return {"ft_synced": self._finish(step), "ft_fragment": fragment}

    def _start(self, fragment: int, position: list[float]) -> None:
        """Meet the other groups (a group that is behind recovers here) in the small collective
        (`ReplicaGroups.reduce`: layouts compared and `position` carried before anything else
        crosses), then take this fragment's share (pseudo-gradient, or parameters for local SGD)
        and its expert biases, and start averaging them: nothing waits for that transfer until
        `_finish` (a collective started after it would wait for it, on gloo and on a stream)."""
        self.groups.begin_step()
        params = self.local_params()
        with torch.no_grad():
            device = params[0].device if params else torch.device("cpu")
            self.groups.reduce(torch.zeros((), device=device), None, lambda: [], position)
            if self.diloco:
                shared = [self.anchor[i] - params[i] for i in self.fragments[fragment]]
            else:
                shared = [params[i].clone() for i in self.fragments[fragment]]
            shared += [self.biases[i].clone() for i in self.bias_fragments[fragment]]
            wait = self.groups.start_average(shared, quantize=self.cfg.should_quantize)
        self._pending = (fragment, shared, wait)

    def _finish(self, step: int) -> bool:
        """Wait for the started sync, commit, and apply it; whether it committed."""
        fragment, shared, wait = self._pending
        self._pending = None
        wait()
        if not self.groups.commit(step):
            return False
        params = self.local_params()
        indices = self.fragments[fragment]
        values, averages = shared[:len(indices)], shared[len(indices):]
        with torch.no_grad():
            for i, average in zip(self.bias_fragments[fragment], averages, strict=True):
                _mix(self.biases[i], average, self.cfg.fragment_update_alpha if self.diloco else 0.0)
            if self.diloco:
                self._outer_step([params[i] for i in indices], [self.anchor[i] for i in indices],
                                 [self.momentum[i] for i in indices], values)
            else:
                for i, average in zip(indices, values):
                    params[i].copy_(average)
        return True

    def _outer_step(self, params: list[torch.Tensor], anchors: list[torch.Tensor], momenta: list[torch.Tensor],
                    deltas: list[torch.Tensor]) -> None:
        """θ = anchor - lr * (Δ + μ m) (Nesterov) with m = μ m + Δ; the anchor becomes θ, and the
        parameters ``(1 - α) anchor + α θ_local``."""
        mu, lr, alpha = self.cfg.outer_momentum, self.cfg.outer_lr, self.cfg.fragment_update_alpha
        for m, d in zip(momenta, deltas):
            m.mul_(mu).add_(d)
        for param, anchor, delta, m in zip(params, anchors, deltas, momenta):
            update = delta.add(m, alpha=mu) if self.cfg.outer_nesterov else m
            anchor.sub_(update, alpha=lr)
            _mix(param, anchor, alpha)

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer momentum (DiLoCo; empty for local SGD): this rank's shards."""
        return {"anchor": list(self.anchor), "momentum": list(self.momentum)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for mine, saved in zip([*self.anchor, *self.momentum], [*state["anchor"], *state["momentum"]], strict=True):
            mine.copy_(saved)


def _mix(local: torch.Tensor, synced: torch.Tensor, alpha: float) -> None:
    """``local = (1 - alpha) synced + alpha local``, in place; with alpha 0 exactly `synced`, so
    every group's copy is equal to the bit."""
    if alpha == 0:
        local.copy_(synced)
    else:
        local.lerp_(synced, 1.0 - alpha)
