"""The planner's LoRA (`plan.lora`, `plan.memory`): its adapter tensors are the ones
`apply_lora` adds (names and shapes), and the estimate's gradients and optimizer state equal what
one AdamW step measures on a debug flavor with the base frozen.

    python -m pytest -q tests/unit/test_lora_plan.py
"""

from __future__ import annotations

import math

import pytest
import torch

from torchmoe.arch.registry import FLAVORS
from torchmoe.config.job_config import ActivationCheckpoint, LoRA, Parallelism, Training
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.lora import is_adapter_name
from torchmoe.plan.dry_run import format_count
from torchmoe.plan.lora import adapter_specs
from torchmoe.plan.memory import memory_per_pp_rank
from torchmoe.plan.parallel_dims import ParallelDims

ALL_TARGETS = ["attention", "mlp", "shared_experts", "experts", "router"]


@pytest.mark.parametrize("family,flavor", [("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel")])
def test_adapter_specs_are_the_adapters_apply_lora_adds(family, flavor):
    args = FLAVORS[family][flavor]
    lora = LoRA(enable=True, targets=ALL_TARGETS, rank=4)
    with torch.device("meta"):
        model = Transformer(args)
    apply_lora(model, lora)
    built = {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter_name(n)}
    assert {s.fqn: s.shape for s in adapter_specs(args, lora)} == built
    assert adapter_specs(args, LoRA(enable=False)) == []


def test_the_estimate_holds_what_adamw_stores_for_the_adapters_alone():
    """One rank of the DeepSeek-V3 debug flavor, fp32: the estimate's gradient and optimizer bytes
    are the adapters' measured ones (AdamW's two moments; its step counters are scalars), its
    parameters the base's and the adapters'; without LoRA, every parameter's."""
    args = FLAVORS["deepseek_v3"]["debugmodel"]
    lora = LoRA(enable=True, targets=["attention", "experts", "router"], rank=8)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    apply_lora(model, lora)
    trainable = [p for n, p in model.named_parameters() if is_adapter_name(n)]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    moments = sum(t.nbytes for state in optimizer.state.values() for k, t in state.items() if k != "step")
    params = sum(p.nbytes for p in model.parameters())
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, world_size=1)
    training = Training(local_batch_size=1, seq_len=16)
    est = memory_per_pp_rank(args, dims, training, ActivationCheckpoint(), Parallelism(), lora=lora)[0]
    assert (est.grads, est.optimizer, est.params) == (grads, moments, params)
    full = memory_per_pp_rank(args, dims, training, ActivationCheckpoint(), Parallelism())[0]
    base = params - grads
    assert (full.grads, full.optimizer) == (base, 2 * base)


def test_the_dry_run_shows_what_freezing_the_base_saves(tmp_path, capsys):
    """`torchmoe train --dry-run` of a LoRA run on 2 FSDP ranks: dry_run.json's lora entry and
    the console line; the full fine-tuning total is the same job's without LoRA."""
    import json
    from pathlib import Path

    from torchmoe.commands import cli

    debug = str(Path(__file__).resolve().parents[2] / "configs" / "debug_model.toml")
    job = ["train", "--config", debug, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--dry-run",
           "--world-size", "2"]
    assert cli.main([*job, "--lora.enable", "true", "--job.dump_folder", str(tmp_path / "lora")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert cli.main([*job, "--job.dump_folder", str(tmp_path / "full")]) == 0
    lora = json.loads((tmp_path / "lora" / "dry_run.json").read_text())
    full = json.loads((tmp_path / "full" / "dry_run.json").read_text())
    assert full["lora"] is None
    assert lora["lora"]["full_fine_tuning_gib"] == full["memory_per_rank_gib"]["total"]
    assert lora["lora"]["saved_gib"] == pytest.approx(full["memory_per_rank_gib"]["total"]
                                                      - lora["memory_per_rank_gib"]["total"], rel=1e-9)
    assert lora["lora"]["saved_gib"] > 0
    assert lora["lora"]["adapter_params"] == sum(
        math.prod(s.shape) for s in adapter_specs(FLAVORS["deepseek_v3"]["debugmodel"], LoRA(enable=True)))
    assert (f"LoRA: {format_count(lora['lora']['adapter_params'])} adapter parameters train; the frozen base has no "
            f"gradients and no optimizer state: {lora['lora']['saved_gib']:.2f} GiB less per rank") in out, out
