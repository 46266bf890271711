"""The EP all-to-all dispatcher delivers every routed row to the right expert and back, exactly,
including experts that receive no tokens at all; gradients flow back through both exchanges,
with other work on the tokens run between the phases (as the MoE layer runs its shared expert).
Padding (tokens that are no data) is sent nowhere: the data's outputs and gradients are the
single rank's, the padding's routed output is zero, and only the data's rows cross."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.launch import free_port

pytestmark = pytest.mark.distributed
EP, NUM_EXPERTS, TOP_K, DIM = 2, 8, 2, 16


class ScaleByExpert(torch.nn.Module):
    """Stands in for the experts: multiplies each row by (global expert id + 1), so a row that
    reached the wrong expert, or came back to the wrong place, changes the result."""

    float8_grouped_mm = None  # as GroupedExperts unconverted: no float8 block alignment

    def __init__(self, first_expert: int) -> None:
        super().__init__()
        self.first_expert = first_expert

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.repeat_interleave(torch.arange(counts.numel()), counts) + self.first_expert
        return rows * (ids + 1).unsqueeze(-1).to(rows.dtype)


def _route(dispatcher, tokens, gates, selected, counts, experts, real=None):
    """The dispatcher's phases with work on the tokens in both exchange windows, as `MoE.forward`."""
    routed = dispatcher.dispatch(tokens, gates, selected, counts, True, real)
    side = torch.tanh(tokens)
    dispatcher.run_experts(routed, experts)
    return dispatcher.combine(routed) + side * 3


def _worker(rank: int, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchmoe.distributed.expert_parallel import AllToAllDispatcher
    from torchmoe.nn.dispatch import TokenDispatcher, copies_per_expert

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP)
    mesh = init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",))
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randn(12 + 5 * rank, DIM, generator=gen, requires_grad=True)  # uneven token counts
    # Only experts 1, 2 and 6 are ever chosen: 0, 3, 4, 5, 7 receive nothing.
    choices = torch.tensor([[1, 6], [2, 1], [6, 2]])
    selected = choices[torch.randint(0, 3, (tokens.shape[0],), generator=gen)]
    gates = torch.rand(tokens.shape[0], TOP_K, generator=gen)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64).scatter_add_(
        0, selected.flatten(), torch.ones(selected.numel(), dtype=torch.int64))

    ep = AllToAllDispatcher(NUM_EXPERTS, TOP_K, mesh)
    out = _route(ep, tokens, gates, selected, counts, ScaleByExpert(rank * NUM_EXPERTS // EP))
    out.sum().backward()
    ep_grad = tokens.grad.clone()
    tokens.grad = None
    ref = _route(TokenDispatcher(NUM_EXPERTS, TOP_K), tokens, gates, selected, counts, ScaleByExpert(0))
    ref.sum().backward()
    result = [torch.equal(out, ref), torch.equal(ep_grad, tokens.grad), ep.bytes_sent,
              int(counts[NUM_EXPERTS // EP * (1 - rank):][: NUM_EXPERTS // EP].sum())]

    # The last 4 tokens are padding, all on experts 1 and 6 (one on each rank). The reference: the
    # single rank's dispatch with the padding's gates zero (its routed output then exactly 0).
    real = torch.arange(tokens.shape[0]) < tokens.shape[0] - 4
    padded = torch.where(real[:, None], selected, torch.tensor([1, 6]))
    counts = copies_per_expert(padded, NUM_EXPERTS)
    tokens.grad = None
    ep = AllToAllDispatcher(NUM_EXPERTS, TOP_K, mesh)
    out = _route(ep, tokens, gates, padded, counts, ScaleByExpert(rank * NUM_EXPERTS // EP), real)
    out.sum().backward()
    ep_grad = tokens.grad.clone()
    tokens.grad = None
    ref = _route(TokenDispatcher(NUM_EXPERTS, TOP_K), tokens, gates * real[:, None], padded, counts, ScaleByExpert(0))
    ref.sum().backward()
    data = copies_per_expert(padded, NUM_EXPERTS, real)
    result += [torch.equal(out, ref), torch.equal(ep_grad, tokens.grad), ep.bytes_sent,
               int(data[NUM_EXPERTS // EP * (1 - rank):][: NUM_EXPERTS // EP].sum())]
    queue.put((rank, *result))
    dist.destroy_process_group()


def test_dispatch_combine_round_trip_is_exact():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(EP)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, *cases in results:
        for same_out, same_grad, bytes_sent, remote_rows in (cases[:4], cases[4:]):  # all data; padded
            assert same_out and same_grad, rank
            # Bytes: dispatch and combine each move the rows bound for the other rank's experts
            # (with padding: the data's only).
            assert bytes_sent == 2 * remote_rows * DIM * 4, rank
