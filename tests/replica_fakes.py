"""What the tests of `ReplicaGroups` without a lighthouse share: torchft's Manager as one rank of
replica group 0 sees it, with another group's contribution added in each collective (`peer`).

    manager = FakeManager(peer(LAYOUT, 1))       # group 1 runs LAYOUT, committed nothing here
    groups = replica_groups(manager)            # this rank's ReplicaGroups (replica group 0)
"""

from __future__ import annotations

import torch

from torchmoe.config.job_config import FaultTolerance
from torchmoe.distributed.fault_tolerance import ReplicaGroups
from torchmoe.distributed.replica_state import GroupLayout

LAYOUT = GroupLayout(model="llama4/tiny, float32", degrees={"pp": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1},
                     ranks=2, seq_len=64, local_batch_size=2, global_batch_size=8)
OTHER = GroupLayout(model="llama4/debugmodel, float32", degrees={"pp": 1, "dp_shard": 1, "cp": 1, "tp": 2, "ep": 1},
                    ranks=2, seq_len=64, local_batch_size=2, global_batch_size=8)


class Work:
    def wait(self) -> None:
        pass


class FakeManager:
    """torchft's Manager as one rank of group `mine` sees it, with `other` the same rank of
    another group: each collective adds what `other` contributes (a callable of the tensor this
    rank sends); AVG divides by the participants. `_quorum_id` is the quorum's id (torchft's
    lighthouse gives a new one when the groups in it change): a test changes it."""

    def __init__(self, other, *, participants: int = 2, commits: bool = True) -> None:
        self.other, self.participants, self.commits = other, participants, commits
        self.errors: list[Exception] = []
        self.quorums = 0
        self._quorum_id = 1

    def register_state_dict_fn(self, key, load, state) -> None:
        self.load, self.state = load, state

    def start_quorum(self) -> None:
        self.quorums += 1

    def wait_quorum(self) -> None:
        pass

    def allreduce(self, tensor: torch.Tensor, reduce_op=torch.distributed.ReduceOp.AVG) -> Work:
        if not self.errors:
            tensor += self.other(tensor)
            if reduce_op == torch.distributed.ReduceOp.AVG:
                tensor /= self.participants
        return Work()

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, err: Exception) -> None:
        self.errors.append(err)

    def num_participants(self) -> int:
        return self.participants

    def should_commit(self) -> bool:
        return self.commits and not self.errors


def replica_groups(manager: FakeManager, *, replica_id: int = 0, group_size: int = 2, width: int = 3,
                   layout: GroupLayout = LAYOUT, **keys) -> ReplicaGroups:
    """This rank's `ReplicaGroups` on `manager` (`keys`: more `[fault_tolerance]` keys)."""
    cfg = FaultTolerance(enable=True, group_size=group_size, replica_id=replica_id, **keys)
    return ReplicaGroups(manager, cfg, layout=layout,
                         known_models=["llama4/tiny, float32", "llama4/debugmodel, float32"], position_width=width,
                         state=lambda: {"w": 1}, load=lambda state, position: None, device=torch.device("cpu"),
                         quorum_timeout_s=300.0)


def peer(layout: GroupLayout, group: int, *, committed: int = 0, position=(5.0, 6.0, 7.0), loss: float = 3.0,
         counts=(1.0, 2.0), hook=(0.0, 0.0), groups: int = 2, gradients=torch.zeros_like):
    """What group `group` of `layout` sends in each of a step's collectives, by the tensor's dtype
    (of `groups` groups; counts as many of `counts` as this rank sends): the layouts (int64), the
    small collective (float64: loss, counts, then one row per group, ``[*header, hook calls, hook
    elements, *position]``), and else gradients, `gradients` of this rank's (zeros: the mean is
    half of this rank's; ``torch.clone``: the same as this rank's)."""
    header = [1, committed, *layout.codes()]

    def contribution(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in (torch.int64, torch.float64):
            return gradients(tensor)
        out = torch.zeros_like(tensor)
        if tensor.dtype == torch.int64:
            out[group] = torch.tensor(header)
            return out
        width = len(header) + 2 + len(position)
        n = tensor.numel() - groups * width
        out[:n] = torch.tensor([loss, *counts][:n], dtype=tensor.dtype)
        out[n:].view(groups, width)[group] = torch.tensor([*header, *hook, *position], dtype=tensor.dtype)
        return out
    return contribution
