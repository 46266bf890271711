"""Where PEFT puts an adapter of ours on a family's transformers model (`PeftTarget`): what each
family's ``peft_target`` (``models/<family>/hf.py``) returns and `hf_files.peft_adapter` writes
and reads by.

PEFT (0.21) adapts two kinds of places:

    target_modules      an nn.Linear: lora_A (r, in), lora_B (out, r)
    target_parameters   a parameter (ParamWrapper): a 2-D one as an nn.Linear's weight (the
                        routers of Qwen3-MoE, DeepSeek-V3 and gpt-oss are parameters); a 3-D
                        expert stack [E, out, in] (or [E, in, out] on modules marked
                        ``is_transposed``, gpt-oss) takes lora_A (E * r, in) and lora_B
                        (out, E * r), expert e's pair being rows e*r:(e+1)*r of lora_A and
                        columns e, E+e, 2E+e, ... of lora_B.

Our routed-expert adapters are ``w13`` (the fused gate/up rows, one A shared by both, as
transformers fuses ``gate_up_proj``) and ``w2`` (``down_proj``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchmoe.models.hf_config_spec import HFConversionError
from torchmoe.models.hf_slices import HFSlice

__all__ = ["EXPERT_PARAMETERS", "PeftTarget", "dense_mlp_refused", "peft_target_for"]

# Our routed-expert adapter -> the transformers experts' parameter it adapts (every mapped family).
EXPERT_PARAMETERS = {"w13": "gate_up_proj", "w2": "down_proj"}
_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w13|w2)$")
_ROUTER = re.compile(r"^layers\.\d+\.moe\.router\.gate\.weight$")


@dataclass(frozen=True)
class PeftTarget:
    """A place PEFT adapts: `module` (its name in the transformers model), and `parameter` (the
    adapted parameter of it, a ``target_parameters`` entry) or None (the module is an nn.Linear,
    a ``target_modules`` entry)."""

    module: str
    parameter: str | None = None

    @property
    def name(self) -> str:
        """The config entry: the module, or ``module.parameter``."""
        return self.module if self.parameter is None else f"{self.module}.{self.parameter}"


def peft_target_for(name: str, shape: Sequence[int], hf_slice: Callable[[str, Sequence[int]], HFSlice | None],
                    refused: dict[re.Pattern, str]) -> PeftTarget:
    """The `PeftTarget` of our adapted weight `name` (``layers.{i}.attention.wq.weight``, shape
    `shape`) or routed-expert adapter (``layers.{i}.moe.experts.w13``), by the family's
    `hf_slice`; routers are parameter targets.

    Raises:
        HFConversionError: `name` matches a pattern of `refused` (what PEFT cannot hold for the
            family; the value says why).
    """
    for pattern, reason in refused.items():
        if pattern.search(name):
            raise HFConversionError(reason)
    if m := _EXPERTS.match(name):
        layer, proj = m.groups()
        return PeftTarget(f"model.layers.{layer}.mlp.experts", EXPERT_PARAMETERS[proj])
    hf = hf_slice(name, shape)
    if hf is None or not hf.hf_name.endswith(".weight"):
        raise HFConversionError(f"no Hugging Face module for the adapted weight {name!r}")
    module = hf.hf_name.removesuffix(".weight")
    return PeftTarget(module, "weight") if _ROUTER.match(name) else PeftTarget(module)


def dense_mlp_refused(title: str) -> dict[re.Pattern[str], str]:
    """`peft_target_for`'s refusals for a family whose routed experts transformers 4 named like its
    dense MLP: PEFT (0.21) on transformers 5 reads a target module named gate_proj, up_proj or
    down_proj of such a model type as a routed expert and moves it onto the fused experts, so
    adapters on the dense MLP and the shared experts cannot be written in its format."""
    return {re.compile(r"\.(feed_forward|moe\.shared_experts)\.w[123]\.weight$"): (
        f"PEFT (transformers 5) reads target modules named gate_proj/up_proj/down_proj of {title} as routed "
        "experts, so it cannot load adapters on the dense MLP (lora.targets \"mlp\") or the shared experts "
        "(\"shared_experts\")")}
