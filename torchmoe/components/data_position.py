"""Where a replica group's rows stand after its last committed step, saved every step.

    position = DataPosition(dump_folder, rank=0)
    position.save(loader, committed_step=12)       # after each step the quorum committed
    position.restore(loader)                      # on live recovery from a peer

Under fault tolerance (`distributed.fault_tolerance`) a group that died and comes back takes the
model, optimizer and step from a healthy peer, but its rows are its own: no peer holds them. So
every rank writes its loader's position (`DataLoader.state_dict`: per row, which document and
token comes next) after each step its group committed, and a recovering group starts from there:
none of its rows is trained twice, and none is left out (the rows of the steps it missed come
later than planned). A full restart of every group resumes from the checkpoints instead, whose
positions belong with their weights.

JSON, written atomically (`file_writes.write_file`); loading it runs nothing (no pickle).
"""

from __future__ import annotations

import json
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
        state = loader.state_dict()
        record = {"committed_step": committed_step, "loader_step": state["step"],
                  "rows": state["rows"].tolist(), "split": state["split"].tolist(),
                  **({"source_rows": state["source_rows"].tolist()} if "source_rows" in state else {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file(self.path, json.dumps(record))

    def restore(self, loader: DataLoader) -> int | None:
        """Move `loader` to the saved position; the committed step it was saved after (None when
        this rank never committed one: the loader stays where it is).

        Raises:
            ConfigError: the file is not a position this loader can take (another dataset,
                batch or layout).
        """
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise ConfigError("job.dump_folder", str(self.path.parent.parent), f"{self.path} is unreadable ({err})",
                              "delete it to start this group's rows over, or restore it") from None
        state = {"step": record["loader_step"], "rows": torch.tensor(record["rows"], dtype=torch.long),
                 "split": torch.tensor(record["split"]),
                 **({"source_rows": torch.tensor(record["source_rows"], dtype=torch.long)}
                    if "source_rows" in record else {})}
        loader.load_state_dict(state)
        return int(record["committed_step"])
