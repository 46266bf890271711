"""`python -m torchmoe train --config configs/debug_model.toml` (and `torchrun ... -m torchmoe train ...`)."""

import sys

from torchmoe.cli import main

sys.exit(main())
