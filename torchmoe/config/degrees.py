"""The parallel degrees against the world size: `resolve_degrees`, which every layout passes.

    python -c "from torchmoe.config import JobConfig, resolve_degrees; print(resolve_degrees(JobConfig().parallelism, 8))"

A leaf of `torchmoe.config`, as `validate` is: `ParallelDims`, the dry run and the planner build
their layouts on what it returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import Parallelism

__all__ = ["divisors_text", "resolve_degrees"]

# (short name used in meshes and messages, Parallelism field), outermost mesh dim first.
_DEGREE_FIELDS = (
    ("pp", "pipeline_parallel_degree"),
    ("dp_replicate", "data_parallel_replicate_degree"),
    ("dp_shard", "data_parallel_shard_degree"),
    ("cp", "context_parallel_degree"),
    ("tp", "tensor_parallel_degree"),
    ("ep", "expert_parallel_degree"),
)


def _product(degrees: dict[str, int], names: Sequence[str]) -> tuple[int, str]:
    """The product of the named degrees and its arithmetic, e.g. ``(8, "dp_shard(4) * tp(2)")``."""
    return math.prod(degrees[n] for n in names), " * ".join(f"{n}({degrees[n]})" for n in names)


def resolve_degrees(parallelism: Parallelism, world_size: int) -> dict[str, int]:
    """Resolve the parallel degrees against the world size.

    ``data_parallel_shard_degree = -1`` becomes whatever ``world_size`` leaves after the other
    degrees. `ParallelDims` and the dry-run planner call this, so every layout they build has
    passed these checks.

    Args:
        parallelism: the `[parallelism]` section.
        world_size: number of processes (ranks).

    Returns:
        ``{"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"}`` -> degree, all >= 1, with
        ``pp * dp_replicate * dp_shard * cp * tp == world_size`` and ``ep`` dividing
        ``dp_shard * cp * tp``.

    Raises:
        ConfigError: a degree < 1 (other than dp_shard = -1), a product that is not the world
            size (the message shows the arithmetic), a -1 that does not fill an integral rest,
            ep not dividing dp_shard * cp * tp, or DDP combined with other parallelism.
    """
    if world_size < 1:
        raise ConfigError("WORLD_SIZE", world_size, "must be >= 1", "pass --world-size N with N >= 1")
    degrees = {short: getattr(parallelism, name) for short, name in _DEGREE_FIELDS}
    for short, name in _DEGREE_FIELDS:
        if degrees[short] >= 1 or (short == "dp_shard" and degrees[short] == -1):
            continue
        allowed = ">= 1, or -1 to fill the rest of the world size" if short == "dp_shard" else ">= 1"
        raise ConfigError(f"parallelism.{name}", degrees[short], f"must be {allowed}",
                          f"set it to 1 to disable {short}")

    others, others_text = _product(degrees, ("dp_replicate", "cp", "tp", "pp"))
    if degrees["dp_shard"] == -1:
        if world_size % others:
            raise ConfigError(
                "parallelism.data_parallel_shard_degree", -1,
                f"-1 fills the rest, but WORLD_SIZE({world_size}) / ({others_text}) = "
                f"{world_size}/{others} is not an integer",
                f"choose degrees whose product divides WORLD_SIZE({world_size}), "
                f"or run on a multiple of {others} ranks",
            )
        degrees["dp_shard"] = world_size // others

    total, total_text = _product(degrees, ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    if total != world_size:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree", degrees["dp_shard"],
            f"{total_text} = {total} != WORLD_SIZE({world_size})",
            "make the degrees multiply to the world size, e.g. data_parallel_shard_degree = -1 to fill the rest "
            "(or pass a matching --world-size / number of processes)",
        )

    if degrees["dp_replicate"] > 1 and degrees["dp_shard"] == 1:
        mixed = [f"{n}({degrees[n]})" for n in ("tp", "cp", "pp", "ep") if degrees[n] > 1]
        if mixed:
            raise ConfigError(
                "parallelism.data_parallel_replicate_degree", degrees["dp_replicate"],
                f"DDP (dp_shard = 1) cannot be combined with {', '.join(mixed)}; HSDP needs dp_shard > 1",
                "use HSDP with data_parallel_shard_degree > 1 (or -1), or plain DDP with every other degree 1",
            )

    ep_region, ep_text = _product(degrees, ("dp_shard", "cp", "tp"))
    if ep_region % degrees["ep"]:
        raise ConfigError(
            "parallelism.expert_parallel_degree", degrees["ep"],
            f"must divide {ep_text} = {ep_region} (EP borrows its ranks from there); "
            f"{ep_region} % {degrees['ep']} = {ep_region % degrees['ep']}",
            f"use an expert_parallel_degree that divides {ep_region}: {divisors_text(ep_region)}",
        )
    return degrees


def divisors_text(n: int) -> str:
    """The divisors of `n`, in order, as a message lists them: "1, 2, 4, 8"."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
