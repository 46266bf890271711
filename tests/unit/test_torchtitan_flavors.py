"""torchtitan v0.2.2's Llama 4 flavor names build exactly torchtitan's model.

    python -m pytest -q tests/unit/test_torchtitan_flavors.py

Every expected number below was measured from the torchtitan v0.2.2 wheel (its `llama4_args`,
each flavor built on the meta device with its own classes) and is written here, not read from
`torchmoe/arch/llama4.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from torchmoe.config import load_job_config
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import ActivationCheckpoint, Parallelism, Training
from torchmoe.models.decoder.rotary import precompute_freqs_cis, rope_frequencies
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.models.llama4.hf import args_from_hf_config, hf_config_from_args
from torchmoe.plan.memory import estimate_memory
from torchmoe.weights.flavor_fit import matching_flavor, meta_state, require_fit

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Titan:
    """One torchtitan flavor as torchtitan builds it."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    dense_hidden: int  # FeedForward of the dense layers
    expert_hidden: int  # each routed expert, and the (one) shared expert
    num_experts: int
    moe_layers: list[int]
    nope_layers: list[int]
    block: int | None  # fixed_attn_block_size of the RoPE layers; None: plain causal everywhere
    rope_scaled: bool  # RoPEScalingArgs(): factor 16, low 1, high 1, original 8192
    max_seq_len: int
    total: int
    active: int


_DEBUG = dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, dense_hidden=768, expert_hidden=512,
              num_experts=8, moe_layers=[1, 3, 5], rope_scaled=True, max_seq_len=1048576, total=15_017_216,
              active=6_759_680)
_17B = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, dense_hidden=16384, expert_hidden=8192)
_16E = dict(_17B, num_experts=16, moe_layers=list(range(48)), rope_scaled=True, max_seq_len=10485760,
            total=107_769_861_120, active=17_172_894_720)
_128E = dict(_17B, num_experts=128, moe_layers=list(range(1, 48, 2)), rope_scaled=False, max_seq_len=1048576,
             total=400_711_848_960, active=17_184_691_200)
TITAN = {
    "debugmodel": Titan(**_DEBUG, nope_layers=[], block=None),
    "debugmodel_irope": Titan(**_DEBUG, nope_layers=[0, 4], block=256),
    "17bx16e": Titan(**_16E, nope_layers=[], block=None),
    "17bx16e_irope": Titan(**_16E, nope_layers=list(range(0, 48, 4)), block=8192),
    "17bx128e": Titan(**_128E, nope_layers=[], block=None),
    "17bx128e_irope": Titan(**_128E, nope_layers=list(range(0, 48, 4)), block=8192),
}

# torchtitan's reported training FLOPs per token (`get_moe_model_nparams_and_flops`): debugmodel at
# its config's seq_len 2048, the 17B flavors at 8192. It counts every layer's attention over the
# whole sequence, so the irope flavors (whose chunked layers torchmoe counts over the block) are left out.
TITAN_FLOPS = {"debugmodel": (2048, 75_161_088), "17bx16e": (8192, 120_989_644_800),
               "17bx128e": (8192, 121_060_423_680)}


