"""Float8 on CPU: which TP styles run (the seed's rule), the bytes TP all-gathers move (measured
against the dry run's count), float8 routed experts' grouped GEMM call, and every refusal.

Float8 matmuls run emulated here (`float8.emulate`); gloo cannot carry float8 tensors, so the TP
runs use a fake process group: collectives move nothing, and what they would move is counted.

    python -m pytest -q tests/unit/test_float8.py
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import DEBUG_CONFIG
from torchmoe.arch.registry import model_args_from_config
from torchmoe.config.errors import ConfigError
from torchmoe.config.loader import load_job_config
from torchmoe.distributed.activation_checkpoint import apply_ac
from torchmoe.distributed.float8 import convert_float8_experts, convert_float8_linears
from torchmoe.distributed.mesh import build_mesh
from torchmoe.models.decoder.tensor_parallel import apply_tp
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.experts import GroupedExperts
from torchmoe.nn.moe_ops import grouped_mm
from torchmoe.plan.float8 import float8_tp_enabled
from torchmoe.plan.parallel_dims import ParallelDims
from torchmoe.plan.pipeline import pipeline_layout
from torchmoe.plan.tp_comm import tp_gather_bytes
from torchmoe.preflight import validate_job_config

ao_tp = pytest.importorskip("torchao.float8.float8_tensor_parallel")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

FLOAT8_STYLES = (ao_tp.Float8ColwiseParallel, ao_tp.Float8RowwiseParallel, ao_tp.PrepareFloat8ModuleInput)
SEQ, ROWS = 32, 2


def _cfg(*flags: str):
    """The debug job with `flags`, float8 linears emulated where they are on (emulate is no flag without them)."""
    emulate = ["--float8.emulate", "true"] if "--float8.enable" in flags else []
    return load_job_config(["--config", DEBUG_CONFIG, *emulate, "--training.seq_len", str(SEQ),
                            "--training.local_batch_size", str(ROWS), *flags])


def _tp_model(fake_world, cfg, tp: int, *, device: str = "meta"):
    """The config's model (its family's tiny flavor), float8-converted per `cfg`, tensor-parallel
    over a fake world of `tp` ranks (this process rank 0); returns (model, TP plan, dims)."""
    dims = ParallelDims.from_config(cfg.parallelism, tp)
    fake_world(0, tp)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(model_args_from_config(cfg.model))
    if cfg.float8.enable:
        convert_float8_linears(model, cfg.float8)
    plan = apply_tp(model, mesh["tp"], loss_parallel=not cfg.parallelism.disable_loss_parallel,
                    moe_tp=dims.moe_tp_enabled, float8=float8_tp_enabled(cfg.float8))
    return model, plan, dims


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_tp_uses_float8_styles_exactly_for_the_tensorwise_recipe(fake_world, recipe):
    """The seed's rule: float8 styles when float8 is on and the recipe is not rowwise; then every
    converted linear has a float8 style and the attention / dense-FFN input is prepared in float8.
    Parameters keep their TP placements either way."""
    cfg = _cfg("--float8.enable", "true", "--float8.recipe_name", recipe, "--parallelism.tensor_parallel_degree", "2")
    model, plan, _ = _tp_model(fake_world, cfg, 2)
    float8 = recipe == "tensorwise"
    assert float8_tp_enabled(cfg.float8) == float8
    linear_styles = {fqn: style for fqn, style in plan.items() if isinstance(model.get_submodule(fqn), Float8Linear)}
    # wq wk wv wo of 4 blocks; w1 w2 w3 of 2 dense FFNs and 2 shared experts.
    assert len(linear_styles) == 4 * 4 + 4 * 3
    for fqn, style in linear_styles.items():
        rowwise = fqn.endswith(("wo", "w2"))
        want = (ao_tp.Float8RowwiseParallel if rowwise else ao_tp.Float8ColwiseParallel) if float8 else \
            (RowwiseParallel if rowwise else ColwiseParallel)
        assert type(style) is want, fqn
        weight = model.get_submodule(fqn).weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(1 if rowwise else 0),), fqn
    for layer in range(4):
        block = "feed_forward" if layer % 2 == 0 else None  # tiny: layers 1 and 3 are MoE
        for fqn in (f"layers.{layer}.attention", *([f"layers.{layer}.{block}"] if block else [])):
            assert type(plan[fqn]) is (ao_tp.PrepareFloat8ModuleInput if float8 else PrepareModuleInput), fqn
    # What stays in high precision: the router gate, the head, and the MoE input.
    for fqn in ("output", "layers.1.moe.router.gate"):
        assert not isinstance(model.get_submodule(fqn), Float8Linear)
        assert not isinstance(plan[fqn], FLOAT8_STYLES), fqn


def test_float8_tp_keeps_plain_styles_where_a_linear_is_not_float8(fake_world):
    """wk kept out of float8 (filter_fqns): wk gets the plain style, and the attention input,
    which wk reads too, is gathered in high precision; wq, wv and the FFN stay float8."""
    cfg = _cfg("--float8.enable", "true", "--float8.filter_fqns", "output", "router", "wk",
               "--parallelism.tensor_parallel_degree", "2")
    _, plan, _ = _tp_model(fake_world, cfg, 2)
    assert type(plan["layers.0.attention.wk"]) is ColwiseParallel
    assert type(plan["layers.0.attention.wq"]) is ao_tp.Float8ColwiseParallel
    assert type(plan["layers.0.attention"]) is PrepareModuleInput
    assert type(plan["layers.0.feed_forward"]) is ao_tp.PrepareFloat8ModuleInput


def test_plain_tp_without_float8_has_no_float8_style(fake_world):
    _, plan, _ = _tp_model(fake_world, _cfg("--parallelism.tensor_parallel_degree", "2"), 2)
    assert not any(isinstance(style, FLOAT8_STYLES) for style in plan.values())


class _AllGatherBytes(TorchDispatchMode):
    """Bytes this rank would receive from functional all-gathers: (group size - 1) x its input,
    float8 tensors (torchao's subclass, whose `_data` holds the float8 payload) at 1 byte."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0
        self.element_bytes: Counter[int] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            tensor, group_size = args[0], args[1]
            item = tensor._data.element_size() if hasattr(tensor, "_data") else tensor.element_size()
            self.received += tensor.numel() * item * (group_size - 1)
            self.element_bytes[item] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tp, flags", [
    (2, ["--float8.enable", "true"]),
    (4, ["--float8.enable", "true", "--activation_checkpoint.mode", "full"]),
    (2, ["--float8.enable", "true", "--activation_checkpoint.mode", "selective"]),
    (2, ["--float8.enable", "true", "--float8.recipe_name", "rowwise", "--parallelism.disable_loss_parallel", "true"]),
    (2, []),
    # DeepSeek-V3: latent attention's input gathered in high precision (replicated readers), its
    # replicated wq_a a float8 linear all the same.
    (2, ["--float8.enable", "true", "--model.name", "deepseek_v3"]),
    (2, ["--model.name", "deepseek_v3", "--activation_checkpoint.mode", "full"]),
])
def test_tp_all_gathers_move_what_the_dry_run_counts(fake_world, tp, flags):
    """A real forward and backward of the float8 (emulated) TP model: the bytes its all-gathers
    receive equal `tp_gather_bytes`, the dry run's figure; with tensorwise TP both 1-byte and
    4-byte gathers run, and the plain-style figure is what rowwise / no float8 move."""
    cfg = _cfg("--parallelism.tensor_parallel_degree", str(tp), *flags)
    model, _, dims = _tp_model(fake_world, cfg, tp)
    apply_ac(model, cfg.activation_checkpoint)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).normal_(0, 0.02)
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    counted = _AllGatherBytes()
    with counted:
        model(tokens).float().sum().backward()
    args = model_args_from_config(cfg.model)
    planned = tp_gather_bytes(cfg, dims, args, pipeline_layout(args, dims, cfg.parallelism, SEQ))
    assert counted.received == planned.total > 0
    if float8_tp_enabled(cfg.float8):
        assert set(counted.element_bytes) == {1, 4} and planned.total < planned.high_precision
    else:
        assert set(counted.element_bytes) == {4} and planned.total == planned.high_precision


