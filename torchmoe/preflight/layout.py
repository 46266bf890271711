"""Checks of the model's shape against the layout: splits over tp/ep/cp, batch and pipeline
arithmetic, sequence length against the model's positions, and the memory of the fullest rank
against the device's."""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from torchmoe.arch.model_args import ModelArgs
from torchmoe.arch.registry import FolderModel, check_model
from torchmoe.config.degrees import divisors_text
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.paths import key_value
from torchmoe.config.job_config import JobConfig, Model, Parallelism, Training
from torchmoe.config.launch_env import launch_int
from torchmoe.plan.memory import estimate_memory
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import SPLIT_BACKWARD_SCHEDULES, check_microbatches, job_pipeline_layout

GIB = 2**30


def check_flavor(model: Model) -> None:
    """`model.name` is a family torchmoe trains (`arch.registry.FLAVORS`) and `model.flavor` one
    of its flavors (`arch.registry.check_model`); a model built from a Hugging Face folder has
    the folder's architecture instead (`arch.registry.FolderModel`)."""
    if not isinstance(model, FolderModel):
        check_model(model.name, model.flavor)


def check_seq_len(args: ModelArgs, flavor: str, seq_len: int) -> None:
    """A sequence may not be longer than the model's positions (`ModelArgs.max_seq_len`)."""
    if seq_len > args.max_seq_len:
        raise ConfigError("training.seq_len", seq_len,
                          f"the {flavor} flavor has {args.max_seq_len} positions (allowed: 1 .. {args.max_seq_len})",
                          f"use a seq_len of at most {args.max_seq_len}")


def check_validation(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int]) -> None:
    """Validation batches run the training layout's forward: what that layout needs of them."""
    val, seq_len = cfg.validation, cfg.validation.seq_len
    if not val.enable:
        return
    if degrees["pp"] > 1:
        raise ConfigError("validation.enable", True, f"validation does not run under pipeline parallelism "
                          f"(pp = {degrees['pp']}): the schedule is built for training's micro-batches",
                          "set validation.enable = false, or validate in a run without pipeline parallelism")
    if degrees["cp"] > 1 and seq_len != cfg.training.seq_len:
        raise ConfigError("validation.seq_len", seq_len, f"under context parallelism (cp = {degrees['cp']}) it must "
                          f"be training.seq_len ({cfg.training.seq_len}): the split over ranks is built for it",
                          f"set validation.seq_len = {cfg.training.seq_len}")
    if seq_len > args.max_seq_len:
        raise ConfigError("validation.seq_len", seq_len, f"the {cfg.model.flavor} flavor has {args.max_seq_len} "
                          "positions", f"use a seq_len of at most {args.max_seq_len}")
    if degrees["tp"] > 1 and seq_len % degrees["tp"]:
        raise ConfigError("validation.seq_len", seq_len, f"sequence parallelism shards it over tp({degrees['tp']}); "
                          f"{seq_len} % {degrees['tp']} = {seq_len % degrees['tp']}",
                          f"use a seq_len that is a multiple of {degrees['tp']}")


def check_model_split(args: ModelArgs, flavor: str, degrees: dict[str, int], seq_len: int) -> None:
    """The model's shape must split evenly over tp, ep and cp (pp: `_validate_pipeline`)."""
    tp, ep, cp = degrees["tp"], degrees["ep"], degrees["cp"]
    has_dense = any(not args.is_moe_layer(i) for i in range(args.n_layers))
    tp_split = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "moe_hidden_dim": args.moe_hidden_dim,
                "vocab_size": args.vocab_size}
    if has_dense:
        tp_split["ffn_hidden_dim"] = args.ffn_hidden_dim
    for dim_name, size in tp_split.items():
        if size % tp:
            valid = divisors_text(math.gcd(*tp_split.values()))
            raise ConfigError(
                "parallelism.tensor_parallel_degree", tp,
                f"must divide the {flavor} flavor's {dim_name} ({size}); {size} % {tp} = {size % tp}",
                f"use a tensor_parallel_degree that divides every sharded dim of {flavor}: {valid}",
            )
    if args.num_experts % ep:
        raise ConfigError(
            "parallelism.expert_parallel_degree", ep,
            f"the {flavor} flavor has {args.num_experts} experts; {args.num_experts} % {ep} = {args.num_experts % ep}",
            f"use an expert_parallel_degree that divides {args.num_experts}: {divisors_text(args.num_experts)}",
        )
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            "training.seq_len", seq_len,
            f"context parallelism splits each sequence into 2 * cp = {2 * cp} chunks; "
            f"{seq_len} % {2 * cp} = {seq_len % (2 * cp)}",
            f"use a seq_len that is a multiple of {2 * cp}",
        )
    # Sequence parallelism shards each CP rank's slice of the sequence over tp.
    if tp > 1 and seq_len % (cp * tp):
        raise ConfigError(
            "training.seq_len", seq_len,
            f"sequence parallelism shards it over cp({cp}) * tp({tp}) = {cp * tp}; "
            f"{seq_len} % {cp * tp} = {seq_len % (cp * tp)}",
            f"use a seq_len that is a multiple of {cp * tp}",
        )


