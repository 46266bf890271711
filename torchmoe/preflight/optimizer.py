"""The `[optimizer]` keys that name the model's parameters, checked against the model before training.

    check_optimizer(cfg.optimizer, args)   # a muon_params pattern that matches nothing: ConfigError

Muon's ``muon_params`` / ``adamw_params`` are glob patterns over parameter names
(`optim.muon_groups`); one that matches no parameter of the model moved nothing between
Muon and AdamW, without a word (a typo, or another family's name). The names are the model's
own (`plan.layout.param_specs`: those of ``Transformer.named_parameters()``), read without
building the model.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import Optimizer
from torchmoe.plan.layout import param_specs

__all__ = ["check_optimizer"]


def check_optimizer(optimizer: Optimizer, args: ModelArgs) -> None:
    """Every pattern of ``muon_params`` and ``adamw_params`` matches a parameter of the model of `args`.

    Raises:
        ConfigError: naming the list, the pattern, the closest parameter names (their block
            index folded to ``*``) and the fix.
    """
    if optimizer.name != "Muon" or not (optimizer.muon_params or optimizer.adamw_params):
        return
    names = [spec.fqn for spec in param_specs(args)]
    for key in ("muon_params", "adamw_params"):
        for pattern in getattr(optimizer, key):
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                continue
            folded = list(dict.fromkeys(re.sub(r"(?<=layers\.)\d+(?=\.)", "*", name) for name in names))
            close = difflib.get_close_matches(pattern, folded, n=3, cutoff=0.5)
            shown = ", ".join(show_value(c) for c in close or folded[:3])
            raise ConfigError(f"optimizer.{key}", pattern, f"matches no parameter of the {args.family} model (its "
                              f"names are like {shown}), so it moves nothing between Muon and AdamW",
                              "write a glob over the model's parameter names (the run's opening lines list them per "
                              "role), or remove it")
