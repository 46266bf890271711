"""Divergence: state that became NaN/inf stops the run (exit 1, naming the step) before it is
saved, so no checkpoint ever holds it.

The per-step checks ride on the step's one host sync (`Trainer.train_step`): the loss, the
gradient norm, and whether an MoE expert bias is finite. Parameters and optimizer state are
checked in full only by the writers of weights (`weights.finite`: every save, the Hugging
Face export): a pass over every tensor each step would cost what a save does, and a non-finite
update shows up in the next step's loss anyway. Weights that come in non-finite are refused at
load, so a divergence is always training's.
"""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """Training state became NaN/inf; the run stops without saving that state."""
