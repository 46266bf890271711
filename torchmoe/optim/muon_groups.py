"""Which parameters Muon optimizes and which it leaves to AdamW, by their role in the model
(`param_roles`, the roles weight decay follows too).

    split = muon_split(model, cfg.optimizer)     # name -> (algorithm, role)
    for line in describe_split(model, cfg.optimizer): logger.info(line)

Roles, whatever the family (never by ndim alone: gpt-oss's expert biases are 2-D):

- Muon: the weight of every ``nn.Linear`` in the transformer (attention and MLA projections,
  dense and shared-expert MLPs, the multi-token-prediction projection), the routers' gates when
  ``muon_router``, and the 3-D matrices ``(experts, out, in)`` of routed experts;
- AdamW: the token embedding, the output head, norms, biases (also routed experts' 2-D
  ``(experts, out)`` biases), attention sinks, and the routers' gates unless ``muon_router``.

``muon_params`` / ``adamw_params`` (glob patterns over the names) override the role: a name
matching ``adamw_params`` goes to AdamW, one matching ``muon_params`` to Muon if it has matrices.
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.nn.experts import RoutedExperts
from torchmoe.optim.param_roles import GATES, parameter_roles

__all__ = ["describe_split", "muon_split"]


def muon_split(model: nn.Module, cfg: OptimizerConfig) -> dict[str, tuple[str, str]]:
    """Every trainable parameter's name -> ("muon" or "adamw", its role), in model order.

    Raises:
        ConfigError: a name matched by both pattern lists, or a ``muon_params`` match that has
            no matrices (a vector, or routed experts' biases).
    """
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    split: dict[str, tuple[str, str]] = {}
    for name, kind in parameter_roles(model).items():
        param, owner = params[name], modules[name.rpartition(".")[0]]
        muon, role = kind.muon or (kind == GATES and cfg.muon_router), kind.name
        forced_muon = [p for p in cfg.muon_params if fnmatch.fnmatchcase(name, p)]
        forced_adamw = [p for p in cfg.adamw_params if fnmatch.fnmatchcase(name, p)]
        if forced_muon and forced_adamw:
            raise ConfigError("optimizer.muon_params", forced_muon[0], f"matches {name}, which optimizer.adamw_params' "
                              f"{forced_adamw[0]!r} matches too", "make the two lists' patterns disjoint")
        if forced_muon:
            matrices = param.ndim == 3 if isinstance(owner, RoutedExperts) else param.ndim == 2
            if not matrices:
                raise ConfigError("optimizer.muon_params", forced_muon[0], f"matches {name} of shape "
                                  f"{tuple(param.shape)}, which holds no matrix: Muon orthogonalises matrices "
                                  "(out, in) and stacks of routed experts' matrices only",
                                  "narrow the pattern to weight matrices")
            muon, role = True, "muon_params"
        elif forced_adamw:
            muon, role = False, "adamw_params"
        split[name] = ("muon" if muon else "adamw", role)
    return split


def describe_split(model: nn.Module, cfg: OptimizerConfig) -> list[str]:
    """The run's opening lines on the split: per optimizer, its tensors and elements, then per
    role the parameter names, those of several blocks folded (``layers.N.attention.wq.weight x4``)."""
    split = muon_split(model, cfg)
    params = dict(model.named_parameters())
    lines = []
    for algorithm, label in (("muon", "Muon"), ("adamw", "AdamW")):
        names = [n for n, (a, _) in split.items() if a == algorithm]
        elements = sum(params[n].numel() for n in names)
        lines.append(f"{label}: {len(names)} tensors, {elements:,} elements")
        roles: dict[str, dict[str, list[str]]] = {}
        for n in names:
            roles.setdefault(split[n][1], {}).setdefault(re.sub(r"(?<=layers\.)\d+(?=\.)", "N", n), []).append(n)
        for role, folded in roles.items():
            shown = ", ".join(f"{f} x{len(ns)}" if len(ns) > 1 else ns[0] for f, ns in folded.items())
            lines.append(f"  {role}: {shown}")
    return lines
