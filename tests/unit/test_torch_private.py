"""What torchmoe relies on in torch's private APIs, pinned in one place (`torchmoe._torch_private`):
a torch upgrade that changes one of them fails here first. And nothing else in the package
touches a private torch name.

    python -m pytest -q tests/unit/test_torch_private.py

CUDA-only entries (flash / memory-efficient kernels, async TP, memory snapshots) are pinned by
their signatures here and run by tests/gpu when a GPU is there.
"""

from __future__ import annotations

import ast
import inspect
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import leave_world
from torchmoe import _torch_private as private

PACKAGE = Path(private.__file__).parent


@pytest.fixture
def world(tmp_path):
    """A real one-rank gloo world (what needs real collectives)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    leave_world()


@pytest.fixture
def fake_world():
    """A fake world of 8 ranks, this process rank 0 (meshes and layouts, no data moved)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    leave_world()


# ---- device meshes -----------------------------------------------------------------------------


def test_meshes_flatten_unflatten_and_concatenate(fake_world):
    """(2, 2, 2) world: flattening its last two dims gives rank 0 the group [0..3]; unflattening
    that into (2, 2) gives back [0, 1] and [0, 2]; concatenating two 1-D meshes gives the 2-D
    mesh over both, with the same groups."""
    world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    flat = private.flatten_mesh(world["b", "c"], "bc")
    assert flat.mesh.tolist() == [0, 1, 2, 3] and world["bc"].mesh.tolist() == [0, 1, 2, 3]
    split = private.unflatten_mesh(flat, 0, (2, 2), ("x", "y"))
    assert split["x"].mesh.tolist() == [0, 2] and split["y"].mesh.tolist() == [0, 1]
    both = private.concatenate_meshes([world["a"], flat])
    assert both.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and both.mesh_dim_names == ("a", "bc")
    assert both.get_group(1) is flat.get_group()


# ---- process groups ------------------------------------------------------------------------------


def test_a_group_timeout_changes_after_creation(world):
    group = dist.new_group([0], timeout=timedelta(seconds=300))
    private.set_group_timeout(timedelta(seconds=7), group)
    assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)


def test_abort_takes_no_argument_for_every_group():
    """Its effect (blocked NCCL collectives fail at once) needs NCCL: pinned by signature."""
    params = inspect.signature(dist.distributed_c10d._abort_process_group).parameters
    assert all(p.default is not inspect.Parameter.empty for p in params.values())


def test_the_default_store_is_the_rendezvous_store(world):
    private.default_store().set("pinned", "yes")
    assert private.default_store().get("pinned") == b"yes"


# ---- data parallel, activation checkpointing -----------------------------------------------------


