"""Activation checkpointing's torchtitan knobs: the per-op policy's forced recomputation
(`per_op_sac_force_recompute_mm_shapes_by_fqns`) and `early_stop`.

    python -m pytest -q tests/unit/test_activation_checkpoint.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchmoe.config.job_config import ActivationCheckpoint
from torchmoe.distributed.activation_checkpoint import apply_ac, forced_recompute_shapes, op_sac_policy
from torchmoe.models.llama4 import FLAVORS, Transformer

ARGS = FLAVORS["tiny"]  # dim 128, 8 heads x 16, 4 kv heads, 8 experts, one shared expert of 256
WQ, WK_WV, WO, GATE = (128, 128), (128, 64), (128, 128), (128, 8)  # (in, out) of each matmul's weight
SHARED_W1_W3, SHARED_W2 = (128, 256), (256, 128)


def _model() -> Transformer:
    torch.manual_seed(0)  # for the inputs drawn after it
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    return model


def _saved_matmuls(fqns: list[str]) -> list[tuple[int, int]]:
    """Weight shapes of the matmuls the per-op policy saves in one forward of the tiny model's
    MoE block (layer 1), in order."""
    model = _model()
    block = model.layers["1"]
    policy = op_sac_policy(forced_recompute_shapes(block, "layers.1", fqns))
    saved = []

    def recording(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if func is torch.ops.aten.mm.default and decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            saved.append(tuple(args[1].shape))
        return decision

    x = torch.randn(1, 16, ARGS.dim, requires_grad=True)
    out = checkpoint(block, x, model._rotations(16), use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(recording))
    out.sum().backward()
    return saved


def test_every_second_matmul_is_saved():
    """wq, wk, wv, wo, router gate, shared w1, w3, w2: the 1st, 3rd, 5th and 7th are saved."""
    assert _saved_matmuls([]) == [WQ, WK_WV, GATE, SHARED_W1_W3]


def test_forced_router_gate_is_recomputed_and_not_counted():
    """torchtitan's default: the gate's matmul is never saved, and the alternation runs over the
    other seven, so the shared expert's w1 and w2 are saved instead of w3."""
    assert _saved_matmuls(["moe.router.gate"]) == [WQ, WK_WV, SHARED_W1_W3, SHARED_W2]


def test_forcing_is_by_weight_shape():
    """wk and wv have the same weight shape: naming one forces both (as in torchtitan)."""
    assert forced_recompute_shapes(_model().layers["1"], "layers.1", ["attention.wk"]) == {WK_WV}
    assert WK_WV not in _saved_matmuls(["attention.wk"])


def _loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("ac", [
    ActivationCheckpoint(mode="selective", per_op_sac_force_recompute_mm_shapes_by_fqns=["moe.router.gate"],
                         early_stop=False),
    ActivationCheckpoint(mode="full", early_stop=False),
])
def test_the_knobs_leave_loss_and_gradients_alone(ac):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(_model(), tokens)
    model = _model()
    apply_ac(model, ac)
    loss, grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("early_stop, forwards", [(True, 1), (False, 2)])
def test_early_stop_ends_the_recomputation(early_stop, forwards):
    """Under full AC the MoE layer's forward ends with additions that save nothing: early stop
    ends the recomputation before it, while without it the whole block runs again."""
    model = _model()
    apply_ac(model, ActivationCheckpoint(mode="full", early_stop=early_stop))
    calls = []
    model.layers["1"].moe.register_forward_hook(lambda module, args, out: calls.append(1))
    tokens = torch.randint(0, ARGS.vocab_size, (1, 17))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert len(calls) == forwards


def _adapted(dropout: float) -> Transformer:
    """`_model` with LoRA adapters on every target, B drawn off zero (so that every adapter's
    output, and with it its dropout mask, reaches the loss)."""
    from torchmoe.config.job_config import LoRA
    from torchmoe.models.decoder.lora import apply_lora, init_adapters

    model = Transformer(ARGS.replace(n_layers=2))  # a dense block, an MoE block
    model.init_weights(seed=0)
    apply_lora(model, LoRA(enable=True, targets=["attention", "shared_experts", "experts", "router"], rank=4,
                           alpha=8.0, dropout=dropout))
    init_adapters(model, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_b"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("ac", [ActivationCheckpoint(mode="full"), ActivationCheckpoint(mode="selective"),
                                ActivationCheckpoint(mode="selective", selective_ac_option="2")])
def test_recomputation_replays_the_adapters_dropout(ac):
    """LoRA's dropout (0.3 on every adapter's input) under activation checkpointing: the backward
    differentiates the masks the forward applied, so the loss and every gradient are the
    un-checkpointed model's under the same seed. Blocks were wrapped without preserve_rng_state:
    their recomputation drew other masks. (The masks are drawn: dropout 0 gives other gradients.)"""
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    reference, model = _adapted(0.3), _adapted(0.3)
    apply_ac(model, ac)
    torch.manual_seed(5)
    ref_loss, ref_grads = _loss_and_grads(reference, tokens)
    torch.manual_seed(5)
    loss, grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    _, undropped = _loss_and_grads(_adapted(0.0), tokens)
    assert any(w is not None and (w - u).abs().max() > 1e-4 for w, u in zip(ref_grads, undropped))
