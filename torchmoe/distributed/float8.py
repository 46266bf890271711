"""Float8 training through torchao: float8 linears, float8 tensor parallelism, float8 routed experts.

- **Linears** (`float8.enable`): eligible ``nn.Linear`` modules (attention, dense FFN, shared
  experts; not `filter_fqns`, both dims multiples of 16) become torchao ``Float8Linear``.
- **TP in float8** (tensorwise recipe only, the seed's rule): those modules are sharded with
  torchao's float8 TP styles, so the TP all-gathers of block inputs (forward) and of output
  gradients (backward) move float8 bytes (`float8_tp_enabled`, used by `tensor_parallel`).
  Rowwise recipes keep TP communication in high precision (plain styles).
- **Routed experts** (`float8.routed_experts`): the grouped GEMMs of the ``RoutedExperts``
  modules `float8.moe_fqns` names run as torchao's float8 rowwise grouped GEMM, on expert row
  blocks padded to 16 rows (`nn.dispatch.pad_expert_blocks`), and on K and N padded to 16 where
  a checkpoint's dims are not (`_float8_grouped_mm`).

What the installed torchao and the device can run is checked by `float8_unavailable`, which the
preflight turns into a config error before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchmoe.config.job_config import Float8
from torchmoe.nn.lora import has_adapter
from torchmoe.plan.float8 import FLOAT8_TILE, float8_linear_eligible, selected_by

# torch._scaled_grouped_mm's CUDA kernels exist for these compute capabilities (major, minor or None: any).
_GROUPED_CAPABILITIES = ((9, 0), (10, None))
_TORCHAO_FIX = "pip install 'torchmoe[float8]' (torchao >= 0.18)"


class Float8Unavailable(RuntimeError):
    """Float8 was requested where it cannot run."""


def float8_unavailable(cfg: Float8, device: torch.device | str, *,
                       check_install: bool = True) -> tuple[str, str, str] | None:
    """What stops `cfg` on `device` (and, `check_install`, with this install: torchao):
    ``(key, problem, fix)``, or None when everything asked for can run. Only the switches that
    are on are checked."""
    device = torch.device(device)
    if cfg.enable:
        if not cfg.emulate:
            problem = _capability_problem(device, lambda cap: cap >= (8, 9), "8.9 or higher (H100, H200, L40S, B200)")
            if problem:
                return ("float8.enable", f"float8 matmuls need {problem}",
                        "run on such a GPU, set float8.emulate = true (high-precision emulation, for testing), "
                        "or float8.enable = false")
        if check_install and not _torchao_has("torchao.float8.float8_tensor_parallel"):
            return "float8.enable", "float8 linears need torchao, which is not installed (or older than 0.18)", \
                _TORCHAO_FIX
    if cfg.routed_experts:
        problem = _capability_problem(device, _grouped_capability_ok, "9.0 or 10.x (H100, H200, B200)")
        if problem:
            return ("float8.routed_experts", f"float8 routed experts run torch._scaled_grouped_mm, which needs "
                    f"{problem}", "run on such a GPU, or set float8.routed_experts = false")
        if check_install and not _torchao_has("torchao.prototype.moe_training"):
            return ("float8.routed_experts", "float8 routed experts need torchao's moe_training, which is not installed "
                    "(or older than 0.18)", _TORCHAO_FIX)
    return None


def _grouped_capability_ok(cap: tuple[int, int]) -> bool:
    return any(cap[0] == major and minor in (None, cap[1]) for major, minor in _GROUPED_CAPABILITIES)


def _capability_problem(device: torch.device, ok: Callable[[tuple[int, int]], bool], wanted: str) -> str | None:
    """None if `device` is a CUDA device whose compute capability passes `ok`, else what is missing."""
    if device.type != "cuda":
        return f"a CUDA GPU of compute capability {wanted}, not {device.type}"
    if not torch.cuda.is_available():
        return f"a CUDA GPU of compute capability {wanted}; CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if not ok(cap):
        return f"compute capability {wanted}; this {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}"
    return None


def _torchao_has(module: str) -> bool:
    """torchao is installed with `module` (finding a submodule imports its parents: torchao)."""
    with _quiet_torchao_import():
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # torchao itself is missing
            return False


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """Hold back what importing torchao logs that nobody can act on: a warning for each CUDA
    extension a CPU build of torch cannot load ("Failed to load ..._C_mxfp8...so") and torch's
    deprecation of each Enum torchao registers with pytree. Errors still show."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def apply_float8(model: nn.Module, cfg: Float8, device: torch.device | str) -> None:
    """Convert `model` (a `Transformer` or a pipeline stage, on any device incl. meta) in place
    for what `cfg` turns on: float8 linears and float8 routed experts. Runs before TP, so TP
    shards the float8 modules."""
    unavailable = float8_unavailable(cfg, device)
    if unavailable:
        key, problem, fix = unavailable
        raise Float8Unavailable(f"{key}: {problem}; {fix}")
    if cfg.enable:
        convert_float8_linears(model, cfg)
    if cfg.routed_experts:
        convert_float8_experts(model, cfg.moe_fqns)


