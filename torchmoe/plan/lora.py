"""LoRA's adapters as the planner counts them (torch-free): one `ParamSpec` per adapter tensor,
named and shaped as `models.decoder.lora.apply_lora` adds them, so the memory estimate holds
gradients and optimizer state for these alone (the frozen base has none).

    specs = adapter_specs(args, cfg.lora)   # [] without lora.enable

A linear of (out, in) gets ``lora_a (r, in)`` and ``lora_b (out, r)``; the routed experts get
one pair per projection, ``lora_<proj>_a (E, r, in)`` and ``lora_<proj>_b (E, out, r)``, w13
being the gate and up rows together. The multi-token prediction blocks get none.
"""

from __future__ import annotations

from torchmoe.arch.model_args import ModelArgs
from torchmoe.config.job_config import LoRA
from torchmoe.plan.layout import ParamSpec, param_specs

# target -> the base weights it adapts, by the part of their name after "layers.<i>."
_LINEAR_TARGETS = {"attention": "attention.", "mlp": "feed_forward.", "shared_experts": "moe.shared_experts.",
                   "router": "moe.router.gate."}


def adapter_specs(args: ModelArgs, lora: LoRA) -> list[ParamSpec]:
    """Every adapter tensor `lora` adds to ``Transformer(args)`` (none when off): the linears', then the experts'."""
    if not lora.enable:
        return []
    r, specs = lora.rank, []
    prefixes = tuple(_LINEAR_TARGETS[t] for t in lora.targets if t in _LINEAR_TARGETS)
    for base in param_specs(args):
        if base.layer is None or base.layer >= args.n_layers or not base.fqn.endswith(".weight"):
            continue
        local = base.fqn.split(".", 2)[2]  # after "layers.<i>."
        if len(base.shape) == 2 and local.startswith(prefixes):
            module = base.fqn[:-len(".weight")]
            out, n_in = base.shape
            specs += [ParamSpec(f"{module}.lora_a", (r, n_in), None, base.kind, base.layer),
                      ParamSpec(f"{module}.lora_b", (out, r), None, base.kind, base.layer)]
    if "experts" in lora.targets:
        for i in sorted(args.moe_layer_ids):
            if i >= args.n_layers:
                continue
            e, d, h, p = args.num_experts, args.dim, args.moe_hidden_dim, f"layers.{i}.moe.experts"
            for proj, out, n_in in (("w13", 2 * h, d), ("w2", d, h)):
                specs += [ParamSpec(f"{p}.lora_{proj}_a", (e, r, n_in), None, "expert", i),
                          ParamSpec(f"{p}.lora_{proj}_b", (e, out, r), None, "expert", i)]
    return specs
