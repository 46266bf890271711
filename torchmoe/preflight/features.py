"""Checks of features against each other and against this machine and launch: what cannot
run on the chosen device or install is refused before training, not at its first step."""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.job_config import ActivationCheckpoint, Checkpoint, JobConfig, Metrics
from torchmoe.config.launch_env import launch_int
from torchmoe.hf_files.hf_storage import holds_expert_bias, require_hf_form
from torchmoe.hf_files.peft_adapter import BIASES_WITHOUT_PLACE, require_peft_form
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.llama4 import Transformer
from torchmoe.models.registry import hf_mapping
from torchmoe.plan.layout import param_specs
from torchmoe.plan.parallel_dims import ParallelDims


def check_features(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], check_device: bool) -> None:
    """Feature combinations that cannot work: compile/AC/attention, CUDA-only features, and
    (`check_device`) what this machine lacks: CUDA, the tensorboard and wandb packages."""
    if cfg.parallelism.enable_async_tensor_parallel and not cfg.compile.enable:
        raise ConfigError("parallelism.enable_async_tensor_parallel", True, "async TP is implemented by torch.compile",
                          "set compile.enable = true, or enable_async_tensor_parallel = false")
    if cfg.activation_checkpoint.mode == "selective" and args.attn_backend == "flex":
        raise ConfigError("activation_checkpoint.mode", "selective",
                          "selective AC is not supported with attn_backend \"flex\"",
                          'use activation_checkpoint.mode = "full", or model.attn_backend = "sdpa"')
    _check_forced_recompute(cfg.activation_checkpoint, args)
    if cfg.checkpoint.last_save_in_hf:  # found out before training, not after
        _check_hf_export(cfg.checkpoint, args, cfg.model.flavor)
    if cfg.training.document_masking and args.attn_backend == "flex":
        raise ConfigError("model.attn_backend", "flex", "document masking runs the fused kernels per document "
                          "(nn.document_attention); FlexAttention is not wired to it",
                          'use model.attn_backend = "sdpa", or training.document_masking = false')
    _check_sink_attention(cfg, args)
    _check_multi_token_prediction(args, degrees)
    if cfg.lora.enable:
        _check_lora(cfg, args)
    if cfg.optimizer.qk_clip_threshold > 0:
        _check_qk_clip(cfg, args, degrees["cp"])
    if degrees["cp"] > 1 and args.attn_backend == "flex":
        raise ConfigError("model.attn_backend", "flex", "context parallelism runs SDPA with masks over global "
                          "positions; FlexAttention is not wired to it", 'use model.attn_backend = "sdpa"')

    device = cfg.training.device
    cuda = torch.cuda.is_available()
    if check_device and device == "cuda" and not cuda:
        raise ConfigError("training.device", device, "CUDA is not available on this machine",
                          'use training.device = "cpu" (or "" to pick automatically)')
    if args.attn_backend == "flex" and (device == "cpu" or (check_device and not cuda)):
        # Its CPU kernel has no backward: training would fail at the first step.
        raise ConfigError("model.attn_backend", "flex", "FlexAttention cannot train on CPU (no backward kernel there)",
                          'use model.attn_backend = "sdpa" on CPU, or run on CUDA')
    _check_flex_compiled(cfg, args)
    if cfg.parallelism.fsdp_cpu_offload:
        if not ParallelDims(**degrees, world_size=math.prod(degrees[d] for d in ("pp", "dp_replicate", "dp_shard",
                                                                                 "cp", "tp"))).fsdp_enabled:
            raise ConfigError("parallelism.fsdp_cpu_offload", True, "offloads FSDP's sharded state, but this layout "
                              "applies no FSDP (dp_shard * cp = 1 and no expert sharding)",
                              "set fsdp_cpu_offload = false, or shard with data_parallel_shard_degree > 1")
    # CPU offload moves FSDP state off an accelerator: FSDP2 refuses it when there is none.
    cuda_only = (("parallelism.enable_async_tensor_parallel", cfg.parallelism.enable_async_tensor_parallel),
                 ("parallelism.fsdp_cpu_offload", cfg.parallelism.fsdp_cpu_offload))
    for key, enabled in cuda_only:
        if not enabled:
            continue
        if device == "cpu":
            raise ConfigError(key, True, 'needs CUDA, but training.device = "cpu"',
                              f"set {key} = false, or run on CUDA")
        if check_device and not cuda:
            raise ConfigError(key, True, "needs CUDA, which is not available on this machine",
                              f"set {key} = false, or run on a CUDA machine")
    if check_device:
        _check_packages(cfg.metrics)