def convert_float8_linears(model: nn.Module, cfg: Float8) -> list[str]:
    """Swap the eligible ``nn.Linear`` modules of `model` for torchao ``Float8Linear`` in place
    (no device check: `apply_float8` does it) and return their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe_name == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
                                    emulate=cfg.emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe_name), emulate=cfg.emulate)
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        # A linear with LoRA adapters stays high precision: the swap would drop its adapters.
        if isinstance(module, nn.Linear) and not has_adapter(module) and float8_linear_eligible(fqn, module.out_features, module.in_features,
                                                                    cfg.filter_fqns):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return converted


def is_float8_linear(module: nn.Module) -> bool:
    """`module` is a torchao ``Float8Linear`` (False while torchao's float8 linears are not
    imported: nothing can be one then, and the check imports nothing)."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(module, float8_linear.Float8Linear)


def convert_float8_experts(model: nn.Module, moe_fqns: list[str]) -> list[str]:
    """Make the routed-expert modules of `model` whose names contain any of `moe_fqns` run their
    grouped GEMMs in float8 (torchao's rowwise-scaled grouped GEMM, bf16 out); return their names.
    Their weights stay high-precision parameters: the casts happen in each forward and backward."""
    from torchmoe.nn.experts import RoutedExperts

    names = [fqn for fqn, module in model.named_modules()
             if isinstance(module, RoutedExperts) and selected_by(fqn, moe_fqns)]
    for fqn in names:
        model.get_submodule(fqn).float8_grouped_mm = _float8_grouped_mm
    return names


def _float8_grouped_mm(rows: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows @ w[e].T`` for each expert's row block in float8. rows: (R, K) bf16 row-major, each
    block a multiple of 16 rows; w: (E, N, K) (nn.Linear layout, so ``w.transpose(-2, -1)`` is the
    (E, K, N) per-expert column-major operand torchao wants); offsets: (E,) int32 block ends -> (R, N).

    torchao asserts K and N multiples of `FLOAT8_TILE` (its float8 operands' 16-byte rows): any
    other K or N (a checkpoint's hidden size, a MoE TP shard of it, the model dim) is padded with
    zero columns of rows and w and zero rows of w, whose output columns are dropped. Zeros change
    no row's or column's float8 scale (an absolute maximum) and add nothing to a product, and the
    pad's backward drops their gradients. torchao saves its operands for the backward: for such
    shapes only, the padded copy of w lives until then."""
    n = w.shape[1]
    k_pad, n_pad = -rows.shape[1] % FLOAT8_TILE, -n % FLOAT8_TILE
    if k_pad or n_pad:
        rows, w = F.pad(rows, (0, k_pad)), F.pad(w, (0, k_pad, 0, n_pad))  # (R, K'), (E, N', K')
    out = _torchao_grouped_mm()(rows, w.transpose(-2, -1), offsets, out_dtype=torch.bfloat16,
                                pad_token_groups_for_grouped_mm=False)
    return out[:, :n] if n_pad else out


@functools.cache
def _torchao_grouped_mm() -> Callable[..., torch.Tensor]:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm


def precompute_float8_scales(model_parts: list[nn.Module], cfg: Float8) -> None:
    """After each optimizer step: compute every FSDP float8 weight scale in one kernel."""
    if cfg.enable and cfg.enable_fsdp_float8_all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
