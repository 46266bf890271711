"""Replica groups that survive each other's failures, on torchft (`[fault_tolerance]`).

    TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --nproc_per_node=2 --master-port 29600 -m torchmoe train \\
        --config configs/debug_model.toml --fault_tolerance.enable true --fault_tolerance.group_size 2 \\
        --fault_tolerance.replica_id 0

Each replica group is a torchrun launch of its own that holds the whole model in the layout the
config gives (FSDP, TP, EP, CP and PP stay inside it). What joins the groups is a torchft
`Manager` on every rank, owned here (`ReplicaGroups`); the trainer calls it at four points of a
step:

1. `begin_step`: join the step's quorum (the groups alive now). Synchronous by default: a group
   behind the quorum's step takes the live state from a healthy peer before its forward (its
   rank r from their rank r). With ``async_quorum`` the quorum forms in the background during
   the forward, and a recovering group takes the state at the commit, its batch left out.
2. The gradients: with FSDP in the group and the hooks chosen (`attach`; by default where the
   process group is NCCL), each FSDP unit's reduce-scatter output is averaged across groups
   inside FSDP's backward, through FSDP's all-reduce hook: on a GPU on FSDP's all-reduce stream,
   overlapped with the backward of the units before it. Only the step's last micro-batch
   crosses groups (`set_requires_all_reduce`, as HSDP's replicate all-reduce: the earlier ones
   are summed per unit and cross with it). Otherwise they are averaged after the backward in
   buckets (`reduce`): on gloo a collective blocks the host, and one bucket costs less than a
   blocking collective per unit.
3. `reduce`: one small collective with the loss (averaged), the MoE routers' token counts
   (summed, so every group updates its expert biases alike), every group's row position and
   layout (`GroupLayout`). Before any gradient crosses, the layouts are compared in a collective
   of their own once per quorum (a layout changes only with the groups in the quorum): the first
   collective across groups of the quorum's first step, FSDP's first hook's or `reduce`'s, so
   that groups of other layouts (one with FSDP's hooks, one without) make the same first one.
4. `commit`: whether every rank of every participant got through the step and at least
   ``min_replica_size`` groups took part: the optimizer may step. The positions of the groups in
   the step become their committed positions (`RowPositions`).

A failed peer turns the step's collectives into a failed commit instead of a hung job; the
step is tried again.

Recovery runs no code from the wire: torchft's HTTP transport unpickles what a peer sends
(``weights_only=False``); `_TensorsOnlyTransport` loads it with ``weights_only=True``, and the
state sent holds only plain tensors (DTensors as their local shards, `local_tensors`) and numbers.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchmoe import _torch_private as private
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import FaultTolerance
from torchmoe.distributed.lighthouse_watch import EXIT_AFTER_S, LighthouseWatch
from torchmoe.distributed.replica_state import GroupLayout, RowPositions
from torchmoe.distributed.torchft_logs import quiet_lost_peers

logger = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# Gradients averaged after the backward (groups without FSDP, semi-synchronous syncs) cross in
# flat buffers of at most this many bytes: one collective per bucket instead of one per
# parameter, without a second copy of every gradient at once.
BUCKET_BYTES = 256 * 2**20
# How often a group's manager server tries the lighthouse again when a quorum request failed
# (the lighthouse gone, or restarting): torchft spreads its retries evenly over the quorum's
# timeout, and without any a failed request hung the group until that timeout.
QUORUM_RETRY_S = 1.0


def import_torchft(log_level: str = "info"):
    """The torchft module, its Rust core logging at INFO for metrics.log_level "debug" and at
    WARN otherwise, unless RUST_LOG says otherwise, and a lost peer's error one line
    (`torchft_logs`); a `ConfigError` naming the extra when it is not installed."""
    # The core logs every quorum and commit at INFO (RUST_LOG unset): on 2 groups of 2 ranks that
    # was 96% of a run's console. Set before the core first logs, which reads it then; a user who
    # sets RUST_LOG (e.g. RUST_LOG=info to watch quorums) gets what they set.
    os.environ.setdefault("RUST_LOG", "info" if log_level == "debug" else "warn")
    try:
        import torchft
    except ImportError as err:
        raise ConfigError("fault_tolerance.enable", True, f"needs torchft, which is not installed ({err})",
                          "pip install 'torchmoe[ft]' (it pins the torchft release tested with this torch)") from None
    quiet_lost_peers()
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


def check_lighthouse(url: str, fix: str, timeout_s: float = 10.0) -> None:
    """`url` is a lighthouse address that answers: http(s)://HOST:PORT, where a TCP connection
    opens within `timeout_s` (torchft's own connect fails only after its timeout, with a Rust
    error's traceback).

    Raises:
        ConfigError: naming `LIGHTHOUSE_ENV`, `url` and the OS's reason.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as err:  # a port that is no number
        raise ConfigError(LIGHTHOUSE_ENV, url, f"is not an address: {err}", fix) from None
    if parts.scheme not in ("http", "https") or not host or port is None:
        raise ConfigError(LIGHTHOUSE_ENV, url, "is not an http://HOST:PORT address", fix)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(LIGHTHOUSE_ENV, url, f"cannot be reached: {err.strerror or err}", fix) from None


def connect(cfg: FaultTolerance, *, quorum_timeout_s: float, log_level: str = "info"):
    """This rank's torchft `Manager`, on the process group `cfg` names, reaching the lighthouse
    at `TORCHFT_LIGHTHOUSE` (a `ConfigError` when unset).

    Args:
        quorum_timeout_s: how long a step's quorum may take to form (groups that are down are
            waited for this long when fewer than min_replica_size are up). Within it a failed
            request to the lighthouse is tried again every `QUORUM_RETRY_S`: a lighthouse
            restarted at its address is reached within a second (the groups' watch,
            `watch_lighthouse`, stops them when it is away longer than lighthouse_timeout_ms).
    """
    torchft = import_torchft(log_level)
    start = (f"start one (torchmoe lighthouse --min-replicas {cfg.min_replica_size}) and export "
             f"{LIGHTHOUSE_ENV}=http://HOST:PORT as it prints, for every group's launch")
    url = os.environ.get(LIGHTHOUSE_ENV, "")
    if not url:
        raise ConfigError(LIGHTHOUSE_ENV, "", "is not set: fault_tolerance.enable needs a torchft lighthouse", start)
    check_lighthouse(url, start)
    timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
    pg = (torchft.ProcessGroupGloo(timeout=timeout) if cfg.process_group == "gloo"
          else torchft.ProcessGroupNCCL(timeout=timeout))
    return torchft.Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_replica_size,
        use_async_quorum=cfg.async_quorum, replica_id=f"torchmoe_{cfg.replica_id}", timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout,
        quorum_retries=max(0, math.ceil(quorum_timeout_s / QUORUM_RETRY_S) - 1),
        checkpoint_transport=_tensors_only_transport(timeout))


