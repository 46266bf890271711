"""The one home of torch's private APIs: everything torchmoe uses that torch does not promise.

    python -m pytest -q tests/unit/test_torch_private.py     # pins what each entry must do

Each entry says what it stands for, why torchmoe needs it, and the public API that would replace
it; `tests/unit/test_torch_private.py` pins the behaviour torchmoe relies on, one test per entry,
so that a torch upgrade that changes one fails there, in one place, before any training test.
Nothing else in the package touches a private torch name (a test greps for it).

Pinned against torch 2.13.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# ---- device meshes -----------------------------------------------------------------------------


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all of `mesh`'s dims (their ranks in row-major order), named `name`,
    registered on its root mesh so that slicing by `name` finds it.
    Public replacement: none yet (DeviceMesh's flatten is ``_flatten`` in torch 2.13)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`mesh` with dim `dim` split into dims of `sizes` named `names` (row-major), with process
    groups for each new dim. Public replacement: none yet (``DeviceMesh._unflatten``)."""
    return mesh._unflatten(dim, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One n-D mesh from 1-D meshes over independent dims, reusing their process groups (HSDP
    over a world dim and a flattened view). Public replacement: none yet
    (``DeviceMesh._concatenate``)."""
    return DeviceMesh._concatenate(meshes)


# ---- process groups ------------------------------------------------------------------------------


def set_group_timeout(timeout: timedelta, group: dist.ProcessGroup | None) -> None:
    """Change the collective timeout of an existing process group (None: the default group).
    Public replacement: none (a timeout is fixed when a group is created)."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def abort_process_groups() -> None:
    """Abort every process group of this process at once, in torch's order, failing the
    collectives blocked on them. Public replacement: none in torch 2.13 (``_abort_process_group``)."""
    dist.distributed_c10d._abort_process_group()


def default_store() -> dist.Store:
    """The rendezvous store of the default process group. Public replacement: none
    (``_get_default_store``)."""
    return dist.distributed_c10d._get_default_store()


# ---- data parallel, activation checkpointing -----------------------------------------------------


def replicate(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """DDP built on FSDP2 (`fully_shard` without sharding), the DDP that composes with FSDP2 /
    TP meshes and mixed precision. Public replacement: ``torch.distributed.fsdp.replicate`` once
    it leaves ``_composable`` (torch 2.13: ``replicate_with_fsdp``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

    return fsdp_replicate(module, **kwargs)


def checkpoint_wrapper(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """Wrap `module` so its forward runs under non-reentrant activation checkpointing (kwargs go to
    ``torch.utils.checkpoint.checkpoint``). Public replacement: calling
    ``torch.utils.checkpoint.checkpoint`` in the block's forward (the wrapper keeps parameter names
    under ``_checkpoint_wrapped_module``, which state-dict helpers strip)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def sac_dispatch_modes() -> tuple[type, type]:
    """Selective activation checkpointing's two dispatch modes (forward: caching what the policy
    saves; recompute: replaying it), to subclass. Public replacement:
    ``create_selective_checkpoint_contexts``, which cannot pass profiler ops through uncounted."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    return _CachingTorchDispatchMode, _CachedTorchDispatchMode


def profiler_record_ops() -> frozenset:
    """The ops `record_function` dispatches (enter, enter_new, exit): annotations, no computation.
    Public replacement: none."""
    ops = torch.ops.profiler
    return frozenset({ops._record_function_enter.default, ops._record_function_enter_new.default,
                      ops._record_function_exit._RecordFunction})


# ---- autograd ------------------------------------------------------------------------------------


def in_backward() -> bool:
    """Autograd is running a backward on this thread (activation-checkpoint recomputation runs
    inside one). Public replacement: none (``torch._C._current_graph_task_id() != -1``)."""
    return torch._C._current_graph_task_id() != -1


def profiler_enabled() -> bool:
    """The autograd profiler is recording. Public replacement: none (``_profiler_enabled``)."""
    return torch.autograd._profiler_enabled()


# ---- operators -------------------------------------------------------------------------------------


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: rows ``offsets[g-1]:offsets[g]`` of a (R, K) times b[g] (G, K, N); or, for a
    2-D b of (K, R) columns, per-group products of column blocks. Public replacement:
    ``torch.nn.functional.grouped_mm`` (newer torch)."""
    return torch._grouped_mm(a, b, offs=offsets)


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Per-tensor vector norms in one kernel launch per device and dtype. Public replacement:
    ``torch.linalg.vector_norm`` per tensor (slower; what clipping does with ``foreach=False``)."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Multiply every tensor in place by `scalar` in one launch. Public replacement: ``mul_`` per
    tensor."""
    torch._foreach_mul_(tensors, scalar)


def fused_optimizer_devices() -> list[str]:
    """Device types with fused optimizer kernels. Public replacement: none (torch.utils._foreach_utils)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


_aten = torch.ops.aten


def flash_attention_cpu(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp) of CPU's flash attention (grouped-query heads accepted). Public
    replacement: none (SDPA returns no log-sum-exp)."""
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def flash_attention_cpu_backward(grad, q, k, v, out, lse, causal: bool):
    """dq, dk, dv of `flash_attention_cpu` for `grad`, given the output and log-sum-exp."""
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


def flash_attention_cuda(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp) of CUDA's flash attention (fp16/bf16; grouped-query heads accepted)."""
    return _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]


