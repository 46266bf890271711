"""QK-Clip (`optim.qk_clip`, `nn.logit_max`): each head's largest logit equals the brute-force
maximum of its masked score matrix; the clip brings every head above the threshold to it exactly,
by the rows Kimi K2 names, and leaves every other head, and every other weight, as it was.

    python -m pytest -q tests/unit/test_qk_clip.py
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from torchmoe.models.decoder.model import Transformer
from torchmoe.nn import logit_max
from torchmoe.nn.document_attention import document_segments, document_starts, whole_row_calls
from torchmoe.nn.logit_max import head_logit_max, window_starts
from torchmoe.optim.qk_clip import QKClip, watch_attention_logits

SEQ = 13


def _brute(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """(H,): the max over rows and `visible` (B, S, S) pairs of the whole score matrix."""
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.masked_fill(~visible.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("block", [1 << 26, 64])  # one block of queries; several (5 queries each)
@pytest.mark.parametrize("case", ["causal", "chunk", "window", "documents", "documents+chunk", "documents+window"])
def test_each_heads_largest_logit_is_the_masked_score_matrix_s(monkeypatch, case: str, block: int) -> None:
    monkeypatch.setattr(logit_max, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, SEQ, 8, generator=g), torch.randn(2, 2, SEQ, 8, generator=g)
    # Row 0's largest logits pair key 1 with queries 4 on, which chunks, windows and documents hide.
    q[0, :, :4] *= 0.1
    k[0, :, 1] *= 10
    i, j = torch.arange(SEQ).view(-1, 1), torch.arange(SEQ).view(1, -1)
    visible = (j <= i).expand(2, SEQ, SEQ)
    chunk = 4 if "chunk" in case else None
    documents = None
    if chunk:
        visible = visible & (j // chunk == i // chunk)
    window = 3 if "window" in case else None
    if window:
        visible = visible & (j > i - window)
    if case.startswith("documents"):
        tokens = torch.randint(1, 9, (2, SEQ), generator=g)
        tokens[0, [2, 7]] = tokens[1, 9] = 0  # EOS: documents start after them
        starts = document_starts(tokens, eos_id=0)
        visible = visible & (j.unsqueeze(0) >= starts.unsqueeze(-1))
        documents = document_segments(starts, whole_row_calls([(chunk, window)], SEQ), torch.device("cpu"))
    starts = window_starts(SEQ, q.device, chunk=chunk, window=window, documents=documents)
    got = head_logit_max(q, k, starts)
    assert torch.allclose(got, _brute(q, k, visible), rtol=1e-6, atol=0)
    # A mask that is not the one used gives another maximum (the test can fail).
    if case != "causal":
        assert not torch.equal(got, head_logit_max(q, k, None))


def _model(family: str, **edits):
    args = dataclasses.replace(importlib.import_module(f"torchmoe.arch.{family}").FLAVORS["tiny"], vocab_size=64,
                               **edits)
    with torch.device("meta"):
        model = Transformer(args)
    watched = watch_attention_logits(model, args.n_heads)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():  # biases and norms off their constant inits, so that they count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model.train(), args, watched


def _maxima(clip: QKClip, inputs: dict) -> torch.Tensor:
    """(layers, heads): each watched layer's maxima on its `inputs` (name: its forward's args),
    every layer on the same inputs however the others changed."""
    clip.begin_step()
    with torch.no_grad():
        for _, attention in clip.layers:
            attention(*inputs[attention])
    clip.reduce()
    return clip.maxima.clone()


def _attention_inputs(model, clip: QKClip, tokens: torch.Tensor) -> dict:
    """Each watched layer's forward args in a forward of `tokens`."""
    inputs = {}
    handles = [attention.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args))
               for _, attention in clip.layers]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return inputs


# family, edits, the watched layers (the families' QK-norm layers are not)
MODELS = {
    "deepseek_v3": ({}, 4),  # MLA
    "gpt_oss": ({}, 4),  # GQA (2 query heads a key head), biases, sinks, sliding windows
    "gpt_oss_mha": ({"n_kv_heads": 8}, 4),  # one query head a key head
    "llama4": ({}, 1),  # its NoPE layer only: RoPE layers have the L2 QK-norm
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_clip_brings_each_head_above_the_threshold_to_it_and_leaves_the_rest(name: str) -> None:
    edits, n_watched = MODELS[name]
    model, args, watched = _model(name.removesuffix("_mha"), **edits)
    assert len(watched) == n_watched
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    clip = QKClip(model, watched, 0.0, args.n_heads, torch.device("cpu"))
    inputs = _attention_inputs(model, clip, tokens)
    before = _maxima(clip, inputs)
    clip.threshold = tau = before.median().item()  # about half of the heads above it
    over = before > tau
    assert 0 < over.sum() < over.numel()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _maxima(clip, inputs)  # the step's maxima again, then the clip
    clip.apply()
    after = _maxima(clip, inputs)
    assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=2e-6)
    assert torch.equal(after[~over], before[~over])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    # DeepSeek-V3's tiny flavor has a query bottleneck (wq_a, wq_b).
    attention = {"deepseek_v3": {"wq_b.weight", "wkv_b.weight"}, "gpt_oss": {"wq.weight", "wq.bias"},
                 "gpt_oss_mha": {"wq.weight", "wq.bias", "wk.weight", "wk.bias"}, "llama4": {"wq.weight"}}[name]
    assert {n.split(".attention.")[-1] for n in changed} == attention, changed
    assert {n.split(".attention.")[0] + ".attention" for n in changed} <= set(watched)


def test_mla_scales_the_unrotated_rows_by_the_root_and_the_rotated_query_by_gamma() -> None:
    """Kimi K2's split, row by row: a clipped head's unrotated query and key rows by sqrt(gamma),
    its rotated query rows by gamma, its value rows, the query bottleneck and the shared rotated
    key (wkv_a) not."""
    model, args, watched = _model("deepseek_v3")
    attention = model.layers["0"].attention
    gamma = torch.tensor([0.25, 1.0, 0.5, 1.0])
    factors = attention.qk_clip_factors(gamma)
    nope, rope, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    query = factors["wq_b.weight"].view(args.n_heads, nope + rope)  # the tiny flavor's query bottleneck
    kv = factors["wkv_b.weight"].view(args.n_heads, nope + v)
    assert torch.equal(query[:, :nope], gamma.sqrt().unsqueeze(1).expand(-1, nope))
    assert torch.equal(query[:, nope:], gamma.unsqueeze(1).expand(-1, rope))
    assert torch.equal(kv[:, :nope], gamma.sqrt().unsqueeze(1).expand(-1, nope))
    assert torch.equal(kv[:, nope:], torch.ones(args.n_heads, v))
    assert set(factors) == {"wq_b.weight", "wkv_b.weight"}  # wq_a (the bottleneck) and wkv_a (the latent and the rotated key) stays


def test_qwen3_whose_every_layer_has_qk_norm_watches_nothing() -> None:
    _, _, watched = _model("qwen3")
    assert watched == []
