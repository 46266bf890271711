"""Where a replica group's rows stand after its last committed step, saved every step.

    position = DataPosition(dump_folder, rank=0)
    position.save_pending(loader, step=13)        # the step's batch is drawn: before its average
    position.save(loader, committed_step=13)       # the quorum committed the step
    position.restore(loader, contributed)         # on live recovery from a peer

Under fault tolerance (`distributed.fault_tolerance`) a group that died and comes back takes the
model, optimizer and step from a healthy peer, but its rows are its own: no peer holds them. So
every rank writes its loader's position (`DataLoader.state_dict`: per row, which document and
token comes next) after each step its group committed, and a recovering group starts from there:
none of its rows is trained twice, and none is left out (the rows of the steps it missed come
later than planned). A full restart of every group resumes from the checkpoints instead, whose
positions belong with their weights.

The step a group dies in may have counted: its gradients were in the average a peer committed,
though the group never wrote its own commit. So the position after the step's batch is written
as *pending* before the average, and recovery takes it when the peer's record of that step names
this group among its contributors (`ReplicaGroups.history`), else the committed one.

JSON, written atomically (`file_writes.write_file`); loading it runs nothing (no pickle).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.file_writes import write_file
from torchmoe.data.dataloader import DataLoader

FOLDER = "data_position"


class DataPosition:
    """One rank's position file: ``<dump_folder>/data_position/rank<r>.json``."""

    def __init__(self, dump_folder: str | Path, *, rank: int) -> None:
        self.path = Path(dump_folder) / FOLDER / f"rank{rank}.json"

    def save(self, loader: DataLoader, *, committed_step: int) -> None:
        """Record `loader`'s position after the committed step `committed_step`."""
        self._write({"committed": _position(loader, committed_step), "pending": None})

    def save_pending(self, loader: DataLoader, *, step: int) -> None:
        """Record `loader`'s position after `step`'s batch, which may or may not commit."""
        self._write({"committed": self._read().get("committed"), "pending": _position(loader, step)})

    def restore(self, loader: DataLoader, contributed: Callable[[int], bool]) -> int | None:
        """Move `loader` to the position after its last step that counted: the pending step if
        `contributed(step)` (a peer committed it with this group's gradients), else the
        committed one. Returns that step; None when there is none (the loader stays).

        Raises:
            ConfigError: the file is not a position this loader can take (another dataset,
                batch or layout).
        """
        record = self._read()
        pending = record.get("pending")
        chosen = pending if pending and contributed(pending["step"]) else record.get("committed")
        if chosen is None:
            return None
        loader.load_state_dict({"step": chosen["loader_step"], "rows": torch.tensor(chosen["rows"], dtype=torch.long),
                                "split": torch.tensor(chosen["split"]),
                                **({"source_rows": torch.tensor(chosen["source_rows"], dtype=torch.long)}
                                   if "source_rows" in chosen else {})})
        return int(chosen["step"])

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            raise ConfigError("job.dump_folder", str(self.path.parent.parent), f"{self.path} is unreadable ({err})",
                              "delete it to start this group's rows over, or restore it") from None

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file(self.path, json.dumps(record))


def _position(loader: DataLoader, step: int) -> dict:
    """`loader`'s position (`DataLoader.state_dict`) as JSON-able values, labelled with `step`."""
    state = loader.state_dict()
    return {"step": step, "loader_step": state["step"], "rows": state["rows"].tolist(),
            "split": state["split"].tolist(),
            **({"source_rows": state["source_rows"].tolist()} if "source_rows" in state else {})}
