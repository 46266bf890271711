"""Float8 training of linear layers through torchao (CUDA, compute capability 8.9+).

Only ``nn.Linear`` modules are converted (attention and dense/shared-expert projections); the
grouped routed experts, the router and the output head stay in high precision. Tensorwise
scaling is the only recipe whose FSDP all-gather can itself be float8.
"""

from __future__ import annotations

import torch
from torch import nn

from torchmoe.config.job_config import Float8


class Float8Unavailable(RuntimeError):
    """Float8 was requested where it cannot run."""


def apply_float8(model: nn.Module, cfg: Float8) -> None:
    """Swap eligible ``nn.Linear`` modules of `model` for torchao ``Float8Linear`` in place."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise Float8Unavailable("float8 training needs a CUDA GPU with compute capability >= 8.9 (H100/H200/L40)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise Float8Unavailable("float8 training needs torchao: pip install torchao") from e
    if cfg.recipe_name == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather)
    else:
        if cfg.enable_fsdp_float8_all_gather:
            raise Float8Unavailable("float8 FSDP all-gather is only supported with recipe_name = 'tensorwise'")
        config = Float8LinearConfig.from_recipe_name(cfg.recipe_name)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in cfg.filter_fqns):
            return False
        # float8 GEMMs need both dimensions divisible by 16.
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def precompute_float8_scales(model_parts: list[nn.Module], cfg: Float8) -> None:
    """After each optimizer step: compute every FSDP float8 weight scale in one kernel."""
    if cfg.enable and cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
