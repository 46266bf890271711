"""Hardware profiles: what a device computes and moves per second, for the layout planner.

    python -c "from torchmoe.plan.hardware import load_profile; p = load_profile('h100'); \\
        print(p.name, p.rate('matmul', 'bfloat16') / 1e12, 'TFLOP/s')"

A profile is a JSON document (the built-in ones are the same data, in `BUILTIN_PROFILES`):

    {
      "format": "torchmoe-hardware-profile", "version": 1,
      "name": "h100", "source": "where the numbers come from",
      "memory_gib": 80,                    device memory per rank
      "gpus_per_node": 8,                  ranks sharing the intra-node link
      "peak_tflops": {"bfloat16": 989},    published dense peak per compute dtype: MFU's denominator
      "achieved_tflops": {                 what kernels reach, per op class and dtype
        "matmul":     {"bfloat16": 700, "float32": 50, "float8": 1300},   dense nn.Linear GEMMs
        "attention":  {"bfloat16": 400},   causal SDPA forward + backward (FLOPs of the causal half)
        "grouped_mm": {"bfloat16": 550}    routed experts' grouped GEMMs
      },
      "attention_head_dim": 128,           the head_dim the attention rate was measured at (0: any)
      "device": "cuda",                    optional: the device type ("cuda", the default, or "cpu")
      "compute_capability": [9, 0],        optional: the GPU's (default 8.0); with the device and
                                           the job's dtype and head_dim it says which attention
                                           kernel runs (`torchmoe.nn.attention_kernel_choice`)
      "memory_bandwidth_gbs": 2700,        achieved GB/s of elementwise kernels (norms, SwiGLU, AdamW)
      "kernel_overhead_us": 4,             fixed cost per kernel the device cannot hide (launch, dispatch)
      "overlap": 0.9,                      fraction of FSDP/DDP traffic that computing hides (0-1)
      "links": {                           per-rank bus bandwidth (nccl-tests' busbw convention)
        "intra_node": {"latency_us": 8, "bandwidth_gbs": 360},
        "inter_node": {"latency_us": 20, "bandwidth_gbs": 45}
      },
      "collectives": {                     optional, measured per collective on the intra-node link
        "all_gather": {"latency_us": 30, "bandwidth_gbs": 1.5}, ...        (overrides "intra_node")
      },
      "measurements": {...}                optional raw data `torchmoe plan --calibrate` took
    }

A dtype missing from ``achieved_tflops.matmul`` is one the device cannot compute in: ``float8``
only where the device has float8 tensor cores (the planner offers float8 only then). Bus
bandwidth B means a ring collective over n ranks of S bytes takes ``(n - 1) * latency +
factor * S / B`` with factor ``(n - 1) / n`` (all-gather, reduce-scatter, all-to-all) or
``2 (n - 1) / n`` (all-reduce); point to point takes ``latency + S / B``.

`torchmoe plan --calibrate OUT.json` (`torchmoe.commands.calibrate`) measures the machine it runs on and
writes such a file; ``--hardware OUT.json`` then plans with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from torchmoe.config.errors import ConfigError
from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import path_faults
from torchmoe.config.files.text import NotUTF8, utf8_text
from torchmoe.nn import attention_kernel_choice

__all__ = ["BUILTIN_PROFILES", "COLLECTIVES", "OP_CLASSES", "PROFILE_FORMAT", "HardwareProfile", "Link",
           "in_profile_range", "load_profile", "profile_from_dict", "profile_to_dict"]

PROFILE_FORMAT = "torchmoe-hardware-profile"
PROFILE_VERSION = 1
OP_CLASSES = ("matmul", "attention", "grouped_mm")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")
# Bytes a collective moves per rank for S bytes of output, in units of S / bandwidth (ring algorithms).
_RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "all_reduce": 2.0}


@dataclass(frozen=True)
class Link:
    """A link's cost: a fixed latency per message step and a per-rank bus bandwidth."""

    latency_us: float
    bandwidth_gbs: float

    def seconds(self, collective: str, nbytes: float, ranks: int) -> float:
        """Seconds `collective` over `ranks` ranks takes for `nbytes` bytes (its output's size for
        all-gather, its input's for reduce-scatter, the buffer for all-reduce and all-to-all, the
        message for p2p)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if collective == "p2p":
            return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)
        steps = ranks - 1
        return (steps * self.latency_us * 1e-6
                + _RING_FACTOR[collective] * steps / ranks * nbytes / (self.bandwidth_gbs * 1e9))

    def in_profile_range(self) -> Link:
        """This link with its latency and bandwidth moved into the ranges a profile holds."""
        return Link(in_profile_range(self.latency_us, "microseconds"), in_profile_range(self.bandwidth_gbs, "rate"))


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind and its links (see the module docstring for each field)."""

    name: str
    source: str
    memory_gib: float
    gpus_per_node: int
    peak_tflops: dict[str, float]
    achieved_tflops: dict[str, dict[str, float]]
    memory_bandwidth_gbs: float
    kernel_overhead_us: float
    overlap: float
    intra_node: Link
    inter_node: Link
    attention_head_dim: int = 0
    collectives: dict[str, Link] = field(default_factory=dict)
    measurements: dict = field(default_factory=dict)
    device: str = "cuda"
    compute_capability: tuple[int, int] | None = (8, 0)

    @property
    def has_float8(self) -> bool:
        return "float8" in self.achieved_tflops["matmul"]

    def rate(self, op_class: str, dtype: str) -> float:
        """Achieved FLOP/s of `op_class` in `dtype`; an op class measured without that dtype
        falls back to its bfloat16 rate scaled like the matmuls (float8 attention runs in bf16)."""
        rates = self.achieved_tflops[op_class]
        if dtype in rates:
            return rates[dtype] * 1e12
        if op_class == "attention" or dtype not in self.achieved_tflops["matmul"]:
            return rates["bfloat16" if "bfloat16" in rates else next(iter(rates))] * 1e12
        base = "bfloat16" if "bfloat16" in rates else next(iter(rates))
        scale = self.achieved_tflops["matmul"][dtype] / self.achieved_tflops["matmul"][base]
        return rates[base] * scale * 1e12

    def attention_kernel(self, dtype: str, head_dim: int) -> str:
        """The attention kernel a job in `dtype` with `head_dim`-wide heads runs on this device
        (`attention_kernel_choice.choose`; float8 jobs attend in bf16)."""
        dtype = "bfloat16" if dtype == "float8" else dtype
        return attention_kernel_choice.choose(self.device, dtype, head_dim, self.compute_capability)

    def peak(self, dtype: str) -> float:
        """Published dense peak FLOP/s in `dtype` (bfloat16's when the dtype has none listed)."""
        return self.peak_tflops.get(dtype, self.peak_tflops.get("bfloat16", max(self.peak_tflops.values()))) * 1e12

    def link(self, collective: str, inter_node: bool) -> Link:
        """The link `collective` crosses: the inter-node one when its group spans nodes, else the
        intra-node one (or this collective's own measurement of it)."""
        if inter_node:
            return self.inter_node
        return self.collectives.get(collective, self.intra_node)


