"""Layout-independent initialisation (`torchmoe/nn/init.py`): a shard's values are the full
tensor's values at the shard's place, and the declared distributions are what is drawn."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.init import (
    Normal,
    TruncNormal,
    check_box_layout,
    fill_shard_,
    init_parameters,
    rows_per_chunk,
)


def _full(init, shape: tuple[int, ...], seed: int = 3) -> torch.Tensor:
    out = torch.empty(shape)
    fill_shard_(out, init, seed=seed, name="p", global_shape=shape, offset=(0,) * len(shape))
    return out


@pytest.mark.parametrize("shape, offset, size", [
    ((3000, 700), (1400, 350), (1600, 300)),  # rows 1400-2999: three chunks (1497, 1497, 6 rows)
    ((3000, 700), (1497, 0), (1, 700)),  # the first row of the second chunk alone
    ((6, 400, 700), (3, 200, 100), (2, 200, 350)),  # 3-D: rows of two experts, in two chunks
    ((2_500_000,), (1_000_000, ), (1_500_000,)),  # 1-D: one value per row
])
def test_shard_equals_full_tensor_at_its_offset(shape, offset, size):
    """What a rank holding only the box `offset` + `size` draws is the full tensor there, bit for
    bit, and into a bf16 shard the same values rounded once."""
    init = TruncNormal(0.02)
    full = _full(init, shape)
    box = tuple(slice(o, o + n) for o, n in zip(offset, size))
    for dtype in (torch.float32, torch.bfloat16):
        shard = torch.empty(size, dtype=dtype)
        fill_shard_(shard, init, seed=3, name="p", global_shape=shape, offset=offset)
        assert torch.equal(shard, full[box].to(dtype)), dtype


def test_chunks_come_from_the_full_shape_and_the_name():
    assert rows_per_chunk((3000, 700)) == 1497 and rows_per_chunk((6, 400, 700)) == 1497
    assert rows_per_chunk((8, 8192, 5120)) == 204  # rows of 5120 values: an expert is 41 chunks
    assert rows_per_chunk((2, 3_000_000)) == 1 and rows_per_chunk((2_500_000,)) == 1 << 20
    a = _full(Normal(1.0), (4, 4))
    b = torch.empty(4, 4)
    fill_shard_(b, Normal(1.0), seed=3, name="q", global_shape=(4, 4), offset=(0, 0))
    assert not torch.equal(a, b)  # another parameter name draws other values


def _truncated_std(init: TruncNormal) -> float:
    """Standard deviation of normal(mean, std) truncated to [a, b]."""
    alpha, beta = (init.a - init.mean) / init.std, (init.b - init.mean) / init.std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: (1 + math.erf(x / math.sqrt(2))) / 2  # noqa: E731
    z = cdf(beta) - cdf(alpha)
    var = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z - ((pdf(alpha) - pdf(beta)) / z) ** 2
    return init.std * math.sqrt(var)


def _tiny_model(seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(FLAVORS["tiny"])
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_tiny_draws_its_declared_distributions():
    """Every parameter of ≥ 16k values: sample std within 2% of the declared one (the output head
    is cut at ±3 std, so its std is 0.987 of it), values within the bounds; norms are ones."""
    model = _tiny_model(0)
    inits = model.param_inits()
    checked = 0
    for name, p in model.named_parameters():
        init = inits[name]
        if isinstance(init, (TruncNormal, Normal)) and p.numel() >= 16384:
            want = _truncated_std(init) if isinstance(init, TruncNormal) else init.std
            assert p.std().item() == pytest.approx(want, rel=0.02), name
            checked += 1
        if isinstance(init, TruncNormal):
            assert init.a <= p.min().item() and p.max().item() <= init.b, name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    out = inits["output.weight"]
    assert out.b == pytest.approx(3 * out.std) and _truncated_std(out) == pytest.approx(0.9866 * out.std, rel=1e-3)
    assert model.output.weight.abs().max().item() > 2.9 * out.std  # the tail reaches the cut
    assert inits["layers.3.moe.experts.w2"].std == pytest.approx(0.02 / 8**0.5)  # depth-scaled
    assert checked == 28  # all but wk, wv (8192 values) and the router gates (1024)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = _tiny_model(5), _tiny_model(5), _tiny_model(6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pc) == ("norm" in name), name


def test_every_parameter_needs_a_declaration():
    model = _tiny_model(0)
    inits = model.param_inits()
    del inits["layers.1.attention.wq.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.wq\.weight"):
        init_parameters(model, inits, seed=0)


def test_strided_shards_must_be_contiguous_boxes():
    check_box_layout((_StridedShard(0, split_factor=2), Shard(0)), (2, 2))  # FSDP over TP
    check_box_layout((Replicate(), _StridedShard(0, split_factor=2), Shard(0)), (2, 2, 2))  # HSDP over TP
    with pytest.raises(ValueError, match="contiguous"):
        check_box_layout((Shard(0), _StridedShard(0, split_factor=2)), (2, 2))  # rows 0, 2 on one rank
    with pytest.raises(ValueError, match="contiguous"):
        check_box_layout((_StridedShard(0, split_factor=4), Shard(0)), (2, 2))