def test_float8_experts_run_the_grouped_gemm_on_aligned_blocks(monkeypatch):
    """convert_float8_experts switches exactly the routed experts `moe_fqns` names; their grouped
    GEMMs then get 16-row expert blocks, int32 block ends and per-expert column-major (E, K, N)
    operands (torchao's contract), even on CPU. The float8 kernel itself is CUDA-only, so a
    stand-in computes the same product: the MoE output equals the unconverted model's."""
    import torchmoe.distributed.float8 as float8

    calls = []

    def grouped_mm(rows, b_t, offsets, *, out_dtype, pad_token_groups_for_grouped_mm):
        E, K, N = b_t.shape
        assert b_t.stride() == (K * N, 1, K) and rows.is_contiguous() and offsets.dtype == torch.int32
        assert not pad_token_groups_for_grouped_mm and out_dtype == torch.bfloat16
        calls.append(offsets.tolist())
        return torch._grouped_mm(rows, b_t, offs=offsets)

    monkeypatch.setattr(float8, "_torchao_grouped_mm", lambda: grouped_mm)
    torch.manual_seed(0)
    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=0)
    model.init_buffers("cpu")
    assert convert_float8_experts(model, ["layers.3.moe.experts"]) == ["layers.3.moe.experts"]
    assert model.layers["1"].moe.experts.float8_grouped_mm is None
    assert convert_float8_experts(model, ["experts"]) == ["layers.1.moe.experts", "layers.3.moe.experts"]
    x = torch.randn(2, 40, 128)
    got = model.layers["1"].moe(x)
    model.layers["1"].moe.experts.float8_grouped_mm = None
    reference = model.layers["1"].moe(x)
    assert len(calls) == 3  # w1, w3, w2
    ends = calls[0]
    assert all(end % 16 == 0 for end in ends) and ends[-1] > 80  # 80 routed rows, padded per expert
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)


