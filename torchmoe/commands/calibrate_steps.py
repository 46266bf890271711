"""What `calibrate` measures, one step at a time: the ranks measuring together (`World`), each
compute step at the job's shapes (a matmul, float8's three GEMMs, attention, the routed experts'
grouped GEMMs, an elementwise stream, a chain of tiny kernels) and each collective by message
size, with the link model's fit of a collective's (bytes, seconds) table (`fit_link`) and the
overlap that running compute and communication at once showed (`overlap_fraction`).

A step is ``(step, its work)``: a callable run as often as the budget allows, and the FLOPs,
bytes or kernels one call does, on tensors made once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmoe.nn.attention import causal_attention
from torchmoe.nn.dispatch import TokenDispatcher
from torchmoe.nn.experts import GroupedExperts
from torchmoe.plan.hardware import Link

_TINY_OPS = 32  # multiplications in the kernel-overhead chain
_MIN_MESSAGE = 4 * 2**10
_MAX_MESSAGE = {"cpu": 4 * 2**20, "cuda": 64 * 2**20}


# ---- the link model's fit ----------------------------------------------------------------------------


def fit_link(collective: str, ranks: int, table: Sequence[tuple[float, float]]) -> Link:
    """The `Link` whose ``seconds(collective, bytes, ranks)`` best fits the measured
    ``(bytes, seconds)`` rows of `table` (two distinct sizes at least): least squares of the
    relative error (the sizes span three orders of magnitude: plain least squares would let the
    largest messages' noise set the latency). Exact on times that follow the model.

    The model is linear in (latency, 1 / bandwidth): ``t = a * latency + b(S) / bandwidth``, with
    ``a`` and ``b`` read off `Link.seconds` itself (so the fit cannot drift from the planner's
    formula). A negative latency is refitted as 0; times that do not grow with the size (no
    measurable bandwidth) get the latency alone fitted, and the largest message's rate (latency
    included: a lower bound) as the bandwidth.
    """
    a = Link(1e6, math.inf).seconds(collective, 1.0, ranks)  # seconds per second of latency
    b = [Link(0.0, 1e-9).seconds(collective, size, ranks) for size, _ in table]  # seconds at 1 B/s
    t = [seconds for _, seconds in table]
    # Rows divided by t: minimise sum((a * lat + b_i * inv - t_i) / t_i)^2 over (lat, inv).
    saa = sum((a / ti) ** 2 for ti in t)
    sab = sum(a * bi / ti**2 for bi, ti in zip(b, t))
    sbb = sum((bi / ti) ** 2 for bi, ti in zip(b, t))
    sa = sum(a / ti for ti in t)
    sb = sum(bi / ti for bi, ti in zip(b, t))
    det = saa * sbb - sab**2
    lat, inv = (sbb * sa - sab * sb) / det, (saa * sb - sab * sa) / det
    if inv <= 0:  # all latency: the latency alone fits, and the largest message's rate bounds B from below
        big = max(range(len(t)), key=lambda i: b[i])
        return Link(sa / saa * 1e6, b[big] / t[big] / 1e9)
    if lat < 0:
        lat, inv = 0.0, sb / sbb
    return Link(lat * 1e6, 1 / inv / 1e9)


# ---- the ranks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """The ranks measuring together (one: no process group)."""

    rank: int
    size: int
    local_size: int
    device: torch.device

    def sync(self) -> None:
        """Wait for the device's queued work (the host's clock times it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank here, the device idle: what each measurement starts from."""
        if self.size > 1:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.sync()

    def reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        """`values` reduced elementwise over the ranks (`op` SUM or MAX)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return dict(zip(values, (v / self.size for v in self.reduce(list(values.values()), dist.ReduceOp.SUM))))

    def slowest(self, values: dict[str, float]) -> dict[str, float]:
        return dict(zip(values, self.reduce(list(values.values()), dist.ReduceOp.MAX)))


# ---- compute steps: (step, its work), on tensors made once --------------------------------------------


def shrink(sizes: dict[str, int], order: Sequence[tuple[str, int]], fits: Callable[[dict[str, int]], bool]
            ) -> dict[str, int]:
    """`sizes` with the first size of `order` that stays at or above its floor halved, again and
    again, until `fits` holds (or nothing can shrink)."""
    sizes = dict(sizes)
    while not fits(sizes):
        name = next((name for name, floor in order if sizes[name] // 2 >= floor), None)
        if name is None:
            break
        sizes[name] //= 2
    return sizes


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def matmul_step(s: dict[str, int], dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], object], float]:
    """nn.Linear's forward and backward: x (tokens, in) @ w (out, in).T, and both gradients."""
    x = _randn(s["tokens"], s["in"], dtype=dtype, device=device, grad=True)
    w = _randn(s["out"], s["in"], dtype=dtype, device=device, grad=True)
    g = _randn(s["tokens"], s["out"], dtype=dtype, device=device)
    return (lambda: torch.autograd.grad(F.linear(x, w), (x, w), g)), 6.0 * s["tokens"] * s["in"] * s["out"]


