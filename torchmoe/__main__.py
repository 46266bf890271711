"""`python -m torchmoe train --config configs/debug_model.toml` (and `torchrun ... -m torchmoe train ...`)."""

from torchmoe.cli import run

run()
