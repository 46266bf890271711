"""Where the run stands: the step the loop, checkpoints and replica groups all read and move."""

from dataclasses import dataclass


@dataclass
class Progress:
    step: int = 0  # the steps trained so far (the next step is step + 1)
    recovered: bool = False  # a peer's live state was taken since the step's batch was drawn
