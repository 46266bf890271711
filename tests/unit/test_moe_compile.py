"""torch.compile of whole blocks, dense and MoE: no graph breaks, the eager model's numbers.

The custom ops that make MoE blocks traceable (`torchmoe/nn/moe_ops.py`) are checked
with torch's own `opcheck` (schema, fake kernel, autograd registration, AOT dispatch), then a
2-layer tiny model (one dense, one MoE block) is compiled block by block as `apply_compile`
compiles it and compared with its eager twin: loss, every gradient and the routed-token counts.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from torchmoe.config.job_config import ActivationCheckpoint, Compile
from torchmoe.distributed.activation_checkpoint import apply_ac
from torchmoe.distributed.compile import DynamoCounts, apply_compile
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.moe_ops import accumulate_token_counts, grouped_mm, grouped_mm_weight_grad

ARGS = FLAVORS["tiny"].replace(n_layers=2)  # layer 0 dense, layer 1 MoE


def _grouped_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 12, 8, generator=g, requires_grad=True)  # rows of 16-byte multiples, as the kernel wants
    return x, w, torch.tensor([5, 5, 17], dtype=torch.int32)  # an empty group, rows past the last


def test_custom_ops_pass_torch_opcheck() -> None:
    x, w, _ = _grouped_inputs()
    offsets = torch.tensor([5, 5, 20], dtype=torch.int32)  # every row in a group: all outputs defined
    torch.library.opcheck(grouped_mm, (x, w, offsets))
    torch.library.opcheck(grouped_mm_weight_grad, (torch.randn(20, 12), x.detach(), offsets))
    torch.library.opcheck(accumulate_token_counts, (torch.zeros(4), torch.ones(4)))
    # Dims off the kernel's 16-byte rows (K = 10, N = 6; 30 and 20 in bf16): padded inside the op.
    for dtype, (k, n) in ((torch.float32, (10, 6)), (torch.bfloat16, (30, 20))):
        xo = torch.randn(20, k, dtype=dtype, requires_grad=True)
        wo = torch.randn(3, n, k, dtype=dtype, requires_grad=True)
        torch.library.opcheck(grouped_mm, (xo, wo, offsets))
        torch.library.opcheck(grouped_mm_weight_grad, (torch.randn(20, n, dtype=dtype), xo.detach(), offsets))


def test_grouped_mm_and_its_gradients_match_per_group_matmuls() -> None:
    x, w, offsets = _grouped_inputs()
    out = grouped_mm(x, w, offsets)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    start, ref = 0, []
    for e, end in enumerate(offsets.tolist()):
        ref.append(ref_x[start:end] @ ref_w[e].T)
        start = end
    ref = torch.cat(ref)
    ref.backward(grad[: len(ref)])
    torch.testing.assert_close(out[: len(ref)], ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad[: len(ref)], ref_x.grad[: len(ref)], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-6, atol=1e-6)
    assert w.grad[1].abs().sum() == 0  # the empty group gets no gradient


def _model(ac_mode: str, args=ARGS) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    apply_ac(model, ActivationCheckpoint(mode=ac_mode))
    return model


def _step(model: Transformer, tokens: torch.Tensor,
          real: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, gradients by name and the MoE layer's routed-token counts after one forward+backward
    (`real`: the mask of the data tokens, or None)."""
    loss = torch.nn.functional.cross_entropy(model(tokens, real=real).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p.grad
             for n, p in model.named_parameters()}
    return loss.detach(), grads, torch.stack([m.tokens_per_expert for m in model.moe_layers()])


# Inductor compiles the selective-AC model (its partitioner and code generation around the custom
# ops and SAC's policy); the others run under aot_eager (dynamo and AOT autograd without code
# generation: seconds instead of a minute). The distributed tier compiles FSDP, TP, EP and CP
# layouts with inductor.
# The padded case: a chat batch's mask of its data tokens (the second row's last 12 are padding),
# with the balance loss and z-loss over the data tokens on.
@pytest.mark.parametrize("ac_mode, backend, padded", [("selective", "inductor", False), ("none", "aot_eager", False),
                                                      ("full", "aot_eager", False), ("none", "aot_eager", True)])
def test_compiled_blocks_have_no_graph_break_and_match_eager(ac_mode: str, backend: str, padded: bool) -> None:
    torch._dynamo.reset()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    real = torch.arange(32) < torch.tensor([[32], [20]]) if padded else None
    args = ARGS.replace(aux_loss_coeff=0.01, z_loss_coeff=0.001) if padded else ARGS
    ref_loss, ref_grads, ref_counts = _step(_model(ac_mode, args), tokens, real)

    model = _model(ac_mode, args)
    apply_compile(model, Compile(enable=True, backend=backend), fullgraph=True)
    before = DynamoCounts.now()
    loss, grads, counts = _step(model, tokens, real)
    compiled = DynamoCounts.now().since(before)

    assert compiled == DynamoCounts(graphs=2, graph_breaks=0), dict(counters["graph_break"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # Counted once per forward: activation checkpointing's recomputation adds nothing.
    data = tokens.numel() if real is None else int(real.sum())
    assert torch.equal(counts, ref_counts) and counts.sum() == data * ARGS.top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "clamped"])
def test_experts_of_any_shape_compile_to_one_graph(kind: str, dtype: torch.dtype) -> None:
    """A folder's hidden size 20 under a model dim of 30 (neither a multiple of 8 bf16 elements;
    20 fp32 ones are 16-byte rows, 30 are not): the experts' forward and backward compile whole
    (the layout checks are shape guards, the padding runs inside the custom op) and give eager's
    bits (aot_eager runs the same kernels)."""
    from torchmoe.nn.experts import ClampedSwiGLUExperts, GroupedExperts

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        experts = (GroupedExperts(30, 20, 4, use_grouped_mm=True) if kind == "swiglu" else
                   ClampedSwiGLUExperts(30, 20, 4, use_grouped_mm=True, limit=0.7, alpha=1.702))
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.3)
        return experts.to(dtype)

    torch._dynamo.reset()
    x, counts = torch.randn(21, 30, generator=torch.Generator().manual_seed(1)).to(dtype), torch.tensor([5, 0, 7, 9])
    eager, compiled = build(), build()
    before = DynamoCounts.now()
    step = torch.compile(lambda m, x: m(x, counts).float().square().sum(), backend="aot_eager", fullgraph=True)
    step(compiled, x.clone().requires_grad_()).backward()
    assert DynamoCounts.now().since(before) == DynamoCounts(graphs=1, graph_breaks=0)
    eager(x.clone().requires_grad_(), counts).float().square().sum().backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
