"""Where a training step's time goes, from torch.profiler events: category -> seconds and share.

    with torch.profiler.profile(schedule=...) as prof:
        ...  # training steps, prof.step() after each
    table = step_breakdown(prof.events())
    print(format_breakdown(table))

Categories (`CATEGORIES`, in table order): attention, routed experts, shared/dense FFN, router +
dispatch/combine, communication, optimizer, data, compiled blocks (forward / backward) and
embedding/norms/loss/other. Shares sum to 1.

How time is counted: every microsecond of the training thread once. Each profiler event (op or
label) contributes its *self* time (its duration less its children's) to the category of the
innermost event that names one, itself included:

- a ``torchmoe/<region>`` label (`torchmoe.nn.profiler_regions`: model parts whose op names are ambiguous,
  such as a linear in attention or in an FFN; the data loader; gradient clipping);
- an op or label that is unambiguous by name: SDPA/flash/flex attention kernels, grouped GEMMs
  (``torchmoe::grouped_mm``, ``torchmoe::grouped_mm_weight_grad``, ``aten::_grouped_mm``),
  collectives (c10d, gloo, nccl, ``_c10d_functional``, FSDP's all-gather/reduce-scatter work),
  ``Optimizer.step``/``Optimizer.zero_grad``, torch.compile's regions;
- a backward node (and the ``autograd::engine::evaluate_function`` around it): the autograd
  engine runs it outside every forward label, so it takes the category of the forward op that
  created it, found through the profiler's own forward/backward flow link (the event pair that
  traces draw as an arrow). Backward time thus lands where its forward did.

Events without any of these are "embedding/norms/loss/other", as is the Python time of a step
outside every op (the self time of ``ProfilerStep#N``). The total is the traced steps' wall time
on the training thread when the profiler marks steps, else the time inside its recorded ops.
Time blocked in a collective or a ``wait`` is communication, wherever it is called from.

What it cannot split: inside a torch.compile'd block the labels are gone (the compiler drops
them), so the block's fused kernels count as "compiled blocks (forward)" and its backward as
"compiled blocks (backward)"; only ops that stay ops in the compiled graph (grouped GEMM custom
ops, attention kernels the compiler calls as they are, collectives) keep their own category.
Other threads are not counted (on CPU the backward runs on the training thread; gloo's workers
show as the training thread's wait). On CUDA this is host time: kernels run asynchronously and
their time is not in it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from torchmoe.nn.profiler_regions import PREFIX, REGIONS

# key -> what the table calls it, in table order.
CATEGORIES: dict[str, str] = {
    "attention": "attention",
    "routed_experts": "routed experts",
    "ffn": "shared/dense FFN",
    "router": "router + dispatch/combine",
    "communication": "communication",
    "optimizer": "optimizer",
    "data": "data",
    "compiled_forward": "compiled blocks (forward)",
    "compiled_backward": "compiled blocks (backward)",
    "other": "embedding/norms/loss/other",
}
assert set(REGIONS) <= set(CATEGORIES)

# Ops and labels unambiguous by name: (category, name prefixes, name substrings).
_BY_NAME: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("compiled_backward", ("CompiledFunctionBackward",), ()),
    ("compiled_forward", ("Torch-Compiled Region",), ()),
    ("routed_experts", ("torchmoe::grouped_mm", "aten::_grouped_mm"), ()),
    ("attention", (), ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                       "flex_attention")),
    ("communication", ("c10d::", "c10d_functional::", "_c10d_functional::", "_c10d_functional_autograd::",
                       "gloo:", "nccl:", "record_param_comms", "FSDP::", "fsdp::"), ("all_to_all", "wait_tensor")),
    ("optimizer", ("Optimizer.step#", "Optimizer.zero_grad#"), ()),
)
# The autograd engine's wrapper around each backward node (the node's event is its child).
_EVALUATE = "autograd::engine::evaluate_function:"
# Kineto's flow type linking a forward op to the backward node it created.
_FWD_BWD_FLOW = 1
# Step marks: `ProfilerStep#N` in traces, `ProfilerStep*` in `prof.events()`.
_STEP = "ProfilerStep"


@dataclass
class Breakdown:
    """Seconds per category over `steps` traced steps (every category of `CATEGORIES`)."""

    seconds: dict[str, float]
    steps: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def share(self, category: str) -> float:
        return self.seconds[category] / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        """JSON-ready: steps, seconds per step, and per category its name, seconds per step and share."""
        return {"steps": self.steps, "seconds_per_step": self.total / self.steps,
                "categories": {key: {"name": CATEGORIES[key], "seconds_per_step": self.seconds[key] / self.steps,
                                     "share": self.share(key)} for key in CATEGORIES}}


def _by_name(name: str) -> str | None:
    if name.startswith(PREFIX) and name[len(PREFIX):] in REGIONS:
        return name[len(PREFIX):]
    for category, prefixes, parts in _BY_NAME:
        if name.startswith(prefixes) or any(part in name for part in parts):
            return category
    return None


class _Categorizer:
    """The category of each event: its own (`_by_name`, or its forward op's for a backward node),
    else its parent's; "other" at the root."""

    def __init__(self, events: list[FunctionEvent]) -> None:
        forward_of = {e.flow_id: e for e in events if e.flow_type == _FWD_BWD_FLOW and e.flow_start}
        # id(backward event) -> the forward op that created its node; the engine's wrapper too.
        self._linked: dict[int, FunctionEvent] = {}
        for e in events:
            if e.flow_type == _FWD_BWD_FLOW and not e.flow_start and e.flow_id in forward_of:
                self._linked[id(e)] = forward_of[e.flow_id]
                if e.cpu_parent is not None and e.cpu_parent.name.startswith(_EVALUATE):
                    self._linked[id(e.cpu_parent)] = forward_of[e.flow_id]
        self._memo: dict[int, str] = {}

    def __call__(self, event: FunctionEvent) -> str:
        # Walk up to the first event with a category of its own (iteratively: deep stacks).
        chain, found = [], None
        e: FunctionEvent | None = event
        while e is not None:
            found = self._memo.get(id(e)) or _by_name(e.name)
            if found is None and id(e) in self._linked:
                found = self(self._linked[id(e)])  # a forward op: never linked itself
            if found is not None:
                break
            chain.append(e)
            e = e.cpu_parent
        found = found or "other"
        for c in chain:
            self._memo[id(c)] = found
        if e is not None:
            self._memo[id(e)] = found
        return found


def _training_thread(events: list[FunctionEvent]) -> int:
    """The thread that marks the steps, else the one with the most time in root events."""
    for e in events:
        if e.name.startswith(_STEP):
            return e.thread
    busy: dict[int, float] = defaultdict(float)
    for e in events:
        if e.cpu_parent is None:
            busy[e.thread] += e.time_range.elapsed_us()
    return max(busy, key=busy.get)


def attribute(events: Iterable[FunctionEvent]) -> list[tuple[FunctionEvent, str, float]]:
    """Each event of the training thread with its category and self time in seconds (see the
    module doc); the self times sum to the thread's profiled time.

    Args:
        events: a profile's events (``prof.events()``), CPU activity recorded; device events
            are ignored.
    """
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if not cpu:
        return []
    categorize = _Categorizer(cpu)
    thread = _training_thread(cpu)
    return [(e, categorize(e), (e.time_range.elapsed_us() - sum(c.time_range.elapsed_us() for c in e.cpu_children))
             / 1e6) for e in cpu if e.thread == thread]


def step_breakdown(events: Iterable[FunctionEvent]) -> Breakdown:
    """The training thread's time per category of `CATEGORIES`, over the profile's steps: its
    ``ProfilerStep`` marks, or 1 for a profile without them. `events` as for `attribute`."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    steps = 0
    for event, category, own in attribute(events):
        seconds[category] += own
        steps += event.name.startswith(_STEP)
    return Breakdown(seconds, max(steps, 1))


def format_breakdown(table: dict) -> str:
    """A readable table of `Breakdown.to_dict()`: one line per category, largest share first,
    categories without time left out."""
    rows = sorted(table["categories"].values(), key=lambda r: -r["share"])
    width = max(len(r["name"]) for r in rows)
    steps = table["steps"]
    lines = [f"step-time breakdown over {steps} step{'s' if steps != 1 else ''}: "
             f"{table['seconds_per_step']:.3f} s per step",
             f"  {'category':<{width}}  {'s/step':>8}  {'share':>6}"]
    lines += [f"  {r['name']:<{width}}  {r['seconds_per_step']:>8.4f}  {100 * r['share']:>5.1f}%"
              for r in rows if r["seconds_per_step"] > 0]
    return "\n".join(lines)
