"""LoRA on the decoder: adapters on every target (MLA attention, dense MLP, shared and routed
experts, router) leave the model as it was at init, train alone, merge into the weights, and the
routed experts' grouped adapters equal a per-expert loop; the lora section's validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from torchmoe.arch.deepseek_v3 import FLAVORS as DEEPSEEK
from torchmoe.arch.gpt_oss import FLAVORS as GPT_OSS
from torchmoe.config import JobConfig, validate_sections
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import LoRA
from torchmoe.models.decoder.lora import apply_lora, init_adapters, merged_state_dict
from torchmoe.models.decoder.model import Transformer
from torchmoe.nn.experts import ClampedSwiGLUExperts, GroupedExperts
from torchmoe.nn.lora import add_expert_adapters, is_adapter_name, trainable_parameters

ALL_TARGETS = ["attention", "mlp", "shared_experts", "experts", "router"]
# DeepSeek-V3's test flavor holds every target: MLA attention, a dense first layer, shared experts.
ARGS = dataclasses.replace(DEEPSEEK["tiny"], n_layers=2, moe_layers=[1], vocab_size=96)


def _model(targets=ALL_TARGETS, rank: int = 4, alpha: float = 8.0) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    apply_lora(model, LoRA(enable=True, targets=targets, rank=rank, alpha=alpha))
    return model


def _randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_name(name):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def _tokens(seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(2))


def test_every_target_is_adapted_and_the_base_is_frozen():
    model = _model()
    adapters = sorted(n for n, p in trainable_parameters(model))
    assert all(is_adapter_name(n) for n in adapters)
    assert not any(is_adapter_name(n) for n, p in model.named_parameters() if not p.requires_grad)
    owners = sorted({n.rsplit(".", 1)[0] for n in adapters})
    assert owners == [
        "layers.0.attention.wkv_a", "layers.0.attention.wkv_b", "layers.0.attention.wo", "layers.0.attention.wq_a",
        "layers.0.attention.wq_b", "layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
        "layers.0.feed_forward.w3",
        "layers.1.attention.wkv_a", "layers.1.attention.wkv_b", "layers.1.attention.wo", "layers.1.attention.wq_a",
        "layers.1.attention.wq_b", "layers.1.moe.experts", "layers.1.moe.router.gate",
        "layers.1.moe.shared_experts.w1", "layers.1.moe.shared_experts.w2", "layers.1.moe.shared_experts.w3"]
    experts = model.layers["1"].moe.experts
    e, hidden, dim = ARGS.num_experts, ARGS.moe_hidden_dim, ARGS.dim
    assert experts.lora_w13_a.shape == (e, 4, dim) and experts.lora_w13_b.shape == (e, 2 * hidden, 4)
    assert experts.lora_w2_a.shape == (e, 4, hidden) and experts.lora_w2_b.shape == (e, dim, 4)
    assert experts.lora_scaling == 2.0


def test_multi_token_prediction_modules_stay_frozen_and_their_block_unadapted():
    """With DeepSeek-V3's MTP module (its block is the model's layers.2) every target adapts the
    main decoder's layers alone: Hugging Face's causal LM, which PEFT adapts, has no MTP layer."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(ARGS, mtp_layers=1))
    apply_lora(model, LoRA(enable=True, targets=ALL_TARGETS, rank=4, alpha=8.0))
    trained = [n for n, _ in trainable_parameters(model)]
    assert trained and all(n.startswith(("layers.0.", "layers.1.")) for n in trained), trained
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith(("layers.2.", "mtp.")))


@pytest.mark.parametrize("set_to,trains", [(-1.0, None), (0.0, None), (0.002, 0.002)])
def test_lora_leaves_the_expert_bias_to_the_base_unless_it_is_set(set_to, trains):
    """model.load_balance_coeff under LoRA: -1 (the family's default, 0.001 for DeepSeek-V3 and
    Llama 4 in full fine-tuning) and 0 train no bias; a rate set trains it."""
    from torchmoe.arch.registry import model_args_from_config
    from torchmoe.config.job_config import Model

    for name in ("deepseek_v3", "llama4"):
        cfg = Model(name=name, flavor="tiny", load_balance_coeff=set_to)
        assert model_args_from_config(cfg, lora=True).load_balance_coeff == trains
        assert model_args_from_config(cfg).load_balance_coeff == (0.001 if set_to < 0 else trains)