def check_force_load_balance(args: ModelArgs, degrees: dict[str, int], seq_len: int) -> None:
    """`model.moe_force_load_balance` is exact and layout-independent only where it can be.

    Each rank numbers the tokens of its MoE call from 0 and sends copy t*k + j to expert
    (t*k + j) mod E. Every expert gets as many copies, and every token the expert it gets in one
    process, only if each contiguous run of a sequence that a rank holds starts and ends at a
    multiple of u = E / gcd(E, k) tokens: the sequence, a context-parallel piece (seq_len / 2cp),
    and under EP with TP a rank's shard of its cp slice (seq_len / cp / tp)."""
    if not args.moe_force_load_balance:
        return
    unit = args.num_experts // math.gcd(args.num_experts, args.top_k)
    cp, tp = degrees["cp"], degrees["tp"]
    runs = {"a sequence": seq_len}
    if cp > 1:
        runs[f"a context-parallel piece (seq_len / 2cp = {seq_len} / {2 * cp})"] = seq_len // (2 * cp)
    if degrees["ep"] > 1 and tp > 1:
        runs[f"a rank's sequence shard under EP with TP (seq_len / cp / tp = {seq_len} / {cp} / {tp})"] = \
            seq_len // cp // tp
    for run, tokens in runs.items():
        if tokens % unit:
            raise ConfigError("model.moe_force_load_balance", True,
                              f"round-robin routing fills every expert equally, and alike in every layout, only if "
                              f"{run} holds a multiple of num_experts / gcd(num_experts, top_k) = {unit} tokens, "
                              f"not {tokens}", f"use a training.seq_len that makes it a multiple of {unit}, or set "
                              "moe_force_load_balance = false")


def check_pipeline(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], world_size: int) -> None:
    """The stage split and the micro-batches must suit the schedule; what PP cannot run is refused."""
    if degrees["pp"] == 1:
        return
    par = cfg.parallelism
    pipe = job_pipeline_layout(args, ParallelDims(**degrees, world_size=world_size), par, cfg.training, cfg.optimizer)
    check_microbatches(cfg.training, par, degrees["pp"], pipe.num_stages)
    if args.tie_word_embeddings:
        raise ConfigError("parallelism.pipeline_parallel_degree", degrees["pp"],
                          f"the {cfg.model.flavor} flavor ties the output head to the embedding, which live on "
                          "the last and the first pipeline stage", "use pipeline_parallel_degree = 1 for this model")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op" and par.pipeline_parallel_schedule in \
            SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError("activation_checkpoint.selective_ac_option", "op",
                          f"{par.pipeline_parallel_schedule} runs each block's backward twice (input, then weight "
                          "gradients), and per-op selective AC allows one backward per checkpointed region",
                          'use activation_checkpoint.mode = "full", a per-layer selective_ac_option (e.g. "2"), '
                          "or a schedule without split backward (1F1B, Interleaved1F1B)")
    if degrees["tp"] > 1 and par.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        # torch 2.13's stage_backward_input detaches the stage's outputs in place, and TP's
        # outputs are views (of the redistributed local shard): "Can't detach views in-place".
        raise ConfigError("parallelism.pipeline_parallel_schedule", par.pipeline_parallel_schedule,
                          f"splits backward into input and weight halves, and torch's input half detaches the "
                          f"stage's outputs in place, which fails on the views tensor parallelism "
                          f"(tp = {degrees['tp']}) returns", "use Interleaved1F1B or 1F1B with tensor parallelism")
    if cfg.compile.enable and par.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError("parallelism.pipeline_parallel_schedule", par.pipeline_parallel_schedule,
                          "splits backward into input and weight halves, which torch does not support for "
                          "compiled blocks", "set compile.enable = false, or use Interleaved1F1B / 1F1B")


