"""Every trainable parameter's role in the model, whatever the family, and what the optimizer does
with it: whether Muon orthogonalises it, whether weight decay pulls it.

    roles = parameter_roles(model)        # name -> Role, in model order

The one place both of the optimizer's decisions are made (`muon_groups.muon_split` and
`optimizer.build_optimizer`), by what a parameter is, never by its ndim alone: gpt-oss's routed
experts' biases are 2-D ``(experts, out)``, its router and attention projections carry biases, and
LoRA's adapters are matrices beside a frozen weight.

| role | Muon | weight decay |
|---|---|---|
| linear weights (every ``nn.Linear`` weight in the blocks) | yes | yes |
| routed experts: their ``(experts, out, in)`` matrices | yes | yes |
| router gates | with ``optimizer.muon_router`` | yes |
| output head | no | yes |
| LoRA adapters (``lora_*``, linear and routed experts' alike) | no (LoRA trains with AdamW) | yes |
| embeddings | no | no |
| biases of any shape (routed experts' ``(experts, out)`` too) | no | no |
| norms, sinks and other vectors | no | no |

Weight decay follows transformers' Trainer (PEFT's adapters train under it: every weight decays
but biases and norms) and exempts the token embedding too, as torchmoe always has (decaying it
pulls rare tokens' rows toward zero). ``optimizer.decay_all_params`` decays everything
(torchtitan). The routers' expert biases (aux-loss-free balancing) are buffers, which no optimizer
holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchmoe.models.decoder.moe import TokenChoiceRouter
from torchmoe.nn.experts import RoutedExperts
from torchmoe.nn.lora import is_adapter_name

__all__ = ["ADAPTERS", "BIASES", "EMBEDDINGS", "EXPERT_BIASES", "GATES", "HEAD", "LINEAR", "ROUTED", "Role",
           "VECTORS", "parameter_roles"]

# The decoder's output head: the one top-level module every family names so.
_HEAD = "output"


@dataclass(frozen=True)
class Role:
    """What a parameter is: `name` (as the run's opening lines print it), `muon` (Muon
    orthogonalises it by default) and `decays` (weight decay applies to it)."""

    name: str
    muon: bool
    decays: bool


LINEAR = Role("linear weights", muon=True, decays=True)
ROUTED = Role("routed experts", muon=True, decays=True)
GATES = Role("router gates", muon=False, decays=True)
HEAD = Role("output head", muon=False, decays=True)
ADAPTERS = Role("LoRA adapters", muon=False, decays=True)
EMBEDDINGS = Role("embeddings", muon=False, decays=False)
EXPERT_BIASES = Role("routed-expert biases", muon=False, decays=False)
BIASES = Role("biases", muon=False, decays=False)
VECTORS = Role("norms, sinks and other vectors", muon=False, decays=False)


def _role(name: str, param: nn.Parameter, owner: nn.Module, gates: set[int]) -> Role:
    leaf = name.rpartition(".")[2]
    if is_adapter_name(name):
        return ADAPTERS
    if isinstance(owner, RoutedExperts):
        # (experts, out, in) matrices; (experts, out) is a bias per expert.
        return ROUTED if param.ndim == 3 else EXPERT_BIASES
    if isinstance(owner, nn.Linear) and leaf == "weight":
        if id(owner) in gates:
            return GATES
        return HEAD if name.rpartition(".")[0] == _HEAD else LINEAR
    if isinstance(owner, nn.Embedding):
        return EMBEDDINGS
    return BIASES if leaf == "bias" else VECTORS


def parameter_roles(model: nn.Module) -> dict[str, Role]:
    """Every trainable parameter's name -> its `Role`, in model order (frozen parameters, which
    no optimizer holds, left out)."""
    modules = dict(model.named_modules())
    gates = {id(m.gate) for m in modules.values() if isinstance(m, TokenChoiceRouter)}
    return {name: _role(name, param, modules[name.rpartition(".")[0]], gates)
            for name, param in model.named_parameters() if param.requires_grad}
