"""Replica groups that survive each other's failures, on torchft (`[fault_tolerance]`).

    TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --nproc_per_node=2 --master-port 29600 -m torchmoe train \\
        --config configs/debug_model.toml --fault_tolerance.enable true --fault_tolerance.group_size 2 \\
        --fault_tolerance.replica_id 0

Each replica group is a torchrun launch of its own that holds the whole model in the layout the
config gives (FSDP, TP, EP, CP and PP stay inside it). What joins the groups is a torchft
`Manager` on every rank: at the start of each step it asks the lighthouse for a quorum (the
groups alive now), a group that is behind the quorum's step takes the live state from a healthy
peer (its rank r from their rank r: the layouts are the same), and the step's collectives across
groups run on torchft's process group, which turns a failed peer into a failed step instead of a
hung job. A step is stepped by the optimizer only if `commit` says every group rank of every
participant got through it and at least ``min_replica_size`` groups took part.

What crosses groups, each through `Manager.allreduce` between the same rank of every group:
the gradients (averaged: every group normalises its loss by its own tokens, so the average is
the global batch's mean over the groups that took part), the loss (averaged, for the record),
and the MoE routers' token counts (summed, so every group updates its expert biases alike).

Recovery runs no code from the wire: torchft's HTTP transport unpickles what a peer sends
(``weights_only=False``); `_TensorsOnlyTransport` loads it with ``weights_only=True``, and the
state sent holds only plain tensors (DTensors as their local shards, `local_tensors`) and numbers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchmoe import _torch_private as private
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import FaultTolerance

logger = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Gradients cross groups in flat buffers of at most this many bytes: one collective per bucket
# instead of one per parameter, without a second copy of every gradient at once.
BUCKET_BYTES = 256 * 2**20
# Committed steps whose contributing groups a group remembers (and sends a recovering peer).
HISTORY = 1024


def import_torchft(log_level: str = "info"):
    """The torchft module, its Rust core logging at INFO for metrics.log_level "debug" and at
    WARN otherwise, unless RUST_LOG says otherwise; a `ConfigError` naming the extra when it is
    not installed."""
    # The core logs every quorum and commit at INFO (RUST_LOG unset): on 2 groups of 2 ranks that
    # was 96% of a run's console. Set before the core first logs, which reads it then; a user who
    # sets RUST_LOG (e.g. RUST_LOG=info to watch quorums) gets what they set.
    os.environ.setdefault("RUST_LOG", "info" if log_level == "debug" else "warn")
    try:
        import torchft
    except ImportError as err:
        raise ConfigError("fault_tolerance.enable", True, f"needs torchft, which is not installed ({err})",
                          "pip install 'torchmoe[ft]' (it pins the torchft release tested with this torch)") from None
    return torchft


def _tensors_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, loading what a peer sends with ``weights_only=True``."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _TensorsOnlyTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return private.streaming_load(f)

    return _TensorsOnlyTransport(timeout=timeout, num_chunks=0)


def local_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (a flat or nested dict) with every DTensor replaced by its local shard."""
    return {k: local_tensors(v) if isinstance(v, Mapping) else v.to_local() if isinstance(v, DTensor) else v
            for k, v in state.items()}