def test_unconverted_experts_keep_the_high_precision_grouped_gemm():
    """Without conversion the hook is unset and the grouped path equals the per-expert loop; set,
    it carries every projection (w1, w3, w2) and its result is what the experts return."""
    experts = GroupedExperts(16, 16, 2, use_grouped_mm=True)
    looped = GroupedExperts(16, 16, 2, use_grouped_mm=False)
    assert experts.float8_grouped_mm is None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=generator)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(experts, name).copy_(torch.randn(2, 16, 16, generator=generator))
            getattr(looped, name).copy_(getattr(experts, name))
    w1, w2, w3 = experts.w1.detach(), experts.w2.detach(), experts.w3.detach()
    counts = torch.tensor([1, 3])
    torch.testing.assert_close(experts(x, counts), looped(x, counts))
    seen = []

    def doubled(rows, w, offsets):
        seen.append(w.shape)
        return 2 * grouped_mm(rows, w, offsets)

    experts.float8_grouped_mm = doubled
    hooked = experts(x, counts)
    assert len(seen) == 3
    h = F.silu(2 * grouped_mm(x, w1, counts.cumsum(0).int())) * (2 * grouped_mm(x, w3, counts.cumsum(0).int()))
    torch.testing.assert_close(hooked, 2 * grouped_mm(h, w2, counts.cumsum(0).int()))


# ---- refusals: each names the key, the value and the fix --------------------------------------


def _refused(flags: list[str], world: int, key: str, problem: str, fix: str, *, check_device: bool = True):
    cfg = load_job_config(["--config", DEBUG_CONFIG, *flags])
    with pytest.raises(ConfigError) as info:
        validate_job_config(cfg, world, check_device=check_device)
    err = info.value
    assert err.key == key and problem in err.problem and fix in err.fix, str(err)
    assert str(err).startswith(f"{key} = "), str(err)


def _gpu(monkeypatch, capability: tuple[int, int], name: str = "a GPU") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


BF16 = ["--training.mixed_precision_param", "bfloat16"]
EXPERTS = ["--float8.routed_experts", "true", "--float8.moe_fqns", "experts", *BF16]


