"""Semi-synchronous training across replica groups (`distributed.semi_sync`) against hand
computations and torch's own SGD, on a fake of `ReplicaGroups` (a second group's tensors):
DiLoCo's outer step, local SGD, streaming DiLoCo's fragments, delay and mixing, the expert biases
syncing with their block's fragment, and a sync's order of collectives.

    python -m pytest -q tests/unit/test_semi_sync.py

(Groups training semi-synchronously: tests/distributed/test_fault_tolerance.py.)
"""

from __future__ import annotations

import pytest
import torch

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import FaultTolerance
from torchmoe.distributed.semi_sync import SemiSync, fragments_of


class _TwoGroups:
    """`ReplicaGroups` as this rank sees it when a second group holds `other`: averaging takes the
    mean with the other group's tensors (in the order given), when its wait is called; commit
    says `commits`. `calls` records the order of the calls."""

    def __init__(self, other: list[torch.Tensor], *, commits: bool = True) -> None:
        self.other, self.commits, self.calls = other, commits, []

    def begin_step(self) -> None:
        self.calls.append("begin_step")

    def start_average(self, tensors: list[torch.Tensor], *, quantize: bool = False):
        self.calls.append("start_average")
        theirs = list(self.other)

        def wait() -> None:
            for mine, other in zip(tensors, theirs, strict=True):
                mine.copy_((mine + other) / 2)
        return wait

    def reduce(self, loss, counts, grads, position):
        self.calls.append("reduce")
        return loss, counts

    def commit(self, step: int) -> bool:
        return self.commits


def _semi_sync(method: str, params: list[torch.Tensor], groups, biases: list[torch.Tensor], *, names=None,
               blocks=None, **keys):
    """`SemiSync` over `params` (named `names`, by default one block each) and `biases` (block i's
    is the i-th)."""
    cfg = FaultTolerance(enable=True, group_size=2, semi_sync_method=method, **keys)
    names = names or [f"layers.{i}.w" for i in range(len(params))]
    named_biases = [(f"layers.{i}.moe.expert_bias", bias) for i, bias in enumerate(biases)]
    return SemiSync(groups, cfg, lambda: list(zip(names, params)), named_biases,
                    layer_ids=range(blocks or len(params)))


def test_diloco_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient() -> None:
    """Two syncs of one rank against a hand computation and against torch's own SGD (lr 0.7,
    momentum 0.9, Nesterov) stepped on the averaged pseudo-gradient, to 1e-6."""
    gen = torch.Generator().manual_seed(0)
    theta0 = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    params = [t.clone() for t in theta0]
    groups = _TwoGroups([])
    sync = _semi_sync("diloco", params, groups, [torch.zeros(2)], outer_lr=0.7, outer_momentum=0.9)
    reference = [torch.nn.Parameter(t.clone()) for t in theta0]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    anchor, momentum = [t.clone() for t in theta0], None
    for _ in range(2):
        mine = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]  # this group's inner steps
        theirs = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]
        for p, step in zip(params, mine):
            p.sub_(step)
        # The other group's pseudo-gradient (anchor - its θ), and its expert bias.
        groups.other = [*theirs, torch.ones(2)]
        assert sync.after_step(5, []) == {"ft_synced": True, "ft_fragment": 0}
        delta = [(m + t) / 2 for m, t in zip(mine, theirs)]  # mean of (anchor - θ_g)
        momentum = delta if momentum is None else [0.9 * m + d for m, d in zip(momentum, delta)]
        anchor = [a - 0.7 * (d + 0.9 * m) for a, d, m in zip(anchor, delta, momentum)]
        for ref, d in zip(reference, delta):
            ref.grad = d.clone()
        outer.step()
        for got, hand, torch_sgd in zip(params, anchor, reference):
            assert torch.allclose(got, hand, rtol=0, atol=1e-6)
            assert torch.allclose(got, torch_sgd.detach(), rtol=0, atol=1e-6)
        assert all(torch.equal(a, p) for a, p in zip(sync.anchor, params))  # the next sync's anchor
    # alpha 0: the bias is the mean, to the bit, as the parameters are the outer step's.
    assert torch.equal(sync.biases[0], torch.full((2,), 0.75))  # 0 -> 0.5 -> 0.75
    assert groups.calls == ["begin_step", "reduce", "start_average"] * 2


def test_local_sgd_averages_parameters_and_biases_and_a_failed_sync_changes_nothing() -> None:
    params, bias = [torch.zeros(3), torch.ones(2)], torch.zeros(4)
    groups = _TwoGroups([torch.full((3,), 2.0), torch.full((2,), 3.0), torch.ones(4)], commits=False)
    sync = _semi_sync("local_sgd", params, groups, [bias], sync_steps=5)
    assert [sync.fragment_at(s) for s in (4, 5, 10)] == [None, 0, 0]
    assert sync.after_step(4, []) is None
    assert sync.after_step(5, []) == {"ft_synced": False, "ft_fragment": 0}
    assert torch.equal(params[0], torch.zeros(3)) and torch.equal(bias, torch.zeros(4))
    groups.commits = True
    assert sync.after_step(10, [])["ft_synced"]
    assert torch.equal(params[0], torch.ones(3)) and torch.equal(params[1], torch.full((2,), 2.0))
    assert torch.equal(bias, torch.full((4,), 0.5))
    assert sync.state_dict() == {"anchor": [], "momentum": []}