def _check_lora(cfg: JobConfig, args: ModelArgs) -> None:
    """Targets the model has none of (they would adapt nothing, or leave nothing to train), and
    what a LoRA run cannot export, refused before training: adapters of a family torchmoe has
    no PEFT mapping for, or on a target PEFT cannot hold (checked on the adapted model's shapes,
    built on the meta device), or expert biases the run trains (`model.load_balance_coeff` set),
    which PEFT's format has no place for."""
    layers = lora_target_layers(args)
    missing = next((t for t in cfg.lora.targets if not layers[t]), None)
    if missing is not None:
        what = {"mlp": "dense (non-MoE) layer", "shared_experts": "shared expert"}.get(missing, "MoE layer")
        has = ", ".join(show_value(t) for t, n in layers.items() if n)
        raise ConfigError("lora.targets", cfg.lora.targets, f"{show_value(missing)}: the {args.family} model "
                          f"({cfg.model.flavor}) has no {what}, so no adapter would be put there",
                          f"drop {show_value(missing)} from lora.targets; this model has {has}")
    if cfg.lora.export != "adapter":
        return
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, cfg.lora)
    require_peft_form(model)  # raises the ConfigError naming lora.export and the target
    if args.load_balance_coeff and args.moe_layer_ids:
        raise ConfigError("model.load_balance_coeff", cfg.model.load_balance_coeff, "trains the expert biases beside "
                          f'the adapters, and lora.export = "adapter" would write them without: {BIASES_WITHOUT_PLACE}',
                          'set lora.export = "merged" (the model with each adapter folded into its weight, and the '
                          "biases as trained), or leave model.load_balance_coeff unset (-1: under LoRA the biases "
                          "stay the base's)")


def lora_target_layers(args: ModelArgs) -> dict[str, int]:
    """Each `lora.targets` name -> how many blocks of the model of `args` hold modules it adapts
    (`models.decoder.lora`), counted from the arguments without building the model."""
    moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return {"attention": args.n_layers, "mlp": args.n_layers - moe,
            "shared_experts": moe if args.num_shared_experts else 0, "experts": moe, "router": moe}


def _check_flex_compiled(cfg: JobConfig, args: ModelArgs) -> None:
    """FlexAttention is fused only by inductor: without compiling the blocks that call it, its
    eager path builds every (query, key) score of a row (B x H x S x S floats per layer, 64 GiB in
    fp32 for one 8192-token row of 64 heads), where SDPA's fused kernels hold none."""
    if args.attn_backend != "flex":
        return
    compiled = cfg.compile
    missing = (("compile.enable", compiled.enable, "true") if not compiled.enable else
               ("compile.components", compiled.components, '["model"]') if "model" not in compiled.components else
               ("compile.backend", compiled.backend, '"inductor"') if compiled.backend != "inductor" else None)
    if missing is not None:
        key, value, wanted = missing
        raise ConfigError(key, value, 'model.attn_backend = "flex" needs inductor to compile the blocks (compile.enable '
                          '= true, "model" in compile.components, compile.backend = "inductor"): FlexAttention\'s '
                          "eager path holds every query-key score of a row in memory",
                          f'set {key} = {wanted}, or use model.attn_backend = "sdpa"')


def _check_hf_export(checkpoint: Checkpoint, args: ModelArgs, flavor: str) -> None:
    """`checkpoint.last_save_in_hf` writes the model trained: its family's Hugging Face model
    expresses the flavor, and holds the expert bias the run trains (unless the user let the
    export drop it: `checkpoint.hf_drop_expert_bias`)."""
    require_hf_form("checkpoint.last_save_in_hf", True, args, flavor,
                    "set checkpoint.last_save_in_hf = false: the run's DCP checkpoints keep the weights")
    if args.load_balance_coeff and not holds_expert_bias(args) and not checkpoint.hf_drop_expert_bias:
        raise ConfigError("model.load_balance_coeff", args.load_balance_coeff, "trains the aux-loss-free expert "
                          f"bias, which Hugging Face {hf_mapping(args).title} has no place for: "
                          "checkpoint.last_save_in_hf = true would write a model that selects other experts than "
                          "the one trained (another loss)", "set model.load_balance_coeff = 0 (balance with "
                          "model.aux_loss_coeff instead), or checkpoint.hf_drop_expert_bias = true to export "
                          "without the bias")


def _check_sink_attention(cfg: JobConfig, args: ModelArgs) -> None:
    """gpt-oss's attention (sinks, sliding windows) runs `nn.sink_attention` (whole rows, context
    parallelism's pieces) and document masking's segments (`nn.segment_attention`), which carry
    the sinks and the window; FlexAttention's block masks do not."""
    if args.windowed_or_sink_attention and args.attn_backend == "flex":
        raise ConfigError("model.attn_backend", "flex", f"model.name = {show_value(cfg.model.name)} attends with sinks "
                          "and sliding windows; FlexAttention's block masks do not carry the sinks",
                          'use model.attn_backend = "sdpa"')