@pytest.mark.parametrize("flags, world, key, problem, fix", [
    (["--float8.enable", "true"], 1, "float8.enable", "compute capability 8.9 or higher", "float8.emulate = true"),
    (["--float8.enable", "true", "--float8.emulate", "true", "--parallelism.tensor_parallel_degree", "2"], 2,
     "float8.recipe_name", "gloo (CPU) cannot carry", 'recipe_name = "rowwise"'),
    (["--float8.enable", "true", "--float8.emulate", "true", "--float8.enable_fsdp_float8_all_gather", "true"], 2,
     "float8.enable_fsdp_float8_all_gather", "gloo (CPU) cannot carry", "enable_fsdp_float8_all_gather = false"),
    (EXPERTS, 1, "float8.routed_experts", "compute capability 9.0 or 10.x", "float8.routed_experts = false"),
    ([*EXPERTS, "--float8.moe_fqns", "expert_s"], 1, "float8.moe_fqns", '"expert_s" names no routed-expert module',
     '["experts"]'),
    ([*EXPERTS, "--float8.moe_fqns"], 1, "float8.moe_fqns", "names none", 'float8.moe_fqns = ["experts"]'),
    ([*EXPERTS, "--training.mixed_precision_param", "float32"], 1, "float8.routed_experts",
     'mixed_precision_param = "float32"', 'mixed_precision_param = "bfloat16"'),
    ([*EXPERTS, "--model.use_grouped_mm", "false"], 1, "float8.routed_experts", "runs the experts in a loop",
     "model.use_grouped_mm = true"),
])
def test_float8_refusals_on_cpu(flags, world, key, problem, fix):
    _refused(["--training.device", "cpu", *flags], world, key, problem, fix)


def test_float8_experts_need_moe_layers():
    from torchmoe.preflight.float8 import check_float8

    cfg = load_job_config(["--config", DEBUG_CONFIG, *EXPERTS])
    with pytest.raises(ConfigError, match="has no MoE layers") as info:
        check_float8(cfg, FLAVORS["tiny"].replace(interleave_moe_layer_step=8), {"tp": 1, "ep": 1}, False)
    assert info.value.key == "float8.routed_experts" and "float8.routed_experts = false" in info.value.fix


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 1), (1, 2)])
def test_float8_experts_take_hidden_shards_off_the_16_tile(tp, ep):
    """Expert hidden dim 40 under a model dim of 120: MoE TP 2 leaves 20 per rank, and neither 40
    nor 120 is a float8 tile. Refused before; now padded to tiles in each GEMM
    (`tests/unit/test_grouped_gemm.py` runs the padded GEMMs against the per-expert loop)."""
    from torchmoe.preflight.float8 import check_float8

    cfg = load_job_config(["--config", DEBUG_CONFIG, "--training.device", "cuda", *EXPERTS])
    check_float8(cfg, FLAVORS["tiny"].replace(moe_hidden_dim=40, dim=120), {"tp": tp, "ep": ep}, False)


@pytest.mark.parametrize("capability, linears_ok, experts_ok", [
    ((8, 0), False, False),  # A100
    ((8, 9), True, False),  # L40S: float8 GEMMs, no float8 grouped GEMM
    ((9, 0), True, True),  # H100 / H200
    ((10, 0), True, True),  # B200
    ((12, 0), True, False),  # RTX 50xx: no _scaled_grouped_mm kernel
])
def test_float8_compute_capabilities(monkeypatch, capability, linears_ok, experts_ok):
    from torchmoe.distributed.float8 import float8_unavailable

    _gpu(monkeypatch, capability, "the GPU")
    linears = float8_unavailable(load_job_config(["--float8.enable", "true"]).float8, "cuda")
    experts = float8_unavailable(load_job_config(["--float8.routed_experts", "true"]).float8, "cuda")
    assert (linears is None) == linears_ok and (experts is None) == experts_ok
    if not linears_ok:
        assert linears[0] == "float8.enable" and f"has {capability[0]}.{capability[1]}" in linears[1]
    if not experts_ok:
        assert experts[0] == "float8.routed_experts" and "_scaled_grouped_mm" in experts[1]