def flash_attention_cuda_backward(grad, q, k, v, out, lse, causal: bool):
    """dq, dk, dv of `flash_attention_cuda`: dense (no cumulative lengths), without dropout (the
    RNG state is unread)."""
    rng = torch.empty((), dtype=torch.int64)
    return _aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, None, None, q.shape[-2],
                                                              k.shape[-2], 0.0, causal, rng, rng)


def flash_varlen_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, window_left: int):
    """dq, dk, dv of the public ``torch.nn.attention.varlen.varlen_attn`` on flash, given an output
    and log-sum-exp (H, Tq) other than its forward's own (gpt-oss's sinks joined to each segment's
    softmax: `nn.segment_attention`); the same arguments as its own backward (no dropout, so the
    RNG state is unread; causal as ``window_size (-1, 0)``, else a sliding window of
    ``window_left + 1`` keys). Public replacement: none (``varlen_attn``'s autograd takes its own
    output and drops a log-sum-exp gradient)."""
    rng, unused = torch.zeros((2,), dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    return _aten._flash_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, window_left < 0,
                                           rng, unused, window_size_left=window_left, window_size_right=0)


def efficient_attention_cuda(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp padded to a multiple of 32 queries) of CUDA's memory-efficient kernel
    (any float dtype; as many key/value heads as query heads)."""
    return _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]


def efficient_attention_cuda_backward(grad, q, k, v, out, padded_lse, causal: bool):
    """dq, dk, dv of `efficient_attention_cuda`, given its (padded) log-sum-exp."""
    rng = torch.empty((), dtype=torch.int64)
    return _aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, None, out, padded_lse, rng, rng,
                                                                  0.0, [True, True, True, False], causal)[:3]


def saved_by_selective_ac() -> frozenset:
    """The private ops per-op selective AC saves: fused attention kernels (the public
    ``varlen_attn``'s operator too), grouped GEMMs (also float8's), TP's reduce-scatters and EP's
    all-to-alls (functional collectives)."""
    import torch.nn.attention.varlen  # noqa: F401  registers torch_attn::_varlen_attn

    ops = {_aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_flash_attention.default,
           _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._grouped_mm.default,
           torch.ops.torch_attn._varlen_attn.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
           torch.ops._c10d_functional.all_to_all_single.default}
    ops |= {getattr(_aten, name).default for name in ("_scaled_dot_product_cudnn_attention", "_scaled_grouped_mm")
            if hasattr(_aten, name)}
    return frozenset(ops)


def scaled_mm_op():
    """Float8 linears' matmul (torchao runs them as ``_scaled_mm``): selective AC treats it as mm."""
    return _aten._scaled_mm.default


# ---- functional collectives -------------------------------------------------------------------------

functional_collectives = torch.ops._c10d_functional
"""c10d's functional collectives (``all_to_all_single``, ``wait_tensor``): traceable by dynamo,
which EP's asynchronous all-to-all needs. Public replacement:
``torch.distributed._functional_collectives`` is the Python face of the same ops, private too."""


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange one count per peer (``counts``: (group size * n,)) as a traced functional
    collective. Public replacement: ``dist.all_to_all_single`` (a graph break under compile)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_to_all_single(counts, None, None, group)


# ---- DTensor ---------------------------------------------------------------------------------------


def local_shape_and_offset(shape: torch.Size, mesh: DeviceMesh, placements) -> tuple[tuple, tuple]:
    """(this rank's local shape, its offset in the global tensor) of a DTensor with `shape` and
    `placements` on `mesh`. Public replacement: none (``tensor._utils``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def strided_shard_type() -> type:
    """The placement FSDP2 uses for a dim sharded twice (TP then FSDP on the same dim):
    ``_StridedShard``. Public replacement: none."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


# ---- distributed checkpoint ----------------------------------------------------------------------