def test_init_is_pefts_and_leaves_the_forward_as_the_base():
    """B = 0: the adapted model computes its base model's logits bit for bit; A is uniform in
    ±1/sqrt(in) (PEFT's kaiming_uniform_(a=sqrt(5))), drawn by init_weights and init_adapters alike."""
    torch.manual_seed(0)
    base = Transformer(ARGS)
    base.init_weights(seed=0)
    tokens = _tokens()
    with torch.no_grad():
        ref = base(tokens)
    model = _model()
    model.init_weights(seed=0)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref)
    drawn = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_name(n)}
    init_adapters(model, seed=0)
    for name, p in model.named_parameters():
        if not is_adapter_name(name):
            continue
        assert torch.equal(p, drawn[name])
        if name.endswith("_b"):
            assert not p.any()
        else:
            bound = 1 / math.sqrt(p.shape[-1])
            assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound and p.std() > 0.5 * bound / math.sqrt(3)


def test_only_adapters_get_gradients():
    model = _model()
    _randomize_adapters(model)
    model(_tokens()).square().mean().backward()
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_merged_weights_compute_the_adapted_model():
    """W + scaling * B @ A (per expert; the fused gate/up adapter split into w1 and w3) in a model
    without adapters gives the adapted model's logits."""
    model = _model()
    _randomize_adapters(model)
    tokens = _tokens()
    with torch.no_grad():
        adapted = model(tokens)
        plain = Transformer(ARGS)
        plain.load_state_dict({n: t for n, t in model.state_dict().items() if not is_adapter_name(n)})
        base = plain(tokens)
        plain.load_state_dict(merged_state_dict(model))
        merged = plain(tokens)
    assert (adapted - merged).abs().max() <= 1e-5 * adapted.abs().max()
    assert (adapted - base).abs().max() > 0.1 * adapted.abs().max()  # the adapters matter


def _routed(num_experts: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 5, 1, 4, 2, 0, 6][:num_experts])
    return torch.randn(int(counts.sum()) + 2, dim, generator=generator), counts  # 2 rows past the last block


def _masks(seed: int, p: float, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Dropout masks drawn as torch's dropout draws them from the seeded global RNG, in order:
    ``dropout(ones)`` (0 or 1 / (1 - p)) of each shape; all ones for p = 0."""
    torch.manual_seed(seed)
    return [torch.nn.functional.dropout(torch.ones(shape), p) for shape in shapes]


@pytest.mark.parametrize("dropout", [0.0, 0.4])
@pytest.mark.parametrize("style", ["swiglu", "clamped_swiglu"])
def test_grouped_expert_adapters_equal_a_per_expert_loop(style, dropout):
    """The grouped GEMMs' outputs, input gradient and adapter gradients equal a per-expert Python
    loop over ``x @ W_e.T + scaling * B_e A_e dropout(x)`` (the fused gate/up adapter's rows split
    into w1 and w3): dropout on each adapter's input only (the routed rows for w13, the hidden
    activation for w2), never on the experts' own path, one mask entry per routed copy, the
    masks fixed here and drawn as torch's dropout draws them from the seeded RNG."""
    torch.manual_seed(0)
    dim, hidden, e, rank = 16, 8, 8, 4
    scaling = 6.0 / rank
    if style == "swiglu":
        experts = GroupedExperts(dim, hidden, e, use_grouped_mm=True)
    else:
        experts = ClampedSwiGLUExperts(dim, hidden, e, use_grouped_mm=True, limit=0.7, alpha=1.702)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    add_expert_adapters(experts, experts.lora_shapes(), rank, alpha=6.0, dropout=dropout)
    for name, p in experts.named_parameters():
        if is_adapter_name(name):
            torch.nn.init.normal_(p, std=0.3)
    x, counts = _routed(e, dim, seed=1)
    x.requires_grad_()
    torch.manual_seed(7)
    out = experts(x, counts)
    valid = int(counts.sum())
    out[:valid].square().sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters() if is_adapter_name(n)}

    mask13, mask2 = _masks(7, dropout, tuple(x.shape), (x.shape[0], hidden))
    ref_x = x.detach().clone().requires_grad_()
    ref_params = {n: p.detach().clone().requires_grad_(is_adapter_name(n)) for n, p in experts.named_parameters()}
    rows, start = [], 0
    for i, n in enumerate(counts.tolist()):
        xe, m13, m2 = ref_x[start:start + n], mask13[start:start + n], mask2[start:start + n]
        start += n
        a13, b13 = ref_params["lora_w13_a"][i], ref_params["lora_w13_b"][i]
        a2, b2 = ref_params["lora_w2_a"][i], ref_params["lora_w2_b"][i]
        delta13 = scaling * (xe * m13) @ a13.T @ b13.T  # scaling = 6 / 4
        if style == "swiglu":
            h = torch.nn.functional.silu(xe @ ref_params["w1"][i].T + delta13[:, :hidden]) * (
                xe @ ref_params["w3"][i].T + delta13[:, hidden:])
            rows.append(h @ ref_params["w2"][i].T + scaling * (h * m2) @ a2.T @ b2.T)
        else:
            h = xe @ ref_params["w13"][i].T + ref_params["b13"][i] + delta13
            gate, up = h[:, 0::2].clamp(max=0.7), h[:, 1::2].clamp(-0.7, 0.7)
            act = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            rows.append(act @ ref_params["w2"][i].T + ref_params["b2"][i] + scaling * (act * m2) @ a2.T @ b2.T)
    ref = torch.cat(rows)
    ref.square().sum().backward()

    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        # Masks scale kept entries by 1 / (1 - p): gradients reach 4e3 here, and their fp32 sums
        # (grouped GEMM against loop) differ in the last bits of the largest; with dropout, within
        # 1e-5 of each tensor's largest value (observed 5e-7).
        scale = 1.0 if dropout == 0 else float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=what)

    close(out[:valid], ref, "out")
    close(x.grad[:valid], ref_x.grad[:valid], "x.grad")
    for name, grad in grads.items():
        close(grad, ref_params[name].grad, name)
    assert dropout == 0 or (mask13 == 0).any() and (mask2 == 0).any()