def test_float8_without_torchao_is_refused(monkeypatch):
    import importlib.util

    import torchmoe.distributed.float8 as float8

    _gpu(monkeypatch, (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(float8.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("torchao") else real(name, *a))
    for flags, key in ((["--float8.enable", "true"], "float8.enable"),
                       (["--float8.routed_experts", "true"], "float8.routed_experts")):
        key_got, problem, fix = float8.float8_unavailable(load_job_config(flags).float8, "cuda")
        assert key_got == key and "torchao" in problem and "torchmoe[float8]" in fix


@pytest.mark.parametrize("recipe, styles", [("tensorwise", "float8 TP styles"), ("rowwise", "plain TP styles in high")])
def test_dry_run_names_the_tp_styles_and_their_all_gather_bytes(recipe, styles):
    """debug model, tp 2 x FSDP 4, 8 x 128 tokens per dp rank and step: per block the attention input (and a
    dense FFN's) and the gradients of wo (and w2) are gathered, plus the embedding gradient and
    the head input; 1 byte each in float8, 4 in fp32."""
    from torchmoe.plan.dry_run import plan_job

    cfg = load_job_config(["--config", DEBUG_CONFIG, "--training.device", "cuda", "--float8.enable", "true",
                           "--float8.recipe_name", recipe, "--parallelism.tensor_parallel_degree", "2"])
    validate_job_config(cfg, 8, check_device=False)
    report = plan_job(cfg, 8).report
    assert styles in report["plan"]["tensor_parallel"]["detail"]
    tp = report["tensor_parallel"]
    per_gather = 8 * 128 * 128 * (2 - 1) / 2  # rows per dp rank x seq x dim x (tp - 1) / tp
    # 4 blocks: 2 dense (4 gathers), 2 MoE (attention's 2 in float8 + the MoE input and output
    # gradient in fp32); the embedding gradient and the head input in fp32.
    plain = per_gather * 4 * (2 * 4 + 2 * 4 + 2)
    float8 = per_gather * (2 * 4 * 1 + 2 * (2 * 1 + 2 * 4) + 2 * 4)
    assert tp["plain_styles_bytes_per_step"] == plain
    assert tp["all_gather_bytes_per_step"] == (float8 if recipe == "tensorwise" else plain)
    assert tp["float8_styles"] == (recipe == "tensorwise")


@pytest.mark.parametrize("world, flags", [
    (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
    (4, ["--parallelism.tensor_parallel_degree", "2", "--float8.enable_fsdp_float8_all_gather", "true",
         "--activation_checkpoint.mode", "selective"]),
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--training.local_batch_size", "4"]),
])
def test_float8_tp_composes_with_the_parallelize_pipeline(fake_world, world, flags):
    """The whole pipeline as `Trainer` runs it (EP alongside TP, FSDP with float8 all-gathers and
    selective AC, a pipeline stage), then a forward and backward of rank 0 on CPU (the fake world
    moves no data: shapes, placements and the float8 paths run, not the numbers): every float8
    linear runs, every parameter is a DTensor with a gradient, and the output has rank 0's shape
    (vocab-sharded logits, or a first stage's sequence-sharded hidden states)."""
    from torchmoe.models.decoder.parallelize import parallelize_model
    from torchmoe.models.decoder.pipeline_stages import split_into_stages

    cfg = _cfg("--float8.enable", "true", *flags)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    fake_world(0, world)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(FLAVORS["tiny"])
    if dims.pp_enabled:
        pipe = pipeline_layout(FLAVORS["tiny"], dims, cfg.parallelism, SEQ)
        model = split_into_stages(model, pipe, 0)[0]
    parallelize_model(model, dims, mesh, cfg, "cpu")
    float8 = [module for module in model.modules() if isinstance(module, Float8Linear)]
    assert float8 and all(isinstance(p, DTensor) for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0, 0.02)
    ran = set()
    for module in float8:
        module.register_forward_hook(lambda mod, args, out: ran.add(id(mod)))
    tokens = torch.randint(0, FLAVORS["tiny"].vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    out.float().sum().backward()
    tp, args = dims.tp, FLAVORS["tiny"]
    assert out.shape == ((ROWS, SEQ // tp, args.dim) if dims.pp_enabled else (ROWS, SEQ, args.vocab_size // tp))
    assert ran == {id(module) for module in float8}
    assert all(p.grad is not None for p in model.parameters())


def test_torchao_is_imported_only_for_float8_and_quietly() -> None:
    """A run without float8 never imports torchao (asking whether a linear is a float8 one imports
    nothing); a float8 run's check imports it without the CUDA-extension and Enum warnings that a
    bare `import torchao` logs beside a CPU build of torch (torchao 0.18 with torch 2.13)."""
    import subprocess
    import sys

    probe = ("import logging, sys, torch; logging.basicConfig()\n"
             "from torchmoe.config.job_config import Float8\n"
             "from torchmoe.distributed.float8 import float8_unavailable, is_float8_linear\n"
             "assert not is_float8_linear(torch.nn.Linear(2, 2)) and 'torchao' not in sys.modules\n"
             "{}\n")
    checked = probe.format("assert float8_unavailable(Float8(enable=True, emulate=True), 'cpu') is None")
    run = subprocess.run([sys.executable, "-c", checked], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [n for n in ("Failed to load", "is an Enum subclass") if n in run.stderr] == []