def like(template: Mapping[str, Any], received: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """`received` (from `local_tensors` on a peer with the same layout) in `template`'s form: each
    local shard wrapped as the DTensor `template` holds at its key.

    Raises:
        ValueError: the keys or shapes differ (the groups do not run the same layout).
    """
    if set(template) != set(received):
        missing, extra = sorted(set(template) - set(received)), sorted(set(received) - set(template))
        raise ValueError(f"the peer's state differs at {path or 'the top'}: missing {missing[:3]}, extra {extra[:3]} "
                         "(every replica group must run the same model and layout)")
    out = {}
    for key, mine in template.items():
        theirs, where = received[key], f"{path}{key}"
        if isinstance(mine, Mapping):
            out[key] = like(mine, theirs, f"{where}.")
        elif isinstance(mine, torch.Tensor):
            local = mine.to_local() if isinstance(mine, DTensor) else mine
            if not isinstance(theirs, torch.Tensor) or tuple(theirs.shape) != tuple(local.shape):
                shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
                raise ValueError(f"the peer's {where} is {shape}, this rank's {tuple(local.shape)} (every replica "
                                 "group must run the same layout)")
            theirs = theirs.to(local.device)
            out[key] = DTensor.from_local(theirs, mine.device_mesh, mine.placements, shape=mine.shape,
                                          stride=mine.stride(), run_check=False) if isinstance(mine, DTensor) else theirs
        else:
            out[key] = theirs
    return out


class ReplicaGroups:
    """This rank's torchft `Manager` and the collectives across replica groups.

    Args:
        cfg: the `[fault_tolerance]` section (enabled).
        quorum_timeout_s: how long a step's quorum may take to form (groups that are down are
            waited for this long when fewer than min_replica_size are up).
        state: what a recovering peer takes from this rank (`local_tensors` form).
        load: applies such a state from a healthy peer to this rank.
    """

    def __init__(self, cfg: FaultTolerance, *, quorum_timeout_s: float, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None]) -> None:
        torchft = import_torchft()
        if not os.environ.get(LIGHTHOUSE_ENV):
            raise ConfigError(LIGHTHOUSE_ENV, "", "is not set: fault_tolerance.enable needs a torchft lighthouse",
                              f"start one (torchmoe lighthouse --min-replicas {cfg.min_replica_size}) and export "
                              f"{LIGHTHOUSE_ENV}=http://HOST:PORT as it prints, for every group's launch")
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = (torchft.ProcessGroupGloo(timeout=timeout) if cfg.process_group == "gloo"
              else torchft.ProcessGroupNCCL(timeout=timeout))
        self.cfg = cfg
        # The groups whose tensors the last `average_` summed, and per committed step (the last
        # `HISTORY`) those of its average: whether a group's rows counted in a step it died in.
        self.contributors: list[int] = []
        self.history: dict[int, list[int]] = {}
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=load, state_dict=state, min_replica_size=cfg.min_replica_size,
            # The quorum (and any recovery) completes before the step's forward: a recovering
            # group computes on the live weights, and every step's participants are known.
            use_async_quorum=False, replica_id=f"torchmoe_{cfg.replica_id}", timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout,
            checkpoint_transport=_tensors_only_transport(timeout))

    def start_step(self) -> None:
        """Join this step's quorum; a group behind the quorum's step recovers here (`load`)."""
        self.manager.start_quorum()

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    @property
    def step(self) -> int:
        """Steps committed by the quorum so far (what a recovered group resumes after)."""
        return self.manager.current_step()

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place over the groups in the quorum (one flat bucket per dtype
        and `BUCKET_BYTES`), and learn which groups took part (`contributors`: a one-hot of this
        group's id rides along). After a peer failed mid-step the values are garbage and `commit`
        says so."""
        presence = torch.zeros(self.cfg.group_size, device=tensors[0].device if tensors else "cpu")
        presence[self.cfg.replica_id] = 1.0
        for bucket in _buckets([*tensors, presence]):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.manager.allreduce(flat).wait()
            for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(piece.view_as(t))
        self.contributors = [g for g, share in enumerate(presence.tolist()) if share > 0]

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the groups in the quorum."""
        self.manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()

    def commit(self, step: int) -> bool:
        """Whether every rank of every participant got through the step and enough groups took
        part: the optimizer may step. A collective within the group: every rank calls it. A
        committed `step` is remembered with its `contributors`."""
        committed = self.manager.should_commit()
        if committed:
            self.history[step] = self.contributors
            for old in sorted(self.history)[:-HISTORY]:
                del self.history[old]
        return committed

    def contributed(self, history: dict[int, list[int]], step: int) -> bool:
        """Whether this group's tensors are in committed `step` by `history` (a peer's)."""
        return self.cfg.replica_id in history.get(step, ())

    def state_dict(self) -> dict[str, int]:
        """The Manager's step and committed batches, for the group's own checkpoints."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype and device, consecutive, each group at most `BUCKET_BYTES`."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or (t.dtype, t.device) != (out[-1][0].dtype, out[-1][0].device) or size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


class SemiSync:
    """Semi-synchronous training across replica groups (`semi_sync_method`): each group steps on its
    own, and every `sync_steps` steps the groups meet in a quorum and

    - ``local_sgd``: average their parameters (and the MoE expert biases, which route tokens: a
      model is both);
    - ``diloco``: average the pseudo-gradient ``Δ = anchor - θ`` (anchor: the parameters after the
      last sync) and apply it to the anchor with an outer SGD,
      ``m = μ m + Δ; θ = anchor - lr (Δ + μ m)`` with Nesterov (``- lr m`` without), as
      `torch.optim.SGD` with dampening 0 does; expert biases are averaged as in local SGD.

    A sync that does not commit (a peer failed, too few groups) changes nothing: the groups go on
    from their own parameters and try again at the next sync. Works on every rank's local shards,
    so any layout inside a group; the anchor and the outer momentum are state (`state_dict`).

    Args:
        groups: the replica groups (`ReplicaGroups`).
        cfg: the `[fault_tolerance]` section.
        params: gives this rank's parameter shards (DTensors' local tensors), always in one order
            (asked at each sync: FSDP swaps the tensors a module holds between steps).
        buffers: this rank's MoE expert biases, averaged at each sync.
    """

    def __init__(self, groups: ReplicaGroups, cfg: FaultTolerance, params: Callable[[], list[torch.Tensor]],
                 buffers: list[torch.Tensor]) -> None:
        self.groups, self.cfg, self.local_params, self.buffers = groups, cfg, params, buffers
        self.diloco = cfg.semi_sync_method == "diloco"
        self.anchor = [p.detach().clone() for p in params()] if self.diloco else []
        # Zeros: the first outer step's m = μ·0 + Δ = Δ is torch SGD's first buffer; and the state
        # has the same tensors before the first sync as after (what checkpoints load into).
        self.momentum = [torch.zeros_like(a) for a in self.anchor]

    def anchor_here(self) -> None:
        """Start DiLoCo from the parameters as they are now (after loading initial weights)."""
        if not self.diloco:
            return
        with torch.no_grad():
            for anchor, param, m in zip(self.anchor, self.local_params(), self.momentum, strict=True):
                anchor.copy_(param)
                m.zero_()

    def due(self, step: int) -> bool:
        return step % self.cfg.sync_steps == 0

    def sync(self, step: int) -> bool:
        """Meet the other groups at `step` (a group that is behind recovers here) and
        synchronise; whether the sync committed."""
        self.groups.start_step()
        params = self.local_params()
        with torch.no_grad():
            if self.diloco:
                # The pseudo-gradient of this group, averaged over the groups in the quorum.
                shared = [a - p for a, p in zip(self.anchor, params, strict=True)]
            else:
                shared = [p.clone() for p in params]
            shared += [b.clone() for b in self.buffers]
            self.groups.average_(shared)
            if not self.groups.commit(step):
                return False
            values, biases = shared[:len(params)], shared[len(params):]
            for buffer, average in zip(self.buffers, biases):
                buffer.copy_(average)
            if self.diloco:
                self._outer_step(params, values)
            else:
                for param, average in zip(params, values):
                    param.copy_(average)
        return True

    def _outer_step(self, params: list[torch.Tensor], deltas: list[torch.Tensor]) -> None:
        """θ = anchor - lr * (Δ + μ m) (Nesterov) with m = μ m + Δ; the anchor becomes θ."""
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for m, d in zip(self.momentum, deltas):
            m.mul_(mu).add_(d)
        for param, anchor, delta, m in zip(params, self.anchor, deltas, self.momentum):
            update = delta.add(m, alpha=mu) if self.cfg.outer_nesterov else m
            anchor.sub_(update, alpha=lr)
            param.copy_(anchor)

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer momentum (DiLoCo; empty for local SGD): this rank's shards."""
        return {"anchor": list(self.anchor), "momentum": list(self.momentum)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for mine, saved in zip([*self.anchor, *self.momentum], [*state["anchor"], *state["momentum"]], strict=True):
            mine.copy_(saved)