def _link(lat: float, bw: float) -> dict:
    return {"latency_us": lat, "bandwidth_gbs": bw}


# Built-in profiles. Peaks are the vendors' published dense (no sparsity) tensor-core rates; the
# achieved rates are the planner's assumptions for well-shaped kernels, stated as fractions of
# peak so they can be compared and replaced by `--calibrate` on the real machine:
#   dense GEMMs 70% of peak (cuBLAS at the 4k-16k shapes of 17B-class models), grouped GEMMs 55%
#   (many smaller GEMMs per launch), causal flash attention forward + backward 45% (FlashAttention-2
#   reaches 50-73% of A100's peak; FA2 on H100 about 35-50%), float8 GEMMs 65% of the float8 peak
#   (scaling and casts around them), elementwise kernels at 80% of HBM bandwidth.
# Links are per-GPU bus bandwidths: NVLink's per-direction bandwidth at 80% (what nccl-tests'
# busbw reaches on 8 GPUs), and the node's network divided by its GPUs (one NIC per GPU) at 90%.
def _gpu(name: str, source: str, capability: tuple[int, int], memory_gib: float, bf16: float, fp32: float,
         fp8: float | None, hbm_gbs: float, nvlink_gbs: float, nic_gbs: float) -> dict:
    matmul = {"bfloat16": 0.70 * bf16, "float32": 0.70 * fp32}
    grouped = {"bfloat16": 0.55 * bf16, "float32": 0.55 * fp32}
    peak = {"bfloat16": bf16, "float32": fp32}
    if fp8 is not None:
        matmul["float8"] = 0.65 * fp8
        grouped["float8"] = 0.55 * fp8
        peak["float8"] = fp8
    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "source": source,
        "memory_gib": memory_gib, "gpus_per_node": 8, "peak_tflops": peak,
        "achieved_tflops": {"matmul": matmul, "attention": {"bfloat16": 0.45 * bf16, "float32": 0.45 * fp32},
                            "grouped_mm": grouped},
        "attention_head_dim": 0, "memory_bandwidth_gbs": 0.8 * hbm_gbs, "kernel_overhead_us": 4.0,
        "overlap": 0.9, "links": {"intra_node": _link(8.0, 0.8 * nvlink_gbs), "inter_node": _link(20.0, 0.9 * nic_gbs)},
        "device": "cuda", "compute_capability": list(capability),
    }