def test_replicate_makes_replicated_dtensors(world):
    mesh = init_device_mesh("cpu", (1,))
    model = private.replicate(torch.nn.Linear(4, 4), mesh=mesh)
    assert all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoint_wrapper_recomputes_the_forward_and_keeps_names():
    calls = []
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    inner[0].register_forward_hook(lambda *a: calls.append(1))
    wrapped = private.checkpoint_wrapper(inner, preserve_rng_state=False)
    wrapped(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward, and its recomputation in backward
    assert set(wrapped.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_sac_modes_save_what_the_policy_says():
    """With our subclasses' two modes, an op the policy must save runs once (its output is
    replayed in the recomputation), others twice."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint

    caching, cached = private.sac_dispatch_modes()
    seen: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mm.default:
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        storage = defaultdict(dict)
        return caching(policy, storage), cached(None, storage)

    w = torch.randn(4, 4, requires_grad=True)
    checkpoint(lambda x: (x @ w).relu(), torch.randn(2, 4, requires_grad=True), use_reentrant=False,
               context_fn=contexts).sum().backward()
    assert seen == {False: 1}  # the recomputation took mm's saved output


def test_record_function_dispatches_exactly_the_profiler_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func)
            return func(*args, **(kwargs or {}))

    with torch.profiler.profile(), Recorder(), torch.autograd.profiler.record_function("x"):
        pass
    assert seen and seen <= private.profiler_record_ops()


# ---- autograd ------------------------------------------------------------------------------------


def test_in_backward_is_true_only_inside_a_backward():
    inside = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            inside.append(private.in_backward())
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert inside == [True] and not private.in_backward()


def test_profiler_enabled_follows_the_profiler():
    assert not private.profiler_enabled()
    with torch.profiler.profile():
        assert private.profiler_enabled()


# ---- operators -------------------------------------------------------------------------------------


def test_grouped_mm_is_a_product_per_row_block():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 4, generator=gen), torch.randn(3, 4, 8, generator=gen)  # rows of 16 bytes
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    expected = torch.cat([a[0:2] @ b[0], a[2:2] @ b[1], a[2:7] @ b[2]])
    torch.testing.assert_close(private.grouped_mm(a, b, offsets), expected)


def test_foreach_norm_and_mul_are_per_tensor():
    tensors = [torch.randn(3), torch.randn(2, 2)]
    norms = private.foreach_norm(tensors, 2.0, torch.float64)
    assert [n.dtype for n in norms] == [torch.float64] * 2
    torch.testing.assert_close(torch.stack(norms), torch.stack([t.double().norm() for t in tensors]))
    expected = [t * 0.5 for t in tensors]
    private.foreach_mul_(tensors, torch.tensor(0.5))
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got, want)


def test_fused_optimizers_exist_for_cpu_and_cuda():
    assert {"cpu", "cuda"} <= set(private.fused_optimizer_devices())


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_returns_the_log_sum_exp_and_its_backward(causal):
    """Grouped-query heads (4 over 2); the log-sum-exp of the scaled scores; the backward, given
    the output and log-sum-exp, is autograd's of SDPA."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    out, lse = private.flash_attention_cpu(q, k, v, causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 8 ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    grad = torch.randn_like(out)
    got = private.flash_attention_cpu_backward(grad, q, k, v, out, lse, causal)
    for g, e in zip(got, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, e)


def test_cuda_attention_kernels_have_the_arguments_we_pass():
    """Run by tests/gpu/test_attention_gpu.py on a GPU; here: the schemas our calls assume."""
    aten = torch.ops.aten
    flash = str(aten._scaled_dot_product_flash_attention.default._schema)
    assert flash.startswith("aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, "
                            "float dropout_p=0., bool is_causal=False")
    assert "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, " \
        "bool is_causal, Tensor philox_seed, Tensor philox_offset" in \
        str(aten._scaled_dot_product_flash_attention_backward.default._schema)
    assert "(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, " \
        "float dropout_p=0., bool is_causal=False" in str(aten._scaled_dot_product_efficient_attention.default._schema)
    assert "Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, " \
        "float dropout_p, bool[4] grad_input_mask, bool is_causal=False" in \
        str(aten._scaled_dot_product_efficient_attention_backward.default._schema)
    # flash_varlen_attention_backward: the arguments of torch's own varlen_attn backward.
    assert "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, " \
        "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, " \
        "Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, " \
        "SymInt? window_size_right=None)" in str(aten._flash_attention_backward.default._schema)


def test_ops_selective_ac_saves_exist():
    assert all(isinstance(op, torch._ops.OpOverload) for op in private.saved_by_selective_ac())
    assert isinstance(private.scaled_mm_op(), torch._ops.OpOverload)


# ---- functional collectives -------------------------------------------------------------------------


def test_functional_all_to_all_of_counts(world):
    assert hasattr(private.functional_collectives, "all_to_all_single")
    assert hasattr(private.functional_collectives, "wait_tensor")
    counts = torch.tensor([3, 1])
    torch.testing.assert_close(private.all_to_all_counts(counts, dist.group.WORLD), counts)


# ---- DTensor ---------------------------------------------------------------------------------------


def test_local_shape_and_offset_of_a_shard(fake_world):
    mesh = init_device_mesh("cpu", (8,))
    assert private.local_shape_and_offset(torch.Size((16, 3)), mesh, [Shard(0)]) == ((2, 3), (0, 0))


def test_strided_shard_is_a_placement_with_a_split_factor():
    strided = private.strided_shard_type()(0, split_factor=2)
    assert isinstance(strided, Placement) and strided.dim == 0 and strided.split_factor == 2


# ---- distributed checkpoint ----------------------------------------------------------------------


def test_set_state_dict_element_follows_dcps_paths():
    state = {"optimizer": {"param_groups": [{}]}}
    private.set_state_dict_element(state, ("optimizer", "param_groups", 0, "lr"), 0.1)
    assert state == {"optimizer": {"param_groups": [{"lr": 0.1}]}}


def test_hf_consolidation_and_writer_take_what_we_pass():
    """Both run in every Hugging Face export test; pinned by the parameters our calls use."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation

    assert list(inspect.signature(consolidation.consolidate_safetensors_files).parameters)[:3] == [
        "input_dir", "output_dir", "fqn_to_index_mapping"]
    assert "process_group" in inspect.signature(consolidation.consolidate_safetensors_files_on_every_rank).parameters
    assert list(inspect.signature(HuggingFaceStorageWriter._write_data).parameters) == ["self", "planner", "file_queue"]


# ---- compile -----------------------------------------------------------------------------------------


def test_size_oblivious_shapes_sets_torchs_switch():
    """Switched through torch's own `patch`, which restores it (pytest 9.2's monkeypatch deletes a
    torch config key on undo, breaking every later compile)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=False):
        private.size_oblivious_shapes()
        assert fx_config.backed_size_oblivious is True