def _check_qk_clip(cfg: JobConfig, args: ModelArgs, cp: int) -> None:
    """QK-Clip (`optim.qk_clip`) measures every head's logits over whole rows and scales
    the weights that make them, the same in every replica."""
    key, value = "optimizer.qk_clip_threshold", cfg.optimizer.qk_clip_threshold
    if not any(args.logits_unbounded(layer) for layer in range(args.n_layers)):
        raise ConfigError(key, value, f"{cfg.model.name}'s attention normalises every layer's queries and keys "
                          "(QK-norm), which bounds its logits: QK-Clip has nothing to clip", "set it to 0")
    if cp > 1:
        raise ConfigError(key, value, "context parallelism splits each row's queries and keys between ranks, and "
                          "QK-Clip's logit maxima are measured over whole rows on one rank",
                          "set parallelism.context_parallel_degree = 1, or optimizer.qk_clip_threshold = 0")
    if cfg.fault_tolerance.enable:
        raise ConfigError(key, value, "replica groups would each clip by their own rows' logits, and their weights "
                          "would drift apart", "set fault_tolerance.enable = false (HSDP replicates the same way), "
                          "or optimizer.qk_clip_threshold = 0")
    if cfg.lora.enable:
        raise ConfigError(key, value, "LoRA freezes the query and key weights QK-Clip scales (the adapters' "
                          "product would be left unclipped)", "set it to 0 for LoRA")


def _check_multi_token_prediction(args: ModelArgs, degrees: dict[str, int]) -> None:
    """DeepSeek-V3's multi-token prediction (`models.decoder.mtp`) reads the tokens up to D
    positions past each one, and runs the main model's embedding after its last block."""
    if not args.mtp_layers:
        return
    what = f"model.mtp_layers = {args.mtp_layers}"
    if not args.mtp_supported:
        raise ConfigError("model.mtp_layers", args.mtp_layers, f"multi-token prediction is DeepSeek-V3's; the "
                          f"{args.family} family has no place for its layers (nor its Hugging Face form)",
                          'set model.mtp_layers = 0, or model.name = "deepseek_v3"')
    if degrees["cp"] > 1:
        raise ConfigError("parallelism.context_parallel_degree", degrees["cp"], f"{what} reads the tokens up to "
                          f"{args.mtp_layers} positions past each one, which context parallelism places on other "
                          "ranks", "set parallelism.context_parallel_degree = 1, or model.mtp_layers = 0")
    if degrees["pp"] > 1:
        raise ConfigError("parallelism.pipeline_parallel_degree", degrees["pp"], f"{what} runs the first stage's "
                          "embedding after the last stage's blocks", "set parallelism.pipeline_parallel_degree = 1 "
                          "(shard over data_parallel_shard_degree or expert_parallel_degree), or model.mtp_layers = 0")


def _check_forced_recompute(ac_cfg: ActivationCheckpoint, args: ModelArgs) -> None:
    """Under per-op selective AC every `per_op_sac_force_recompute_mm_shapes_by_fqns` entry must
    name an nn.Linear of a block (else it would force nothing, silently)."""
    if (ac_cfg.mode, ac_cfg.selective_ac_option) != ("selective", "op"):
        return
    # layers.<i>.<name in the block>
    linears = [s.fqn.removesuffix(".weight") for s in param_specs(args) if s.layer is not None and len(s.shape) == 2]
    for entry in ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns:
        if not any(entry in name for name in linears):
            in_block = ", ".join(sorted({name.split(".", 2)[2] for name in linears}))
            raise ConfigError("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
                              ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns,
                              f"{show_value(entry)} is in the name of no nn.Linear of a transformer block",
                              f"name part of a block's linear: {in_block}")


def _check_packages(metrics: Metrics) -> None:
    """Each optional extra a `[metrics]` switch turns on must be installed (its package and
    extra share the name)."""
    for key, package, enabled in (("metrics.enable_tensorboard", "tensorboard", metrics.enable_tensorboard),
                                  ("metrics.enable_wandb", "wandb", metrics.enable_wandb)):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(key, True, f"the {package} package is not installed",
                              f"pip install 'torchmoe[{package}]', or set {key} = false")


# Set by torchrun (and other launchers) for every worker; init_process_group's env:// reads them.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_launch(checkpoint: Checkpoint, world_size: int) -> None:
    """A multi-rank run must have been started by a launcher: WORLD_SIZE > 1 alone (exported in
    a shell, say) would wait for peers that never come; a RANK no launcher sets (``abc``, or
    not below WORLD_SIZE) would fail inside the process group's start. A seed checkpoint is one
    process's job."""
    rank = launch_int("RANK", 0)
    missing = [v for v in LAUNCH_VARS if v not in os.environ]
    if world_size > 1 and missing:
        raise ConfigError("WORLD_SIZE", world_size, f"is set, but not by torchrun: {', '.join(missing)} "
                          "missing from the environment",
                          f"launch with torchrun --nproc-per-node {world_size} -m torchmoe train ..., "
                          "or unset WORLD_SIZE to run in one process")
    if world_size > 1 and rank >= world_size:
        raise ConfigError("RANK", rank, f"is not below WORLD_SIZE ({world_size}): no rank of this world has it",
                          "launch with torchrun, which numbers the ranks 0 .. WORLD_SIZE - 1")
    if checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError("checkpoint.create_seed_checkpoint", True,
                          f"a seed checkpoint is written by one process, but the world has {world_size} ranks",
                          "run it without torchrun (one process)")