def check_batch(training: Training, parallelism: Parallelism, degrees: dict[str, int]) -> None:
    if training.global_batch_size != -1:
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        step = training.local_batch_size * dp
        if training.global_batch_size % step:
            raise ConfigError(
                "training.global_batch_size", training.global_batch_size,
                f"must be a multiple of local_batch_size({training.local_batch_size}) * dp_replicate"
                f"({degrees['dp_replicate']}) * dp_shard({degrees['dp_shard']}) = {step}; "
                f"{training.global_batch_size} % {step} = {training.global_batch_size % step}",
                f"use a multiple of {step}, or -1 for exactly {step} (no gradient accumulation)",
            )


def memory_limit_gib(configured_gib: float, device: torch.device) -> tuple[float, str]:
    """Memory one rank may use, in GiB, and where the number comes from: `job.device_memory_gib`
    when set, else the CUDA device's, else this host's RAM shared by its ranks (torchrun's
    LOCAL_WORLD_SIZE)."""
    if configured_gib > 0:
        return configured_gib, "job.device_memory_gib"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB, "the GPU"
    ranks = launch_int("LOCAL_WORLD_SIZE", 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return ram / ranks, f"this host's {ram:.1f} GiB RAM over {ranks} rank(s)"


def check_memory_fits(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int], device: torch.device) -> None:
    """Refuse a run whose fullest rank needs more memory than it has (the planner's estimate): it
    would die in its first step otherwise, or take the whole machine down first.

    The message blames what takes the memory. Memory grows linearly in the batch (activations)
    and in LoRA's rank (the adapters, their gradients, optimizer state and activations): of those
    that fit at some smaller value, the one with the largest share is named with the largest value
    that fits (a rank of 100000 was blamed on training.local_batch_size); when neither fits even
    at 1, the model's state on this layout is (model.flavor: shard it wider, or a smaller model).
    The estimate's terms are shown."""
    limit, source = memory_limit_gib(cfg.job.device_memory_gib, device)
    terms = _memory(cfg, args, degrees)
    need = terms["total"]
    if need <= limit:
        return
    knobs = {"training.local_batch_size": lambda n: dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, local_batch_size=n, global_batch_size=-1))}
    if cfg.lora.enable:
        knobs["lora.rank"] = lambda n: dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=n))
    shares = {}  # key -> (its share of `need` in GiB, the largest value that fits with the rest as it is)
    for key, at in knobs.items():
        one, two = (_memory(at(n), args, degrees)["total"] for n in (1, 2))
        per, rest = two - one, 2 * one - two
        shares[key] = (per * key_value(cfg, key), math.floor((limit - rest) / per) if per > 0 else 0)
    shown = ", ".join(f"{name} {terms[name]:,.1f}" for name in ("params", "grads", "optimizer", "fsdp_buffers",
                                                                "activations") if terms[name] >= 0.05)
    problem = (f"the fullest rank needs an estimated {need:,.1f} GiB (seq_len {cfg.training.seq_len}; GiB: {shown}), "
               f"more than the {limit:,.1f} GiB it has ({source})")
    tail = "; set job.device_memory_gib to override the detected size"
    fitting = {key: share for key, share in shares.items() if share[1] >= 1}
    if not fitting:
        raise ConfigError("model.flavor", cfg.model.flavor, f"{problem}: it does not fit even at "
                          f"{' and '.join(f'{key} 1' for key in shares)}",
                          "shard the model over more ranks (data_parallel_shard_degree, tp, ep, pp), use a smaller "
                          f"model, or enable activation checkpointing{tail}")
    key = max(fitting, key=lambda k: fitting[k][0])
    share, fits = fitting[key]
    batch = key == "training.local_batch_size"
    what = "its activations" if batch else "the adapters (weights, gradients, optimizer state and activations)"
    more = "; shorten seq_len or enable activation checkpointing" if batch else ", or adapt fewer lora.targets"
    raise ConfigError(key, key_value(cfg, key), f"{problem}; {what} take {share:,.1f} GiB of it",
                      f"use {'local_batch_size' if batch else key} <= {fits}{more}{tail}")


def _memory(cfg: JobConfig, args: ModelArgs, degrees: dict[str, int]) -> dict[str, float]:
    """The planner's estimate of the fullest rank (`plan.memory.estimate_memory`), in GiB per term."""
    return estimate_memory(args, degrees, cfg.training, cfg.activation_checkpoint, cfg.parallelism,
                           compiled=cfg.compile.enable, lora=cfg.lora, optimizer_cfg=cfg.optimizer)
