"""Each family's Hugging Face mapping, by `ModelArgs.family` or by config.json's ``model_type``.

    mapping = hf_mapping_for_config(json.load(open("config.json")))    # the family a checkpoint is
    args = mapping.args_from_hf_config(config)
    slices = hf_slices(model.state_dict(), args)                      # ours -> where HF stores it

Every family shares the decoder of `models.decoder` (its module tree, TP plan, parallelize
pipeline and pipeline split), configured by `ModelArgs`; what differs per family is the mapping
to its Hugging Face model, held in ``models/<family>/hf.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.deepseek_v3 import hf as deepseek_v3_hf
from torchmoe.models.gpt_oss import hf as gpt_oss_hf
from torchmoe.models.hf_config_spec import HFConfigValueError, HFConversionError, show_json
from torchmoe.models.hf_slices import HFSlice
from torchmoe.models.llama4 import hf as llama4_hf
from torchmoe.models.peft_targets import PeftTarget
from torchmoe.models.qwen3 import hf as qwen3_hf

__all__ = ["HFMapping", "family_titles", "hf_mapping", "hf_mapping_for_config", "hf_slices"]


@dataclass(frozen=True)
class HFMapping:
    """One family's mapping to its Hugging Face model.

    Attributes:
        title: the family as messages name it ("Llama 4").
        architecture: the ``transformers`` class a saved folder loads as.
        model_types: config.json ``model_type`` values of this family.
        args_from_hf_config: config.json (dict) -> `ModelArgs`; raises `HFConversionError`.
        hf_config_from_args: (`ModelArgs`, dtype) -> config.json dict.
        hf_slice: (our state-dict name, shape) -> `HFSlice`, or None for what HF has no place for.
        text_tensor_name: (a stored name, `ModelArgs`) -> the text model's name, or None for
            what is skipped (a multimodal checkpoint's vision tower, DeepSeek-V3's multi-token
            prediction layers).
        hf_copies: `ModelArgs` -> (our state-dict name, `HFSlice`) of the tensors the family's
            checkpoints store twice, the second place (DeepSeek-V3's MTP layers hold the
            embedding and the head): written on save, not read on load.
        read_architectures: config.json ``architectures`` of the family's releases besides
            `architecture` (Llama 4's multimodal class).
        peft_target: (our adapted weight or routed-expert adapter, shape) -> where PEFT adapts
            it on the transformers model (`models.peft_targets`); None where torchmoe has no
            PEFT mapping for the family (Llama 4).
    """

    title: str
    architecture: str
    model_types: tuple[str, ...]
    args_from_hf_config: Callable[[dict], ModelArgs]
    hf_config_from_args: Callable[[ModelArgs, torch.dtype], dict]
    hf_slice: Callable[[str, Sequence[int]], HFSlice | None]
    text_tensor_name: Callable[[str, ModelArgs], str | None]
    hf_copies: Callable[[ModelArgs], list[tuple[str, HFSlice]]] = lambda args: []
    read_architectures: tuple[str, ...] = ()
    peft_target: Callable[[str, Sequence[int]], PeftTarget] | None = None


_MAPPINGS: dict[str, HFMapping] = {
    "llama4": HFMapping("Llama 4", "Llama4ForCausalLM", ("llama4", "llama4_text"), llama4_hf.args_from_hf_config,
                        llama4_hf.hf_config_from_args, llama4_hf.hf_slice, llama4_hf.text_tensor_name,
                        read_architectures=("Llama4ForConditionalGeneration",)),
    "qwen3": HFMapping("Qwen3-MoE", "Qwen3MoeForCausalLM", qwen3_hf.MODEL_TYPES, qwen3_hf.args_from_hf_config,
                       qwen3_hf.hf_config_from_args, qwen3_hf.hf_slice, qwen3_hf.text_tensor_name,
                       peft_target=qwen3_hf.peft_target),
    "deepseek_v3": HFMapping("DeepSeek-V3", "DeepseekV3ForCausalLM", deepseek_v3_hf.MODEL_TYPES,
                             deepseek_v3_hf.args_from_hf_config, deepseek_v3_hf.hf_config_from_args,
                             deepseek_v3_hf.hf_slice, deepseek_v3_hf.text_tensor_name, deepseek_v3_hf.hf_copies,
                             peft_target=deepseek_v3_hf.peft_target),
    "gpt_oss": HFMapping("gpt-oss", "GptOssForCausalLM", gpt_oss_hf.MODEL_TYPES, gpt_oss_hf.args_from_hf_config,
                         gpt_oss_hf.hf_config_from_args, gpt_oss_hf.hf_slice, gpt_oss_hf.text_tensor_name,
                         peft_target=gpt_oss_hf.peft_target),
}


def family_titles() -> str:
    """The families torchmoe maps to Hugging Face, as messages name them ("Llama 4, Qwen3-MoE, ...")."""
    return ", ".join(m.title for m in _MAPPINGS.values())


def hf_mapping(args: ModelArgs) -> HFMapping:
    """The Hugging Face mapping of the family of `args`."""
    return _MAPPINGS[args.family]


def hf_mapping_for_config(config: dict) -> HFMapping:
    """The mapping of the family config.json's ``model_type`` names, which its ``architectures``
    (when given) must not contradict.

    Raises:
        HFConversionError: an unknown type, or none: every config.json transformers and torchmoe
            write has one (a missing one was taken for Llama 4's, and the folder's fields were
            blamed on Llama 4); the message names the families' types, and the one
            ``architectures`` points at.
        HFConfigValueError: ``architectures`` names a class of another family (an edited or mixed
            config.json: which of the two to believe is the user's to say) or of none.
    """
    known = ", ".join(t for m in _MAPPINGS.values() for t in m.model_types)
    if "model_type" not in config:
        architectures = config.get("architectures")
        named = {m.title: m.model_types for m in _MAPPINGS.values() for c in _classes(m)
                 if isinstance(architectures, list) and c in architectures}
        hint = "".join(f" (its architectures {show_json(architectures)} say {title}: "
                       f"{' or '.join(map(show_json, types))})" for title, types in named.items()) \
            if len(named) == 1 else ""
        raise HFConversionError(f"\"model_type\" is missing, so the family cannot be told: add the family's, one of "
                                f"{known}{hint}")
    model_type = config["model_type"]
    mapping = next((m for m in _MAPPINGS.values() if model_type in m.model_types), None)
    if mapping is None:
        raise HFConversionError(f"model_type {model_type!r} is not a family torchmoe trains (known: {known})")
    architectures = config.get("architectures")
    if architectures is None:
        return mapping
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise HFConfigValueError("architectures", architectures, "is not a list of class names",
                                 f'["{mapping.architecture}"]')
    strange = next((a for a in architectures if a not in _classes(mapping)), None)
    if strange is None:
        return mapping
    owner = next((m for m in _MAPPINGS.values() if strange in _classes(m)), None)
    if owner is None:
        raise HFConfigValueError("architectures", architectures, f"names {strange}, no class of model_type "
                                 f"{model_type!r} ({mapping.title}: {', '.join(_classes(mapping))})",
                                 f'["{mapping.architecture}"]')
    raise HFConfigValueError("architectures", architectures, f"names {owner.title}'s {strange}, but model_type "
                             f"{model_type!r} is {mapping.title}'s: one of the two was edited",
                             f'["{mapping.architecture}"] for a {mapping.title} checkpoint, or "model_type" to '
                             f'{" or ".join(map(show_json, owner.model_types))} for a {owner.title} one')


def _classes(mapping: HFMapping) -> tuple[str, ...]:
    """The config.json ``architectures`` a checkpoint of `mapping`'s family may name."""
    return (mapping.architecture, *mapping.read_architectures)


def hf_slices(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, HFSlice]:
    """`HFMapping.hf_slice` of every entry of `state` that Hugging Face stores (ours -> slice)."""
    mapping = hf_mapping(args)
    slices = {name: mapping.hf_slice(name, t.shape) for name, t in state.items()}
    return {name: s for name, s in slices.items() if s is not None}