BUILTIN_PROFILES: dict[str, dict] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (TF32 tensor cores 494 dense, used for
    # fp32 matmuls), 1,979 FP8, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (450 per direction);
    # DGX H100: 8x 400 Gb/s ConnectX-7, 50 GB/s per GPU.
    "h100": _gpu("h100", "NVIDIA H100 SXM5 datasheet; DGX H100 networking (8x 400 Gb/s NDR)", (9, 0), 80.0,
                 989.0, 494.0, 1979.0, 3350.0, 450.0, 50.0),
    # H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
    "h200": _gpu("h200", "NVIDIA H200 SXM datasheet; 8x 400 Gb/s NDR per node", (9, 0), 141.0,
                 989.0, 494.0, 1979.0, 4800.0, 450.0, 50.0),
    # DGX B200: 72 PFLOP/s FP8 training over 8 GPUs (4,500 TFLOP/s dense FP8 each, 2,250 BF16,
    # TF32 1,100), 1,440 GB HBM3e (180 GB each) at 8 TB/s, NVLink 5 1.8 TB/s (900 per
    # direction), 8x 400 Gb/s ConnectX-7.
    "b200": _gpu("b200", "NVIDIA DGX B200 datasheet", (10, 0), 180.0, 2250.0, 1100.0, 4500.0, 8000.0, 900.0, 50.0),
    # A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, TF32 156, no FP8; HBM2e 2,039 GB/s;
    # NVLink 3 600 GB/s (300 per direction); DGX A100: 8x 200 Gb/s HDR, 25 GB/s per GPU.
    "a100": _gpu("a100", "NVIDIA A100 SXM4 80GB datasheet; DGX A100 networking (8x 200 Gb/s HDR)", (8, 0), 80.0,
                 312.0, 156.0, None, 2039.0, 300.0, 25.0),
}


# ---- reading and writing -----------------------------------------------------------------------


# What a device or link can be, for a profile's numbers: outside, a number is a typo or crafted, and
# planned with it a step takes 1e300 s or NaN (bandwidth 5e-324, latency 1e308). Rates from 1 GFLOP/s
# (1 MB/s) up, below the point where their product with 1e12 leaves floats (an ideal profile, as the
# tests use, may be near-infinitely fast); latencies up to 10 s.
RATE_RANGE = (1e-3, 1e12)  # TFLOP/s, GB/s
MICROSECONDS_RANGE = (0.0, 1e7)
_RATE = {"low": RATE_RANGE[0], "high": RATE_RANGE[1], "strict": False}
_MICROSECONDS = {"high": MICROSECONDS_RANGE[1], "strict": False}