def test_linear_adapter_dropout_is_on_its_input_only_and_off_in_eval():
    """A linear adapter computes ``W x + b + scaling * B A dropout(x)`` (PEFT's lora_dropout): in
    training, the output and the gradients of x, A and B are those of a fixed mask on the
    adapter's input (the base path undropped); in eval the adapter sees x itself, and nothing is
    drawn from the RNG."""
    from torchmoe.nn.lora import add_linear_adapter

    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 10)
    add_linear_adapter(linear, rank=3, alpha=6.0, dropout=0.4)
    with torch.no_grad():
        linear.lora_a.normal_(0, 0.3), linear.lora_b.normal_(0, 0.3)
    x = torch.randn(5, 12, requires_grad=True)
    torch.manual_seed(7)
    y = linear(x)
    y.square().sum().backward()

    (mask,) = _masks(7, 0.4, tuple(x.shape))
    params = {n: p.detach().clone().requires_grad_() for n, p in linear.named_parameters()}
    ref_x = x.detach().clone().requires_grad_()

    def reference(m: torch.Tensor) -> torch.Tensor:
        return ref_x @ params["weight"].T + params["bias"] + 2.0 * (ref_x * m) @ params["lora_a"].T @ params["lora_b"].T

    ref = reference(mask)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-6)
    for name in ("lora_a", "lora_b"):
        torch.testing.assert_close(getattr(linear, name).grad, params[name].grad, rtol=1e-6, atol=1e-6)
    assert (mask == 0).any()
    linear.eval()
    state = torch.get_rng_state()
    with torch.no_grad():
        torch.testing.assert_close(linear(x), reference(torch.ones_like(mask)), rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("style", ["swiglu", "clamped_swiglu"])
def test_expert_adapters_draw_no_dropout_in_eval(style):
    """In eval the routed experts' adapters see their inputs undropped: the output of dropout
    0.4 is the output of dropout 0, and nothing is drawn from the RNG."""
    outputs = []
    for dropout in (0.4, 0.0):
        torch.manual_seed(0)
        experts = (GroupedExperts(16, 8, 8, use_grouped_mm=True) if style == "swiglu" else
                   ClampedSwiGLUExperts(16, 8, 8, use_grouped_mm=True, limit=0.7, alpha=1.702))
        add_expert_adapters(experts, experts.lora_shapes(), 4, alpha=6.0, dropout=dropout)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.3)
        x, counts = _routed(8, 16, seed=1)
        state = torch.get_rng_state()
        with torch.no_grad():
            outputs.append(experts.eval()(x, counts)[:int(counts.sum())])
        assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(*outputs)