def _meta_model(flavor: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(FLAVORS[flavor])


def test_the_six_torchtitan_names_are_flavors():
    assert set(TITAN) <= set(FLAVORS)


@pytest.mark.parametrize("flavor", sorted(TITAN))
def test_shapes_and_layers(flavor):
    want, args = TITAN[flavor], FLAVORS[flavor]
    model = _meta_model(flavor)
    head_dim = want.dim // want.n_heads  # torchtitan has no head_dim field
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size) == (
        want.dim, want.n_layers, want.n_heads, want.n_kv_heads, head_dim, want.vocab_size)
    assert args.max_seq_len == want.max_seq_len
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    d, q, kv, h, e = want.dim, want.n_heads * head_dim, want.n_kv_heads * head_dim, want.expert_hidden, want.num_experts
    attention = {"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
                 "attention.wo.weight": (d, q), "attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    f = want.dense_hidden
    dense = {**attention, "feed_forward.w1.weight": (f, d), "feed_forward.w3.weight": (f, d),
             "feed_forward.w2.weight": (d, f)}
    moe = {**attention, "moe.router.gate.weight": (e, d),
           "moe.experts.w1": (e, h, d), "moe.experts.w3": (e, h, d), "moe.experts.w2": (e, d, h),
           "moe.shared_experts.w1.weight": (h, d), "moe.shared_experts.w3.weight": (h, d),
           "moe.shared_experts.w2.weight": (d, h)}
    for i in range(want.n_layers):
        layer = {name.removeprefix(f"layers.{i}."): shape for name, shape in params.items()
                 if name.startswith(f"layers.{i}.")}
        assert layer == (moe if i in want.moe_layers else dense), i
    # Untied head, no biases anywhere.
    outside = {name: shape for name, shape in params.items() if not name.startswith("layers.")}
    assert outside == {"tok_embeddings.weight": (want.vocab_size, d), "norm.weight": (d,),
                       "output.weight": (want.vocab_size, d)}

    blocks = list(model.layers.values())
    assert [b.layer_id for b in blocks if b.moe_enabled] == want.moe_layers
    assert [b.layer_id for b in blocks if not b.attention.use_rope] == want.nope_layers
    assert {b.attention.chunk_size for b in blocks if b.attention.use_rope} == {want.block}
    assert {b.attention.chunk_size for b in blocks if not b.attention.use_rope} <= {None}
    # No QK norm, no attention temperature tuning, torchmoe's default (CPU-capable) attention.
    assert all(b.attention.qk_norm is None and b.attention.temperature is None for b in blocks)
    assert args.attn_backend == "sdpa"
    assert args.top_k == 1 and args.num_shared_experts == 1 and args.score_func == "sigmoid"
    assert args.score_before_experts and args.load_balance_coeff == 1e-3


@pytest.mark.parametrize("flavor", sorted(TITAN))
def test_parameter_counts(flavor):
    want = TITAN[flavor]
    model = _meta_model(flavor)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    assert total == want.total
    # Active: one routed expert of E per token (top-1), everything else.
    assert total - routed + routed // want.num_experts == want.active
    assert FLAVORS[flavor].param_counts()["total"] == want.total
    assert FLAVORS[flavor].param_counts()["active"] == want.active


def _llama3_scaled(head_dim: int, scaled: bool) -> list[float]:
    """Independently: base frequencies 500000^(-2i/head_dim); with torchtitan's RoPEScalingArgs
    (low_freq_factor == high_freq_factor, so no band is smoothed) those whose wavelength 2 pi / f
    exceeds 8192 positions are divided by 16, the others kept."""
    base = [500000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if not scaled:
        return base
    return [f / 16 if 2 * math.pi / f > 8192 else f for f in base]


@pytest.mark.parametrize(("flavor", "n_scaled"), [
    ("debugmodel", 3), ("debugmodel_irope", 3), ("17bx16e", 29), ("17bx16e_irope", 29),
    ("17bx128e", 0), ("17bx128e_irope", 0),
])
def test_rope_frequencies(flavor, n_scaled):
    want, args = TITAN[flavor], FLAVORS[flavor]
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == ({"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192} if want.rope_scaled else None)
    head_dim = want.dim // want.n_heads
    expected = torch.tensor(_llama3_scaled(head_dim, want.rope_scaled), dtype=torch.float64)
    got = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    assert torch.isfinite(got).all()  # low == high: no 0 / 0 in the (empty) smoothing band
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    unscaled = torch.tensor(_llama3_scaled(head_dim, False), dtype=torch.float64)
    assert int((expected < unscaled).sum()) == n_scaled
    if flavor.startswith("debugmodel"):  # the lowest 3 of 8
        assert torch.equal(expected[:5], unscaled[:5]) and torch.equal(expected[5:], unscaled[5:] / 16)
    # The model rotates position p by p * frequency.
    rotations = precompute_freqs_cis(args, 3)
    torch.testing.assert_close(torch.angle(rotations[1]).double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flavor", sorted(TITAN))
def test_hugging_face_config_round_trips_to_the_same_flavor(flavor):
    """The config.json torchmoe writes for a flavor reads back as that flavor and no other."""
    config = hf_config_from_args(FLAVORS[flavor], torch.float32)
    assert (config["use_qk_norm"], config["attn_temperature_tuning"]) == (False, False)
    assert [i for i, rope in enumerate(config["no_rope_layers"]) if not rope] == TITAN[flavor].nope_layers
    assert config["attention_chunk_size"] == TITAN[flavor].block
    assert matching_flavor(args_from_hf_config(config)) == flavor


def test_a_checkpoint_of_scouts_shapes_suggests_scout_and_names_the_others():
    """torchtitan's 17bx16e flavors have the released Scout's tensors; a DCP checkpoint records
    only shapes, so the fix suggests the release's architecture and names the other two."""
    stored = {name: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, [])
              for name, t in meta_state(FLAVORS["17bx16e"]).items()}
    with pytest.raises(ConfigError) as caught:
        require_fit("model.flavor", "tiny", FLAVORS["tiny"], stored, "checkpoint.initial_load_path ckpt")
    assert caught.value.fix == ("pass --model.flavor scout (its tensors also fit 17bx16e, 17bx16e_irope, which differ "
                                "only in attention or RoPE: if it was trained with one of those, pass that one)")


@pytest.mark.parametrize("flavor", sorted(TITAN_FLOPS))
def test_flops_per_token_match_torchtitans(flavor):
    seq_len, flops = TITAN_FLOPS[flavor]
    assert FLAVORS[flavor].flops_per_token(seq_len) == flops


def test_debugmodel_irope_trains_a_step_on_cpu(tmp_path):
    """One forward and backward of torchtitan's debugmodel_irope on 1 x 512 tokens (two 256-token
    blocks on the RoPE layers) in the trainer; the planner's parameter bytes are the model's."""
    from torchmoe.training.loop import Trainer

    cfg = load_job_config(["--config", str(REPO / "configs" / "debug_model.toml"), "--job.dump_folder", str(tmp_path),
                           "--model.flavor", "debugmodel_irope", "--training.seq_len", "512",
                           "--training.local_batch_size", "1", "--training.steps", "1"])
    trainer = Trainer(cfg)
    loss = trainer.forward_backward(trainer.dataloader.next_batch())
    # At initialisation the loss is near ln(vocab) = ln(2048) = 7.62.
    assert 6.5 < loss.item() < 9.0
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in trainer.model.parameters())
    memory = estimate_memory(FLAVORS["debugmodel_irope"], dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1),
                             Training(local_batch_size=1, seq_len=512), ActivationCheckpoint(), Parallelism())
    assert memory["params"] * 2**30 == 4 * TITAN["debugmodel_irope"].total