def set_state_dict_element(state: dict, path: tuple, value) -> None:
    """Put `value` at DCP's flattened `path` in a nested state dict (what DCP's own load planner
    does for stored bytes). Public replacement: none (``checkpoint._traverse.set_element``)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state, path, value)


def consolidate_safetensors(input_dir: str, output_dir: str, fqn_to_index: dict[str, int], *,
                            every_rank: bool, process_group: dist.ProcessGroup | None = None) -> None:
    """Merge the per-rank safetensors shards DCP's HF writer left in `input_dir` into the
    Hugging Face files `fqn_to_index` names; with `every_rank`, each rank merges some files.
    Public replacement: ``HuggingFaceStorageWriter(enable_consolidation=True)`` (one rank merges
    everything)."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation

    if every_rank:
        consolidation.consolidate_safetensors_files_on_every_rank(input_dir, output_dir, fqn_to_index,
                                                                   process_group=process_group)
    else:
        consolidation.consolidate_safetensors_files(input_dir, output_dir, fqn_to_index)


def hf_writer_write_files(writer, planner, file_queue):
    """The file-writing half of ``HuggingFaceStorageWriter.write_data``, given our own queue of
    (path, file name, write items): lets a subclass choose the files. Public replacement: none
    (``FileSystemWriter._write_data``)."""
    return writer._write_data(planner, file_queue)


# ---- compile -----------------------------------------------------------------------------------------


def size_oblivious_shapes() -> None:
    """Trace data-dependent sizes as unbacked from now on (a rank that receives 0 rows reuses the
    graphs). Public replacement: ``torch._dynamo.config`` / mark_unbacked per tensor (private too)."""
    import torch.fx.experimental._config as fx_config

    fx_config.backed_size_oblivious = True


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Let torch.compile trace dim `dim` of `t` as symbolic from its first graph on (no
    recompilation when it changes; nothing where it must stay static). Public replacement:
    none (``torch._dynamo.maybe_mark_dynamic``)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def dynamo_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) by dynamo in this process. Public replacement:
    ``torch._logging`` records (no totals)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def enable_async_tp(group_name: str) -> None:
    """Async TP: inductor's micro-pipelined TP (collectives fused with the matmuls they feed) over
    symmetric memory on the TP group. Public replacement: none in torch 2.13."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


# ---- CUDA memory snapshots ----------------------------------------------------------------------


def record_memory_history(enabled: bool, max_entries: int = 0) -> None:
    """Start (with `max_entries`) or stop recording allocations for a memory snapshot. Public
    replacement: none in torch 2.13 (``torch.cuda.memory._record_memory_history``)."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded allocation history (for pytorch.org/memory_viz). Public replacement: none."""
    torch.cuda.memory._dump_snapshot(path)


# ---- pipeline schedules --------------------------------------------------------------------------


def pipeline_action_orders(schedule: str, pp: int, stage_indices: list[int], num_stages: int,
                           n_microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """Every pp rank's compute actions ``(kind, stage, micro-batch)`` in the order torch's
    multi-stage `schedule` runs them (kind: "F" forward, "B" full backward, "I" / "W" the input and
    weight halves of a split backward), for the planner's bubble and activations in flight.

    torch builds the lists for all ranks when a schedule is constructed, reading a few attributes
    of its stages: stand-in stages (rank 0's `stage_indices`) carry just those, so no process
    group, module or tensor is involved. Public replacement: none (``pipeline_order`` and the
    attributes read are internals).
    """
    from torch.distributed.pipelining import schedules

    class _StandInStage:
        def __init__(self, index: int) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
            self.is_first, self.is_last = index == 0, index == num_stages - 1
            self.submod, self.has_backward, self.stage_index_to_group_rank = torch.nn.Identity(), True, {}

    stages = [_StandInStage(s) for s in stage_indices]
    order = schedules.get_schedule_class(schedule)(stages, n_microbatches=n_microbatches,
                                                   loss_fn=lambda out, target: out).pipeline_order
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    orders: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in order.items():
        orders[rank] = [(kinds.get(name, name), sub.stage_index, sub.microbatch_index)
                        for action in actions if action is not None for sub in (action.sub_actions or (action,))
                        for name in (str(sub.computation_type).rsplit(".", 1)[-1],)]
    return orders


# ---- recovery across replica groups -----------------------------------------------------------


def streaming_load(f) -> object:
    """Tensors and plain values from torch's streaming format (what torchft's HTTP checkpoint
    transport sends), unpickled with ``weights_only=True``: no code from the wire runs.
    Public replacement: none (``torch.distributed._serialization._streaming_load``)."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(f, weights_only=True)