def test_dynamo_counters_count_a_compiled_graph():
    torch._dynamo.reset()
    graphs, breaks = private.dynamo_counters()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert private.dynamo_counters() == (graphs + 1, breaks)


def test_a_marked_dim_compiles_once_for_every_size():
    """What the document segment tables' width relies on: a dim marked dynamic is symbolic in
    the first graph, so other sizes reuse it."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x + 1).sum(-1), backend="eager", fullgraph=True)
    graphs, _ = private.dynamo_counters()
    for width in (4, 8, 16):
        x = torch.ones(2, width)
        private.mark_dynamic(x, 1)
        assert fn(x).tolist() == [2.0 * width] * 2
    assert private.dynamo_counters()[0] == graphs + 1


def test_async_tp_switches_exist():
    """CUDA-only in use (symmetric memory); pinned by existence."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401

    assert hasattr(torch._inductor.config, "_micro_pipeline_tp")


def test_memory_history_takes_what_we_pass():
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert "enabled" in params and "max_entries" in params
    assert callable(torch.cuda.memory._dump_snapshot)


# ---- pipeline schedules --------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "kinds"), [("Interleaved1F1B", {"F", "B"}), ("ZBVZeroBubble", {"F", "I", "W"})])
def test_pipeline_orders_list_every_stage_and_micro_batch(schedule, kinds):
    """pp 2, 4 stages, 4 micro-batches: each rank runs, for each of its 2 stages and each
    micro-batch, one forward and its backward (whole, or its input and weight halves)."""
    from torchmoe.plan.pipeline import stage_ranks

    orders = private.pipeline_action_orders(schedule, 2, stage_ranks(2, 4, schedule)[0], 4, 4)
    assert sorted(orders) == [0, 1]
    for rank, actions in orders.items():
        assert {kind for kind, _, _ in actions} == kinds
        stages = set(stage_ranks(2, 4, schedule)[rank])
        for kind in kinds:
            assert sorted((s, mb) for k, s, mb in actions if k == kind) == sorted(
                (s, mb) for s in stages for mb in range(4)), (rank, kind)
    assert orders[0][0] == ("F", 0, 0)


# ---- nothing else touches torch's privates --------------------------------------------------------


def _own_private_names() -> set[str]:
    """Every _name the package itself defines (functions, classes, attributes it assigns)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def _torch_module(name: str | None) -> bool:
    return name is not None and (name == "torch" or name.startswith("torch."))


def test_no_module_but_the_private_one_touches_torchs_privates():
    """Imports of private torch modules or names, and attributes `_x` the package does not define
    itself (torch's: ``torch._foreach_norm``, ``mesh._flatten``, ``dist.distributed_c10d._x``),
    except on modules that are not torch's (``os._exit``)."""
    own = _own_private_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_private.py":
            continue
        tree = ast.parse(path.read_text())
        others = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                  for alias in node.names if not _torch_module(alias.name)}
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and _torch_module(node.module):
                if any(part.startswith("_") for part in node.module.split(".")) or any(
                        alias.name.startswith("_") for alias in node.names):
                    found.append(f"{where} from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import):
                found += [f"{where} import {a.name}" for a in node.names
                          if _torch_module(a.name) and any(p.startswith("_") for p in a.name.split("."))]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id in others):
                found.append(f"{where} .{node.attr}")
    assert not found, "\n".join(found)
