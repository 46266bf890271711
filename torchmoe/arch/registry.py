"""The model families torchmoe trains, by `model.name`, and the `ModelArgs` a `[model]` section means.

    python -c "from torchmoe.arch.registry import FLAVORS; print({k: list(v) for k, v in FLAVORS.items()})"

The one place a family's name is looked up: every other module reads `ModelArgs` (and its
`family`), never the name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchmoe.arch import deepseek_v3, gpt_oss, llama4, qwen3
from torchmoe.arch.model_args import ModelArgs

if TYPE_CHECKING:
    from torchmoe.config.job_config import Model

# model.name -> flavor name -> architecture. The names are torchtitan's, so its users find them.
FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "llama4": llama4.FLAVORS,
    "qwen3": qwen3.FLAVORS,
    "deepseek_v3": deepseek_v3.FLAVORS,
    "gpt_oss": gpt_oss.FLAVORS,
}


def build_model_args(name: str, flavor: str, *, attn_backend: str = "", use_grouped_mm: bool = True,
                     load_balance_coeff: float = -1.0, aux_loss_coeff: float = -1.0,
                     z_loss_coeff: float = 0.0, moe_force_load_balance: bool = False, mtp_layers: int = 0,
                     mtp_loss_coeff: float = 0.1) -> ModelArgs:
    """Family `name`'s flavor `flavor` with overrides applied; sentinel values keep the flavor's
    own (`model_args_from_config` passes a `[model]` section's). Raises KeyError for an unknown
    family or flavor (the config checks name both before a model is built)."""
    overrides: dict = {"use_grouped_mm": use_grouped_mm, "z_loss_coeff": z_loss_coeff,
                       "moe_force_load_balance": moe_force_load_balance, "mtp_layers": mtp_layers,
                       "mtp_loss_coeff": mtp_loss_coeff}
    if attn_backend:
        overrides["attn_backend"] = attn_backend
    if load_balance_coeff >= 0:
        overrides["load_balance_coeff"] = load_balance_coeff or None
    if aux_loss_coeff >= 0:
        overrides["aux_loss_coeff"] = aux_loss_coeff
    return FLAVORS[name][flavor].replace(**overrides)


def model_args_from_config(model_cfg: "Model") -> ModelArgs:
    """The `ModelArgs` a `[model]` config section describes."""
    return build_model_args(model_cfg.name, model_cfg.flavor, attn_backend=model_cfg.attn_backend,
                            use_grouped_mm=model_cfg.use_grouped_mm,
                            load_balance_coeff=model_cfg.load_balance_coeff,
                            aux_loss_coeff=model_cfg.aux_loss_coeff, z_loss_coeff=model_cfg.z_loss_coeff,
                            moe_force_load_balance=model_cfg.moe_force_load_balance,
                            mtp_layers=model_cfg.mtp_layers, mtp_loss_coeff=model_cfg.mtp_loss_coeff)