def _to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` scaled into `dtype`'s range by its absolute maximum (tensorwise dynamic scaling, as
    float8 training casts), and the inverse scale (0-d fp32) that decodes it."""
    scale = torch.finfo(dtype).max / t.abs().max().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D) with the same values laid out column by column (what a GEMM's second operand wants)."""
    return t.t().contiguous().t()


def float8_linear_matmuls(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three GEMMs of a float8 linear's forward and backward, casts included: ``x @ w.T``,
    ``g @ w`` and ``g.T @ x`` (e4m3 inputs and weights, e5m2 gradients, tensorwise scales).
    x: (T, in), w: (out, in), g: (T, out) in bf16 -> (T, out), (T, in), (out, in) in bf16."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    xq, sx = _to_float8(x, e4m3)
    wq, sw = _to_float8(w, e4m3)
    gq, sg = _to_float8(g, e5m2)

    def mm(a, sa, b, sb):
        return F.scaled_mm(a, b, sa, F.ScalingType.TensorWise, sb, F.ScalingType.TensorWise, output_dtype=x.dtype)

    return (mm(xq, sx, wq.t(), sw), mm(gq, sg, _column_major(wq), sw),
            mm(gq.t().contiguous(), sg, _column_major(xq), sx))


def float8_step(s: dict[str, int], device: torch.device) -> tuple[Callable[[], object], float]:
    """`float8_linear_matmuls` at the matmul's shapes, each a multiple of 16 (the kernels' rule)."""
    t, i, o = (max(16, s[k] // 16 * 16) for k in ("tokens", "in", "out"))
    x, w, g = (_randn(*shape, dtype=torch.bfloat16, device=device) for shape in ((t, i), (o, i), (t, o)))
    return (lambda: float8_linear_matmuls(x, w, g)), 6.0 * t * i * o


def attention_step(s: dict[str, int], dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], object], float]:
    """`causal_attention` forward and backward: q (batch, kv_heads * heads_per_kv, seq, head_dim),
    k and v (batch, kv_heads, seq, head_dim)."""
    b, kv, group, n, head_dim = s["batch"], s["kv_heads"], s["heads_per_kv"], s["seq"], s["head_dim"]
    q = _randn(b, kv * group, n, head_dim, dtype=dtype, device=device, grad=True)
    k, v = (_randn(b, kv, n, head_dim, dtype=dtype, device=device, grad=True) for _ in range(2))
    g = torch.randn_like(q)
    flops = 12.0 * kv * group * head_dim * (n / 2) * b * n
    return (lambda: torch.autograd.grad(causal_attention(q, k, v), (q, k, v), g)), flops


def grouped_step(s: dict[str, int], top_k: int, use_grouped_mm: bool, dtype: torch.dtype, device: torch.device
                  ) -> tuple[Callable[[], object], float]:
    """The routed experts as the MoE layer runs them (`TokenDispatcher.run_local_experts`: padded
    expert blocks where the kernel wants them), forward and backward, rows spread evenly."""
    e, rows_per, dim, hidden = s["experts"], s["rows_per_expert"], s["dim"], s["hidden"]
    experts = GroupedExperts(dim, hidden, e, use_grouped_mm).to(device=device, dtype=dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    x = _randn(e * rows_per, dim, dtype=dtype, device=device, grad=True)
    counts = torch.full((e,), rows_per, dtype=torch.int64, device=device)
    g = torch.randn_like(x)
    dispatcher = TokenDispatcher(e, top_k)
    inputs = (x, *experts.parameters())
    step = lambda: torch.autograd.grad(dispatcher.run_local_experts(x, counts, experts), inputs, g)
    return step, 18.0 * dim * hidden * e * rows_per


def stream_step(n: int, device: torch.device) -> tuple[Callable[[], object], float]:
    """``silu(x) * w`` and its gradient in x on n fp32 elements: 11 passes of 4n bytes."""
    x = _randn(n, dtype=torch.float32, device=device, grad=True)
    w, g = _randn(n, dtype=torch.float32, device=device), _randn(n, dtype=torch.float32, device=device)
    return (lambda: torch.autograd.grad(F.silu(x) * w, x, g)), 11.0 * 4 * n


def tiny_step(device: torch.device) -> tuple[Callable[[], object], float]:
    """`_TINY_OPS` multiplications of a 1-element tensor and their gradients: one kernel each."""
    x = torch.ones(1, device=device, requires_grad=True)
    g = torch.ones(1, device=device)

    def step():
        y = x
        for _ in range(_TINY_OPS):
            y = y * 1.0001
        return torch.autograd.grad(y, x, g)

    return step, 2.0 * _TINY_OPS


# ---- collectives ---------------------------------------------------------------------------------


def message_sizes(device_type: str) -> list[int]:
    sizes = [_MIN_MESSAGE]
    while sizes[-1] * 4 <= _MAX_MESSAGE[device_type]:
        sizes.append(sizes[-1] * 4)
    return sizes


def collective_step(name: str, nbytes: int, world: World) -> tuple[Callable[[], object], int]:
    """One `name` collective of about `nbytes` (`Link.seconds`'s size: the all-gather's output,
    the reduce-scatter's input, the buffer, the message) over float32 tensors, and its exact size."""
    n = world.size
    numel = max(n, nbytes // 4 // n * n)
    # zeros: repeated all-reduces of them stay zeros (ones would grow to inf within ~100 calls)
    full = torch.zeros(numel, device=world.device)
    other = torch.empty_like(full)
    shard = torch.zeros(numel // n, device=world.device)
    steps = {
        "all_gather": lambda: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_reduce": lambda: dist.all_reduce(full),
        "all_to_all": lambda: dist.all_to_all_single(other, full),
        # batched: NCCL pairs a send and a receive with the same peer only inside one group
        "p2p": lambda: [work.wait() for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, (world.rank + 1) % n), dist.P2POp(dist.irecv, other, (world.rank - 1) % n)])],
    }
    return steps[name], numel * 4


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of compute and communication that running both at once hid:
    ``(compute_s + comm_s - both_s) / min(compute_s, comm_s)``, clipped to [0, 1] (timing noise
    can put `both_s` below the longer one or above the sum)."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))