def _adapted_experts_run(style: str, rank: int, grouped: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """The routed rows' output and every adapter gradient of seeded experts with rank-`rank`
    adapters, on the grouped GEMMs or the per-expert loop."""
    torch.manual_seed(0)
    if style == "swiglu":
        experts = GroupedExperts(16, 8, 8, use_grouped_mm=grouped)
    else:
        experts = ClampedSwiGLUExperts(16, 8, 8, use_grouped_mm=grouped, limit=0.7, alpha=1.702)
    add_expert_adapters(experts, experts.lora_shapes(), rank, alpha=6.0, dropout=0.0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    experts.to(dtype)
    x, counts = _routed(8, 16, seed=1)
    out = experts(x.to(dtype), counts)[:int(counts.sum())]
    out.float().square().sum().backward()
    return [out, *(p.grad for name, p in sorted(experts.named_parameters()) if is_adapter_name(name))]


@pytest.mark.parametrize(("rank", "dtype"), [(1, torch.float32), (3, torch.float32), (5, torch.float32),
                                             (2, torch.bfloat16), (4, torch.bfloat16), (6, torch.bfloat16)])
@pytest.mark.parametrize("style", ["swiglu", "clamped_swiglu"])
def test_a_rank_off_the_grouped_gemms_16_byte_rows_is_padded_exactly(style, rank, dtype):
    """The grouped GEMM reads rows on 16-byte strides: an adapter of rank 3 in fp32 (12-byte
    rows) or 4 in bf16 (8 bytes) crashed it. Padded with zeros, its output and gradients are the
    per-expert loop's: bit for bit in fp32; in bf16 within bf16's rounding (the grouped kernel
    accumulates in fp32, the loop's matmuls round each product)."""
    grouped = _adapted_experts_run(style, rank, True, dtype)
    loop = _adapted_experts_run(style, rank, False, dtype)
    assert len(grouped) == 5
    for got, want in zip(grouped, loop):
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))


def test_gpt_oss_experts_adapt_the_interleaved_gate_up_rows():
    """gpt-oss's w13 holds gate and up rows interleaved: its adapter's B covers all of them."""
    args = GPT_OSS["tiny"]
    model = Transformer(args)
    apply_lora(model, LoRA(enable=True, targets=["experts"], rank=2, alpha=2.0))
    experts = model.layers["0"].moe.experts
    assert experts.lora_w13_b.shape == (args.num_experts, 2 * args.moe_hidden_dim, 2)
    assert experts.lora_w2_a.shape == (args.num_experts, 2, args.moe_hidden_dim)