def watch_lighthouse(cfg: FaultTolerance, rank: int, world_size: int) -> LighthouseWatch | None:
    """On the group's rank 0 (whose manager server talks to the lighthouse), the watch that stops
    the group with one message once the lighthouse is gone for fault_tolerance.lighthouse_timeout_ms
    (`lighthouse_watch`); None on the other ranks (the failure protocol stops them with it).
    `world_size`: the group's ranks."""
    if rank != 0:
        return None
    return LighthouseWatch(os.environ[LIGHTHOUSE_ENV], env=LIGHTHOUSE_ENV, timeout_s=cfg.lighthouse_timeout_ms / 1000,
                           exit_after_s=EXIT_AFTER_S["with_peers" if world_size > 1 else "alone"])


class ReplicaGroups:
    """Everything that crosses replica groups, on this rank's torchft `Manager` (`connect`).

    Args:
        manager: the Manager (anything with its methods: the unit tests pass a fake).
        cfg: the `[fault_tolerance]` section (enabled).
        layout: this group's `GroupLayout`; `known_models`: model texts to name a peer's by.
        position_width: numbers in an encoded row position (`replica_state.encode_position`).
        state: what a recovering peer takes from this rank (plain tensors and numbers), built
            from references: torchft may call it on its own thread, during the forward.
        load: applies such a state from a healthy peer, with this group's row position in it
            (encoded; None when no step of it counted yet).
        device: where the small per-step tensors live (the device the gradients are on).
        quorum_timeout_s: what `connect` was given: a quorum not formed by then is a
            `ConfigError` naming min_replica_size (torchft's own `TimeoutError` before).
        watch: the lighthouse's watch (`watch_lighthouse`), around every wait on the groups.
    """

    def __init__(self, manager, cfg: FaultTolerance, *, layout: GroupLayout, known_models: Sequence[str],
                 position_width: int, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any], list[float] | None], None], device: torch.device,
                 quorum_timeout_s: float, watch: LighthouseWatch | None = None) -> None:
        self.manager, self.cfg, self.layout, self.device, self.watch = manager, cfg, layout, device, watch
        self.quorum_timeout_s = quorum_timeout_s
        self._shut_down = False
        self.known_models = list(known_models)
        self._user_state, self._user_load = state, load
        self.positions = RowPositions(cfg.group_size, position_width)
        # Per step: whether the layouts were compared, the gradient reductions FSDP's hooks ran
        # across groups (count and elements: every group's must line up), and the positions that
        # ride along.
        self._compared = False
        self._hook_calls = self._hook_numel = 0
        self._step_positions: dict[int, list[float]] = {}
        # The quorum (`_quorum_id`) in which a committed step had every group's layout compared:
        # they are compared again only in another quorum (or after a step that did not commit).
        self._layouts_agreed_in: int | None = None
        # Whether this backward's hooks cross groups (`set_requires_all_reduce`); the sum of each
        # FSDP unit's reduced gradients of the step's earlier micro-batches (the unit's index:
        # its sum); the hooks' buffers, held until their backward is over (`_hold`).
        self._crossing = True
        self._partial: dict[int, torch.Tensor] = {}
        self._held: list[tuple[torch.Tensor, torch.Event | None]] = []
        self.attached = False  # gradients are averaged inside FSDP's backward (`attach`)
        # This step's loss is normalised by the quorum's mean count of targets (`mean_targets`):
        # the average of the groups' gradients is then the whole quorum's mean as it stands.
        self._targets_crossed = False
        self.committed_here = 0  # steps this process committed: who joined later, on a layout clash
        self.contributors = 0  # groups whose gradients the last `reduce` averaged
        # Since `take_report`: seconds the training thread waited on work across groups (on the
        # host (CPU, gloo) every collective's; on a GPU the quorum, the small collective and the
        # commit: FSDP's hooks only queue theirs on its all-reduce stream), and the collectives
        # across groups this rank started with the bytes it sent into them.
        self._blocked_s = 0.0
        self._collectives = self._sent_bytes = 0
        manager.register_state_dict_fn("torchmoe", self._load, self._state)

    # ---- the step's four points ------------------------------------------------------------------

    def begin_step(self) -> None:
        """Join this step's quorum. Synchronous (the default): a group behind the quorum's step
        recovers here (`load`). Asynchronous: the quorum forms during the forward, and the
        first collective of the step waits for it."""
        self._compared = False
        self._hook_calls = self._hook_numel = 0
        self._step_positions = {}
        self._crossing, self._partial = True, {}
        self._targets_crossed = False
        self._release_held()
        began = time.perf_counter()
        with self._waiting(quorum=True):
            self.manager.start_quorum()
        self._blocked_s += time.perf_counter() - began

    def attach(self, model_parts: Sequence[nn.Module]) -> bool:
        """Average gradients across groups inside FSDP's backward: every FSDP unit's reduced
        gradient shard, as FSDP produces it (after each micro-batch's reduce-scatter), through
        FSDP's all-reduce hook (`_average_in_backward`). Returns whether it attached (every
        parameter of the parts is in an FSDP unit: the root unit of each part holds what the
        others do not)."""
        if not all(isinstance(part, FSDPModule) for part in model_parts):
            return False
        units = [unit for part in model_parts for unit in part.modules() if isinstance(unit, FSDPModule)]
        for index, unit in enumerate(units):
            unit.set_all_reduce_hook(functools.partial(self._average_in_backward, index))
        self.attached = True
        return True

    def set_requires_all_reduce(self, requires: bool) -> None:
        """Whether the next backward's gradients cross groups (FSDP's hooks; called before each
        micro-batch's forward, True for the step's last only): the trainer's counterpart of
        HSDP's ``set_requires_all_reduce``. It also lets go of the buffers the previous
        backward's hooks held (`_hold`)."""
        self._release_held()
        self._crossing = requires

    def _average_in_backward(self, unit: int, reduced: torch.Tensor) -> None:
        """FSDP's all-reduce hook of FSDP unit `unit`: `reduced` (the unit's reduce-scatter
        output, flat, in the reduce dtype) averaged in place across the quorum's groups; on a GPU
        this runs on FSDP's all-reduce stream.

        As HSDP's partial reduce output: an earlier micro-batch's is added to the unit's sum and
        zeroed (FSDP adds the zeros to the gradient), and the last one's crosses with the sum
        added, so the gradient is the average of the micro-batches' sum in the reduce dtype, cast
        once: HSDP's numbers, one crossing per unit and step."""
        if not self._crossing:
            if unit in self._partial:
                self._partial[unit] += reduced
            else:
                self._partial[unit] = reduced.clone()
            reduced.zero_()
            self._hold(reduced)
            return
        began = time.perf_counter()
        if unit in self._partial:
            reduced += self._partial.pop(unit)
        self._compare_layouts()
        self._hook_calls += 1
        self._hook_numel += reduced.numel()
        self._all_reduce(reduced)
        self._hold(reduced)
        self._blocked_s += time.perf_counter() - began

    def _hold(self, buffer: torch.Tensor) -> None:
        """Keep a hook's `buffer` alive until its backward is over, with an event after the
        hook's work on this (FSDP's all-reduce) stream. FSDP allocated it on its reduce-scatter
        stream and drops it after the hook (cast to the parameters' dtype, or added to their
        gradient, on the all-reduce stream); nothing else holds it on the hook's path, so the
        next unit's reduce-scatter could take the memory while this stream still reads it.
        Torch's own HSDP all-reduce holds its buffer the same way (docs/fault-tolerance.md)."""
        event = torch.accelerator.current_stream(buffer.device).record_event() if buffer.device.type != "cpu" else None
        self._held.append((buffer, event))

    def _release_held(self) -> None:
        """Drop the held buffers (`_hold`), the current stream waiting for their events first.
        Called after a backward, whose end made the current stream wait for FSDP's all-reduce
        stream: the memory is free for the next backward's reduce-scatters."""
        for buffer, event in self._held:
            if event is not None:
                torch.accelerator.current_stream(buffer.device).wait_event(event)
        self._held = []

    def mean_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The mean over the quorum's participants of the groups' counts of targets (`targets`:
        this group's, a 0-dim float64 tensor on the device, equal on its ranks), where a group
        recovering at this step's commit counts zero, as its gradients do (torchft sends its
        zeros): a masked loss (chat data) each group normalises by it has, averaged over the
        groups, the mean over all their targets (`reduce` then neither rescales the gradients
        nor divides the loss by the contributors). 1 where no group has a target (every token
        loss is zero). One collective before the forward: with an asynchronous quorum the
        forward waits for the quorum."""
        total = targets.detach().clone().view(1)
        self._all_reduce(total, reduce_op=torch.distributed.ReduceOp.SUM)
        self._targets_crossed = True
        mean = total[0] / max(self.participants, 1)
        return torch.where(mean > 0, mean, torch.ones_like(mean))

    def reduce(self, loss: torch.Tensor, counts: torch.Tensor | None, grads: Callable[[], list[torch.Tensor]],
               position: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the backward: one small collective, with the loss (averaged), the MoE token
        `counts` (summed), and per group its layout, its gradient reductions in the backward and
        `position` (its rows after the step's batch); then, unless FSDP's hooks averaged the
        gradients, their average (`grads` gives this rank's local gradients, in the model's
        order). Returns (loss, counts)."""
        began = time.perf_counter()
        self._compare_layouts()  # (when no hook crossed groups)
        self._release_held()
        if self._partial:
            raise RuntimeError(f"FSDP units {sorted(self._partial)} reduced gradients in an earlier micro-batch of "
                               "this step but none in its last: their sums never crossed replica groups")
        header = [1.0, float(self.committed_here), *map(float, self.layout.codes())]
        slot = [*header, float(self._hook_calls), float(self._hook_numel), *position]
        n_counts = counts.numel() if counts is not None else 0
        table = torch.zeros(self.cfg.group_size, len(slot), dtype=torch.float64, device=self.device)
        table[self.cfg.replica_id] = torch.tensor(slot, dtype=torch.float64)
        head = torch.cat([loss.detach().double().view(1),
                          *([counts.double().flatten()] if counts is not None else [])]).to(self.device)
        flat = torch.cat([head, table.flatten()])
        self._all_reduce(flat, reduce_op=torch.distributed.ReduceOp.SUM)
        # The step's one read of values across groups, after the backward: the checks below and
        # the mean's divisor are needed on the host before the commit.
        rows = flat[1 + n_counts:].view(self.cfg.group_size, len(slot)).cpu().tolist()
        # Compared in every step, at no cost: the collective of their own runs once per quorum.
        self._check_layouts([[int(x) for x in row[:len(header)]] for row in rows])
        if not self.manager.errored():  # else a peer failed: the values are garbage, and the commit fails
            present = {g: row[len(header):] for g, row in enumerate(rows) if row[0] == 1.0}
            for g, (calls, numel, *_) in present.items():
                if (calls, numel) != (self._hook_calls, self._hook_numel):
                    raise RuntimeError(f"replica group {g} reduced {int(calls)} gradient buffers of {int(numel):,} "
                                       f"elements in this step's backward, this group {self._hook_calls} of "
                                       f"{self._hook_numel:,}: the groups' collectives did not line up")
            self._step_positions = {g: row[2:] for g, row in present.items()}
        if not self.attached:
            self.average_(grads())
        # torchft averages over the quorum's participants; a group that recovers at this step's
        # commit (asynchronous quorum) sent zeros instead of its gradients. The mean is over the
        # groups whose gradients are in it: the ones whose row came back present.
        participants = max(self.participants, 1)
        contributors = max(len(self._step_positions), 1) if not self.manager.errored() else participants
        self.contributors = contributors
        if self._targets_crossed:  # the normaliser already left the non-contributors' targets out
            loss_avg = (flat[0] / participants).to(loss.dtype)
        else:
            if contributors != participants:
                for grad in grads():
                    grad.mul_(participants / contributors)
            loss_avg = (flat[0] / contributors).to(loss.dtype)
        summed = flat[1:1 + n_counts].view_as(counts).to(counts.dtype) if counts is not None else None
        self._blocked_s += time.perf_counter() - began
        return loss_avg, summed

    def commit(self, step: int) -> bool:
        """Whether every rank of every participant got through the step and enough groups took
        part: the optimizer may step. A collective within the group: every rank calls it. On a
        commit the step's groups' positions become their committed ones."""
        began = time.perf_counter()
        with self._waiting():
            committed = self.manager.should_commit()
        self._blocked_s += time.perf_counter() - began
        if committed:
            self.positions.commit(self._step_positions)
            self.committed_here += 1
        # A step that did not commit may have failed in the comparison: the next one compares.
        self._layouts_agreed_in = _quorum_id(self.manager) if committed else None
        self._step_positions = {}
        return committed

    # ---- what crosses groups besides the step --------------------------------------------------

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place over the groups in the quorum (`start_average`, waited for).
        After a peer failed mid-step the values are garbage and `commit` says so."""
        self.start_average(tensors)()

    def start_average(self, tensors: list[torch.Tensor], *, quantize: bool = False) -> Callable[[], None]:
        """Start averaging `tensors` over the groups in the quorum, one flat bucket per dtype and
        `BUCKET_BYTES` (`quantize`: torchft's quantized all-reduce, on CUDA); returns the wait,
        which copies the averages back into `tensors`."""
        began = time.perf_counter()
        pending = []
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            work = self._start(flat, **({"should_quantize": True} if quantize else {}))
            pending.append((bucket, flat, work))
        self._blocked_s += time.perf_counter() - began

        def wait() -> None:
            began = time.perf_counter()
            for bucket, flat, work in pending:
                with self._waiting():
                    work.wait()
                for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(piece.view_as(t))
            self._blocked_s += time.perf_counter() - began
        return wait

    def _compare_layouts(self) -> None:
        """The step's first collective across groups (at FSDP's first crossing hook, or at
        `reduce`) when no committed step compared the layouts in this quorum: every present
        group's `GroupLayout` and how many steps this process committed (`_check_layouts`),
        before any gradient crosses. A layout changes only with the groups in the quorum, whose
        every change gives it a new id (and reconfigures torchft's process group, a far larger
        cost); every group of a quorum decides alike (the commit is theirs together). Not at
        the quorum: a group whose peer failed to recover (another layout) would wait on a
        collective across groups instead of seeing its own ranks fail. (`reduce`'s collective
        carries the layouts in every step too.)"""
        if self._compared:
            return
        self._compared = True
        with self._waiting(quorum=True):
            self.manager.wait_quorum()
        if _quorum_id(self.manager) == self._layouts_agreed_in:
            return
        codes = self.layout.codes()
        table = torch.zeros(self.cfg.group_size, 2 + len(codes), dtype=torch.int64, device=self.device)
        table[self.cfg.replica_id] = torch.tensor([1, self.committed_here, *codes], dtype=torch.int64)
        self._all_reduce(table, reduce_op=torch.distributed.ReduceOp.SUM)
        self._check_layouts(table.cpu().tolist())

    def _check_layouts(self, rows: list[list[int]]) -> None:
        """`rows`: per group ``[present, steps committed here, *layout codes]``, summed over the
        quorum. A group with another layout cannot train with the others (their collectives
        would not line up, or would mix other rows): the one that joined later stops with a
        `ConfigError` naming both layouts, and the others fail this step (tried again without
        it). Two launches with the same replica_id stop alike."""
        if self.manager.errored():
            return  # a peer failed: the values are garbage, and the commit fails anyway
        codes, mine = self.layout.codes(), self.cfg.replica_id
        for group, (present, committed, *theirs) in enumerate(rows):
            if present == 0 or group == mine and present == 1:
                continue
            if present > 1:
                raise ConfigError("fault_tolerance.replica_id", group, f"{present} launches joined the job as "
                                  f"replica group {group}: their rows would be trained twice",
                                  "give every launch its own replica_id, 0 .. group_size - 1")
            if theirs == codes:
                continue
            other = GroupLayout.from_codes(theirs, self.known_models)
            if committed >= self.committed_here:
                raise ConfigError("fault_tolerance", f"replica group {mine}",
                                  f"runs {self.layout.describe()}, but replica group {group} runs {other.describe()}: "
                                  "every group must run the same model, layout and batch",
                                  "launch every group with one config; only fault_tolerance.replica_id differs")
            logger.error("replica group %d joined with %s, this group runs %s: it cannot train with the others; "
                         "this step is tried again without it", group, other.describe(), self.layout.describe())
            self.manager.report_error(RuntimeError(f"replica group {group} runs another layout"))

    # ---- the live state a recovering group takes ------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """torchft's state callback: the trainer's live state, this group's layout, and every
        group's committed row position (this rank's rows of it)."""
        return {"trainer": self._user_state(), "layout": self.layout.codes(),
                "positions": self.positions.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        """torchft's load callback: refuses a peer of another layout (`ConfigError`, naming
        both), else hands the trainer the state and this group's committed position."""
        if list(state["layout"]) != self.layout.codes():
            other = GroupLayout.from_codes(state["layout"], self.known_models)
            raise ConfigError("fault_tolerance", f"replica group {self.cfg.replica_id}",
                              f"runs {self.layout.describe()}, but the groups it joins run {other.describe()}: every "
                              "group must run the same model, layout and batch",
                              "launch this group with the others' config; only fault_tolerance.replica_id differs")
        self.positions.load_state_dict(state["positions"])
        self._user_load(state["trainer"], self.positions.get(self.cfg.replica_id))

    def _all_reduce(self, tensor: torch.Tensor, **kwargs) -> None:
        """`_start(tensor, **kwargs)`, waited for: the wait is the collective's."""
        work = self._start(tensor, **kwargs)
        with self._waiting():
            work.wait()

    def _start(self, tensor: torch.Tensor, **kwargs):
        """`manager.allreduce(tensor, **kwargs)`, counted (`take_report`); its start waits for an
        asynchronous quorum (`_waiting(quorum=True)`). Returns the collective's work."""
        self._collectives += 1
        self._sent_bytes += tensor.numel() * tensor.element_size()
        with self._waiting(quorum=True):
            return self.manager.allreduce(tensor, **kwargs)

    @contextmanager
    def _waiting(self, *, quorum: bool = False) -> Iterator[None]:
        """Around a wait on the other groups: the lighthouse's watch may end it (`watch`). With
        `quorum` (a wait that may be the step's quorum's: the start of a step, or with an
        asynchronous quorum its first collective), torchft's `TimeoutError` for a quorum that
        did not form is a `ConfigError` naming what to launch."""
        try:
            with self.watch.waiting() if self.watch is not None else nullcontext():
                yield
        except TimeoutError as err:
            if not quorum:
                raise
            raise ConfigError("fault_tolerance.min_replica_size", self.cfg.min_replica_size,
                              f"no quorum of that many replica groups formed within {self.quorum_timeout_s:g} s "
                              f"(comm.init_timeout_seconds): fewer were up, or the lighthouse did not answer ({err})",
                              "launch the missing groups (each resumes from its newest checkpoint, or takes a peer's "
                              "live state), or wait longer for them with a larger comm.init_timeout_seconds") from None

    def take_report(self) -> dict[str, float | int]:
        """Since the last call: ``ft_blocked_s``, the seconds the training thread waited on work
        across groups; ``ft_collectives``, the collectives across groups this rank started, and
        ``ft_bytes``, the bytes it sent into them (its tensors' sizes)."""
        report = {"ft_blocked_s": self._blocked_s, "ft_collectives": self._collectives, "ft_bytes": self._sent_bytes}
        self._blocked_s, self._collectives, self._sent_bytes = 0.0, 0, 0
        return report

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def state_dict(self) -> dict[str, int]:
        """The Manager's step and committed batches, for the group's own checkpoints (the
        positions, one table per rank, are saved apart: `positions`)."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop the watch and torchft's manager (its servers and threads). Idempotent."""
        if self.watch is not None:
            self.watch.close()
        if not self._shut_down:
            self._shut_down = True
            self.manager.shutdown(wait=False)


def _quorum_id(manager) -> int:
    """The id of `manager`'s current quorum: torchft's lighthouse gives a new one whenever the
    replica ids in the quorum change (a relaunched group joins with a new one). torchft's Manager
    keeps it in ``_quorum_id`` (set by its quorum thread) and has no public accessor; pinned by
    tests/unit/test_fault_tolerance_overlap.py."""
    return manager._quorum_id


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