def in_profile_range(value: float, kind: str) -> float:
    """`value` moved into the range a profile holds for its `kind`: "rate" (TFLOP/s, GB/s) or
    "microseconds" (latencies, kernel overhead). For a measurement that came out of it."""
    low, high = RATE_RANGE if kind == "rate" else MICROSECONDS_RANGE
    return min(max(value, low), high)


def _number(key: str, value: object, *, low: float = 0.0, high: float = math.inf, strict: bool = True) -> float:
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        ok = False
    if not ok or not (low < value if strict else low <= value) or value > high:
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ProfileError(key, value, f"must be a number {bound}" + (f" and <= {high:g}" if high < math.inf else ""))
    return float(value)


class ProfileError(Exception):
    """A field of a profile document that is missing or wrong (`load_profile` names the file)."""

    def __init__(self, key: str, value: object, problem: str) -> None:
        super().__init__(f"{key} = {value!r}: {problem}")
        self.key, self.value, self.problem = key, value, problem


def _table(data: dict, key: str) -> dict:
    value = data.get(key.rpartition(".")[2])
    if not isinstance(value, dict):
        raise ProfileError(key, value, "must be a table" if value is not None else "is missing")
    return value


def _rates(table: dict, key: str) -> dict[str, float]:
    known = ("float32", "bfloat16", "float16", "float8")
    out = {}
    for dtype, value in table.items():
        if dtype not in known:
            raise ProfileError(f"{key}.{dtype}", value, f"unknown dtype; use one of {', '.join(known)}")
        out[dtype] = _number(f"{key}.{dtype}", value, **_RATE)
    if not out:
        raise ProfileError(key, table, "needs at least one dtype's rate")
    return out


def _link_from(table: dict, key: str) -> Link:
    return Link(_number(f"{key}.latency_us", table.get("latency_us"), **_MICROSECONDS),
                _number(f"{key}.bandwidth_gbs", table.get("bandwidth_gbs"), **_RATE))


def profile_from_dict(data: object) -> HardwareProfile:
    """Check and read a profile document.

    Raises:
        ProfileError: the first field that is missing or wrong.
    """
    if not isinstance(data, dict):
        raise ProfileError("(document)", type(data).__name__, "must be a JSON object")
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError("format", data.get("format"), f'must be "{PROFILE_FORMAT}"')
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError("version", data.get("version"), f"must be {PROFILE_VERSION}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError("name", name, "must be a non-empty string")
    achieved = _table(data, "achieved_tflops")
    rates = {}
    for op in OP_CLASSES:
        rates[op] = _rates(_table(achieved, f"achieved_tflops.{op}"), f"achieved_tflops.{op}")
    unknown = set(achieved) - set(OP_CLASSES)
    if unknown:
        raise ProfileError(f"achieved_tflops.{sorted(unknown)[0]}", achieved[sorted(unknown)[0]],
                           f"unknown op class; use {', '.join(OP_CLASSES)}")
    links = _table(data, "links")
    collectives = data.get("collectives", {})
    if not isinstance(collectives, dict):
        raise ProfileError("collectives", collectives, "must be a table")
    for coll in collectives:
        if coll not in COLLECTIVES:
            raise ProfileError(f"collectives.{coll}", collectives[coll], f"unknown collective; use {', '.join(COLLECTIVES)}")
    gpn = data.get("gpus_per_node")
    if not isinstance(gpn, int) or isinstance(gpn, bool) or not 1 <= gpn <= 4096:
        raise ProfileError("gpus_per_node", gpn, "must be an integer from 1 to 4096")
    head_dim = data.get("attention_head_dim", 0)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or not 0 <= head_dim <= 65536:
        raise ProfileError("attention_head_dim", head_dim, "must be an integer from 0 to 65536")
    device = data.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ProfileError("device", device, 'must be "cuda" or "cpu"')
    capability = data.get("compute_capability", [8, 0] if device == "cuda" else None)
    if device == "cuda" and not (isinstance(capability, list) and len(capability) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 100 for x in capability)):
        raise ProfileError("compute_capability", capability, "must be [major, minor], e.g. [9, 0] for an H100")
    source = data.get("source", "")
    return HardwareProfile(
        name=name, source=source if isinstance(source, str) else str(source),
        memory_gib=_number("memory_gib", data.get("memory_gib"), high=1e5), gpus_per_node=gpn,
        peak_tflops=_rates(_table(data, "peak_tflops"), "peak_tflops"), achieved_tflops=rates,
        memory_bandwidth_gbs=_number("memory_bandwidth_gbs", data.get("memory_bandwidth_gbs"), **_RATE),
        kernel_overhead_us=_number("kernel_overhead_us", data.get("kernel_overhead_us"), **_MICROSECONDS),
        overlap=_number("overlap", data.get("overlap"), high=1.0, strict=False),
        intra_node=_link_from(_table(links, "links.intra_node"), "links.intra_node"),
        inter_node=_link_from(_table(links, "links.inter_node"), "links.inter_node"),
        attention_head_dim=head_dim,
        collectives={c: _link_from(_table(collectives, f"collectives.{c}"), f"collectives.{c}") for c in collectives},
        measurements=data.get("measurements", {}) if isinstance(data.get("measurements", {}), dict) else {},
        device=device, compute_capability=tuple(capability) if device == "cuda" else None,
    )