def test_compiled_adapted_blocks_have_no_graph_break_and_match_eager():
    """Every block compiled whole (fullgraph, aot_eager: dynamo and AOT autograd, no code
    generation) with its adapters' hooks and grouped GEMMs: no graph break, eager's loss and
    adapter gradients."""
    from torch._dynamo.utils import counters

    from torchmoe.config.job_config import Compile
    from torchmoe.distributed.compile import DynamoCounts, apply_compile

    torch._dynamo.reset()
    tokens = _tokens()

    def step(model):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach(), {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()
                               if p.grad is not None}

    eager = _model()
    _randomize_adapters(eager)
    ref_loss, ref_grads = step(eager)
    model = _model()
    _randomize_adapters(model)
    apply_compile(model, Compile(enable=True, backend="aot_eager"), fullgraph=True)
    before = DynamoCounts.now()
    loss, grads = step(model)
    assert DynamoCounts.now().since(before) == DynamoCounts(graphs=2, graph_breaks=0), dict(counters["graph_break"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert grads.keys() == ref_grads.keys() and all(is_adapter_name(n) for n in grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_float8_keeps_adapted_linears_and_runs_expert_adapters_in_high_precision():
    """The float8 linear swap (which would drop a linear's adapters) leaves adapted linears as
    they are; float8 routed experts run only their own three GEMMs in float8, the adapters' in
    high precision (a stand-in for torchao's kernel computes the same product here)."""
    pytest.importorskip("torchao.float8")
    from torchmoe.config.job_config import Float8
    from torchmoe.distributed.float8 import convert_float8_linears

    model = _model(targets=["attention", "experts"])
    _randomize_adapters(model)
    converted = convert_float8_linears(model, Float8(enable=True, emulate=True))
    assert converted == ["layers.0.feed_forward.w1", "layers.0.feed_forward.w2", "layers.0.feed_forward.w3",
                         "layers.1.moe.shared_experts.w1", "layers.1.moe.shared_experts.w2",
                         "layers.1.moe.shared_experts.w3"]
    assert type(model.layers["0"].attention.wq_a) is torch.nn.Linear and model.layers["0"].attention.wq_a.lora_a.numel()
    experts = model.layers["1"].moe.experts
    x, counts = _routed(ARGS.num_experts, ARGS.dim, seed=3)
    with torch.no_grad():
        reference = experts(x, counts)
        calls = []

        def float8_stand_in(rows, w, offsets):
            calls.append(tuple(w.shape))
            return experts._high_precision_mm(rows, w, counts, offsets)

        experts.float8_grouped_mm = float8_stand_in
        got = experts(x, counts)
    e, hidden, dim = ARGS.num_experts, ARGS.moe_hidden_dim, ARGS.dim
    assert calls == [(e, hidden, dim), (e, hidden, dim), (e, dim, hidden)]  # w1, w3, w2: not the adapters
    assert torch.equal(got[:int(counts.sum())], reference[:int(counts.sum())])

# ---- the lora section ---------------------------------------------------------------------------

def _error(**lora) -> str:
    cfg = JobConfig()
    cfg.lora = LoRA(enable=True, **lora)
    with pytest.raises(ConfigError) as e:
        validate_sections(cfg)
    return str(e.value)


def test_lora_section_refuses_bad_values():
    assert _error(targets=["experts", "atention"]) == (
        'lora.targets = "atention": not an allowed value\n  fix: did you mean "attention"? Allowed: "attention", '
        '"mlp", "shared_experts", "experts", "router"')
    assert _error(targets=[]).startswith("lora.targets = []: names nothing to adapt")
    assert _error(targets=["mlp", "mlp"]) == ('lora.targets = ["mlp", "mlp"]: names a target twice\n'
                                              "  fix: list each target once")
    assert _error(rank=0) == "lora.rank = 0: must be an integer >= 1\n  fix: set a rank such as 16"
    assert _error(alpha=0.0).startswith("lora.alpha = 0.0: must be a finite number > 0")
    assert _error(dropout=1.0).startswith("lora.dropout = 1.0: must lie in [0, 1)")
    assert _error(export="peft").startswith('lora.export = "peft": not an allowed value')
    assert _error(dropout=0.1, targets=["attention", "experts"]) == (
        "lora.dropout = 0.1: PEFT's adapters on experts (target_parameters) take no dropout, so the adapter "
        'export could not say how they trained\n  fix: set lora.dropout = 0, or lora.export = "merged"')
    cfg = JobConfig()
    cfg.lora = LoRA(enable=True, dropout=0.1, targets=["attention", "experts"], export="merged")
    validate_sections(cfg)
    cfg.parallelism.tensor_parallel_degree = 2  # adapters follow their weights' TP styles
    validate_sections(cfg)


def test_preflight_refuses_what_a_lora_run_cannot_do():
    """The dry run refuses an adapter export of a family without a PEFT mapping (Llama 4, the
    debug config's), or of a target PEFT cannot hold (DeepSeek-V3's shared experts), before training;
    the merged export of either passes."""
    from pathlib import Path

    from torchmoe.config import load_job_config
    from torchmoe.preflight import validate_job_config

    debug = str(Path(__file__).resolve().parents[2] / "configs" / "debug_model.toml")
    cfg = load_job_config(["--config", debug, "--lora.enable", "true"])
    with pytest.raises(ConfigError) as e:
        validate_job_config(cfg, 1, check_device=False)
    assert str(e.value) == ('lora.export = "adapter": torchmoe has no PEFT mapping for Llama 4\n  fix: set '
                            'lora.export = "merged" (the model with each adapter folded into its weight)')
    cfg.lora.export = "merged"
    validate_job_config(cfg, 1, check_device=False)
    cfg = load_job_config(["--config", debug, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
                           "--lora.enable", "true", "--lora.targets", "attention,shared_experts"])
    with pytest.raises(ConfigError) as e:
        validate_job_config(cfg, 1, check_device=False)
    assert str(e.value).startswith('lora.export = "adapter": ') and "shared_experts" in str(e.value), e.value
    assert str(e.value).endswith('fix: set lora.export = "merged" (the model with each adapter folded into its weight)')
    cfg.lora.export = "merged"
    validate_job_config(cfg, 1, check_device=False)