def test_streaming_diloco_syncs_fragments_in_turn_with_delay_and_mixing_against_a_hand_computation() -> None:
    """2 fragments (the embedding with block 0, block 1 with the head), sync_steps 4: fragment 0
    syncs at steps 2 and 6, fragment 1 at 4 and 8; each pseudo-gradient is taken a step before
    (delay 1), and a synced fragment's parameters become 0.75 x the outer step's + 0.25 x this
    group's own (alpha 0.25). Outer SGD: lr 0.7, Nesterov momentum 0.9, per fragment.

    Each block's expert bias moves at every inner step (as the routers' counts move it) and syncs
    with its block's fragment: taken with the pseudo-gradient, averaged, and mixed as the
    parameters are, 0.75 x the mean + 0.25 x its own at the sync; the other block's keeps its own
    progress. (Every bias was overwritten at every sync by the mean of the biases as they were a
    step before.)"""
    names = ["tok_embeddings.weight", "layers.0.w", "layers.1.w", "output.weight"]
    gen = torch.Generator().manual_seed(1)
    theta0 = [torch.randn(3, generator=gen) for _ in names]
    params = [t.clone() for t in theta0]
    biases = [torch.zeros(2), torch.zeros(2)]
    groups = _TwoGroups([])
    sync = _semi_sync("diloco", params, groups, biases, names=names, blocks=2, sync_steps=4, num_fragments=2,
                      fragment_sync_delay=1, fragment_update_alpha=0.25, outer_lr=0.7, outer_momentum=0.9)
    assert sync.fragments == [[0, 1], [2, 3]] and sync.bias_fragments == [[0], [1]]
    anchor, momentum = [t.clone() for t in theta0], [torch.zeros(3) for _ in names]
    synced = []
    for step in range(1, 9):
        for p in params:  # this group's inner step
            p.sub_(torch.randn(3, generator=gen) * 0.1)
        for b in biases:
            b.add_(torch.randn(2, generator=gen) * 0.01)
        if step % 2:  # a fragment's pseudo-gradient and bias are taken: the other group's are `theirs`
            fragment, block = ([0, 1], 0) if step % 4 == 1 else ([2, 3], 1)
            theirs = [torch.randn(3, generator=gen) * 0.1 for _ in fragment]
            their_bias = torch.randn(2, generator=gen) * 0.01
            groups.other = [*theirs, their_bias]
            deltas = [((anchor[i] - params[i]) + t) / 2 for i, t in zip(fragment, theirs)]
            mean_bias = (biases[block] + their_bias) / 2
            assert sync.after_step(step, []) is None
            continue
        local, local_biases = [p.clone() for p in params], [b.clone() for b in biases]
        report = sync.after_step(step, [])
        assert report == {"ft_synced": True, "ft_fragment": block}, step
        synced.append((step, report["ft_fragment"]))
        for i, delta in zip(fragment, deltas):
            momentum[i] = 0.9 * momentum[i] + delta
            anchor[i] = anchor[i] - 0.7 * (delta + 0.9 * momentum[i])
            assert torch.allclose(sync.anchor[i], anchor[i], rtol=0, atol=1e-6), (step, i)
            assert torch.allclose(params[i], 0.75 * anchor[i] + 0.25 * local[i], rtol=0, atol=1e-6), (step, i)
        for i in {0, 1, 2, 3} - set(fragment):  # the other fragment is untouched
            assert torch.equal(params[i], local[i]), (step, i)
        assert torch.allclose(biases[block], 0.75 * mean_bias + 0.25 * local_biases[block], rtol=0, atol=1e-8), step
        assert torch.equal(biases[1 - block], local_biases[1 - block]), step
    assert synced == [(2, 0), (4, 1), (6, 0), (8, 1)]
    # The small collective first (layouts and positions), then the transfer that nothing waits for.
    assert groups.calls == ["begin_step", "reduce", "start_average"] * 4


def test_fragments_split_the_blocks_in_contiguous_runs() -> None:
    names = ["tok_embeddings.weight", *(f"layers.{i}.attention._checkpoint_wrapped_module.wq.weight" for i in range(5)),
             "mtp.5.enorm.weight", "layers.5.moe.router.weight", "norm.weight", "output.weight"]
    assert fragments_of(names, range(6), 3) == [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9]]
    biases = [f"layers.{i}._checkpoint_wrapped_module.moe.expert_bias" for i in (1, 3, 5)]
    assert fragments_of(biases, range(6), 3) == [[0], [1], [2]]
    with pytest.raises(ConfigError, match="must be at most the model's 6 blocks"):
        fragments_of(names, range(6), 7)