def profile_to_dict(profile: HardwareProfile) -> dict:
    """The JSON document of `profile` (what `profile_from_dict` reads back)."""
    def link(l: Link) -> dict:
        return _link(l.latency_us, l.bandwidth_gbs)

    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": profile.name, "source": profile.source,
        "memory_gib": profile.memory_gib, "gpus_per_node": profile.gpus_per_node,
        "peak_tflops": dict(profile.peak_tflops), "achieved_tflops": {k: dict(v) for k, v in profile.achieved_tflops.items()},
        "attention_head_dim": profile.attention_head_dim, "memory_bandwidth_gbs": profile.memory_bandwidth_gbs,
        "kernel_overhead_us": profile.kernel_overhead_us, "overlap": profile.overlap,
        "links": {"intra_node": link(profile.intra_node), "inter_node": link(profile.inter_node)},
        "collectives": {c: link(l) for c, l in profile.collectives.items()},
        "measurements": profile.measurements, "device": profile.device,
        **({"compute_capability": list(profile.compute_capability)} if profile.compute_capability else {}),
    }


def load_profile(name_or_path: str, *, key: str = "--hardware") -> HardwareProfile:
    """A built-in profile by name (h100, h200, b200, a100) or a profile JSON file.

    Raises:
        ConfigError: an unknown name that is no file either, a file the OS refuses, that is not
            UTF-8 JSON, or whose fields are wrong (naming the field).
    """
    if name_or_path in BUILTIN_PROFILES:
        return profile_from_dict(BUILTIN_PROFILES[name_or_path])
    names = ", ".join(BUILTIN_PROFILES)
    fix = f"use a built-in profile ({names}) or a JSON file from `torchmoe plan --calibrate OUT.json`"
    path = Path(name_or_path)
    if not name_or_path.endswith(".json") and not path.exists():
        raise ConfigError(key, name_or_path, "unknown hardware profile", fix)
    with path_faults(key, name_or_path, fix):
        raw = path.read_bytes()
    try:
        # Not `finite`: `profile_from_dict` checks every number it uses, naming its field.
        data = json_loads(utf8_text(raw, nul=False), finite=False)
    except NotUTF8 as err:
        raise ConfigError(key, name_or_path, err.problem, err.fix(path)) from None
    except json.JSONDecodeError as err:
        raise ConfigError(key, name_or_path, f"not valid JSON: {err}", fix) from None
    try:
        return profile_from_dict(data)
    except ProfileError as err:
        raise ConfigError(key, name_or_path, f"{err.key} = {json.dumps(err.value)[:80]}: {err.problem}",
                          "fix that field (docs/planner.md lists every field), or calibrate again") from None
