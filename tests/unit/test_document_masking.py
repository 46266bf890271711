"""Document masking (`training.document_masking`): attention never crosses a document boundary
inside a packed row, positions stay global, and no path hands attention a mask.

    python -m pytest -q tests/unit/test_document_masking.py

The reference for "each document alone" runs the same weights on the document's tokens only,
with its global positions (RoPE, NoPE temperature tuning and chunk boundaries counted from the row
start, as torchtitan's block-causal mask does): a stand-in for context parallelism's hook gives
the model those positions and a dense attention over them, written here independently of
`nn.document_attention`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import SHORT_DOCUMENTS, HostReads, counting_model_reads, emulated_flash, refusing_attention_masks
from torchmoe.arch.registry import FLAVORS as FAMILY_FLAVORS
from torchmoe.arch.registry import model_args_from_config
from torchmoe.config import load_job_config
from torchmoe.config.errors import ConfigError
from torchmoe.distributed.compile import DynamoCounts
from torchmoe.models.llama4 import FLAVORS, Transformer
from torchmoe.nn.document_attention import (
    AttentionCall,
    document_attention,
    document_segments,
    document_starts,
    whole_row_calls,
)
from torchmoe.nn.sink_attention import sink_attention
from torchmoe.preflight.features import check_features
from torchmoe.training.loop import Trainer

REPO = Path(__file__).resolve().parents[2]
EOS = 1
CHUNK = FLAVORS["tiny"].attention_chunk_size  # 64


@dataclass(frozen=True)
class _Layout:
    seq_len: int


class _AloneAt:
    """Context parallelism's hook, standing in: the tokens are one document at global positions
    ``[offset, offset + n)``; attention is dense causal over them (within global chunks, or the
    sliding window), in fp64, with the sink logits as one more column of each softmax."""

    def __init__(self, offset: int, n: int) -> None:
        self.offset, self.n = offset, n
        self.layout = _Layout(offset + n)

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.offset, self.offset + self.n, device=device)

    def attend(self, q, k, v, chunk, documents=None, *, window=None, sinks=None):
        pos = self.positions(q.device)
        allowed = pos[:, None] >= pos[None, :]
        if chunk is not None:
            allowed &= pos[:, None] // chunk == pos[None, :] // chunk
        if window is not None:
            allowed &= pos[:, None] - pos[None, :] < window
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        return (scores.softmax(-1)[..., :k.shape[-2]] @ v.double()).to(q.dtype)


def _documents(row: list[int], eos: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a row: one starts at 0 and after every EOS."""
    starts = [0] + [t + 1 for t, tok in enumerate(row[:-1]) if tok == eos]
    return list(zip(starts, starts[1:] + [len(row)]))


def _alone(model: Transformer, tokens: torch.Tensor, offset: int) -> torch.Tensor:
    """Logits (1, n, V) of one document (1, n) run alone at global positions offset.."""
    hook = _AloneAt(offset, tokens.shape[-1])
    modules = [model, *(layer.attention for layer in model.layers.values())]
    for module in modules:
        module.context_parallel = hook
    try:
        return model(tokens)
    finally:
        for module in modules:
            module.context_parallel = None


def _per_document_logits(model: Transformer, tokens: torch.Tensor, eos: int = EOS) -> torch.Tensor:
    """(B, S, V): every document of every row run alone, the logits put back in place."""
    rows = []
    for row in tokens:
        rows.append(torch.cat([_alone(model, row[None, s:e], s) for s, e in _documents(row.tolist(), eos)], dim=1))
    return torch.cat(rows)


def _packed_rows(seed: int = 0) -> torch.Tensor:
    """(2, 256): documents of 20, 100, 9, 127 and 64, 1, 191 tokens (shorter, as long as and
    longer than the 64-token chunk; some crossing chunk boundaries), each ending in EOS but the
    last (cut by the row's end)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(2, FLAVORS["tiny"].vocab_size, (2, 256), generator=gen)
    for b, lengths in enumerate(([20, 100, 9, 127], [64, 1, 191])):
        ends = torch.tensor(lengths).cumsum(0)[:-1] - 1
        rows[b, ends] = EOS
    return rows


def _segments(tokens: torch.Tensor, calls: list[AttentionCall] | None = None, eos: int = EOS):
    """The segment tables of `tokens`' rows for `calls` (default: the tiny model's, whole rows)."""
    calls = calls or whole_row_calls(FLAVORS["tiny"].attention_spans(), tokens.shape[-1])
    return document_segments(document_starts(tokens, eos), calls, tokens.device)


@functools.cache
def _model() -> Transformer:
    model = Transformer(FLAVORS["tiny"])
    model.init_weights(seed=0)
    return model.eval()


def test_document_starts() -> None:
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9], [EOS, 3, 3, 3, 3, 3, EOS]])
    assert document_starts(tokens, EOS).tolist() == [[0, 0, 2, 2, 2, 5, 6], [0, 1, 1, 1, 1, 1, 1]]


# Each family's attention: Llama 4's chunks (64) and NoPE layers, Qwen3's QK-norm, DeepSeek-V3's
# latent attention, gpt-oss's sinks with sliding windows shorter than most conversations (8) and
# longer than every one but shorter than the row (150).
FAMILIES = [("llama4", None), ("qwen3", None), ("deepseek_v3", None), ("gpt_oss", 8), ("gpt_oss", 150)]


@pytest.mark.parametrize(("family", "window"), FAMILIES)
@torch.no_grad()
def test_every_family_s_packed_conversations_are_each_conversation_alone(family: str, window: int | None) -> None:
    """A packed row's conversations under document masking (fp32): each one's logits (1e-5) and
    its loss (the mean cross entropy of its next tokens, rel 1e-5) are those of the conversation
    run alone: its tokens by themselves through the model (RoPE is relative), or for Llama 4,
    whose chunks and NoPE temperature count from the row start, at its global positions with a
    dense reference attention. The same row without masking gives other logits after the first
    conversation."""
    args = FAMILY_FLAVORS[family]["tiny"]
    if window is not None:
        args = args.replace(sliding_window=window)
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    tokens = _packed_rows()
    with refusing_attention_masks():
        packed = model(tokens, document_segments(document_starts(tokens, EOS),
                                                 whole_row_calls(args.attention_spans(), 256), tokens.device))
    unmasked, moved = model(tokens), []
    for b, row in enumerate(tokens):
        for s, e in _documents(row.tolist(), EOS):
            alone = (_alone(model, row[None, s:e], s) if family == "llama4" else model(row[None, s:e]))[0]
            torch.testing.assert_close(packed[b, s:e], alone, rtol=1e-5, atol=1e-5)
            if e - s > 1:
                labels = row[s + 1:e]
                assert F.cross_entropy(packed[b, s:e - 1], labels).item() == pytest.approx(
                    F.cross_entropy(alone[:-1], labels).item(), rel=1e-5)
            if s:
                moved.append((packed[b, s:e] - unmasked[b, s:e]).abs().max().item())
    assert min(moved) > 1e-3, moved


@torch.no_grad()
def test_masking_changes_the_logits_of_a_row_with_several_documents() -> None:
    model, tokens = _model(), _packed_rows()
    masked, unmasked = model(tokens, _segments(tokens)), model(tokens)
    first = 20  # the first document's logits are the same either way; the second's are not
    torch.testing.assert_close(masked[0, :first], unmasked[0, :first], rtol=1e-5, atol=1e-5)
    assert (masked[0, first:] - unmasked[0, first:]).abs().max() > 1e-2


def test_attention_with_a_prefix_equals_the_whole_row() -> None:
    """A piece of queries whose first document began before it (context parallelism) sees those
    keys as a prefix: output and gradients equal the whole row's, at fp32 rounding."""
    torch.manual_seed(0)
    tokens = _packed_rows()
    q = torch.randn(2, 4, 256, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 256, 16, requires_grad=True) for _ in range(2))
    for chunk, start in ((None, 96), (CHUNK, 96), (CHUNK, 128)):
        whole = document_attention(q, k, v, _segments(tokens, whole_row_calls([(chunk, None)], 256)), chunk=chunk)
        lo = 0 if chunk is None else start // chunk * chunk
        segments = _segments(tokens, [AttentionCall(chunk, start, 256 - start, start - lo)])
        piece = document_attention(q[..., start:, :], k[..., start:, :], v[..., start:, :], segments,
                                   chunk=chunk, start=start, prefix=(k[..., lo:start, :], v[..., lo:start, :]))
        torch.testing.assert_close(piece, whole[..., start:, :], rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(piece)
        expected = torch.autograd.grad(whole[..., start:, :], (q, k, v), grad)
        for got, want in zip(torch.autograd.grad(piece, (q, k, v), grad), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 8, 150, None])
def test_sinks_and_windows_within_documents_are_each_document_alone(window) -> None:
    """gpt-oss's attention under document masking (fp64): each document's rows, and every
    gradient (the sinks' included), are those of `sink_attention` over that document alone, its
    window counted from the document's start (windows of 1 and 8 keys are shorter than most
    documents, 150 longer than every one but shorter than the row). Context parallelism's
    pieces, with the W - 1 keys before them (or the whole prefix) as theirs, give the whole row's."""
    tokens = _packed_rows()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 256, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, 256, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    sinks = (torch.randn(4, generator=g, dtype=torch.float64) * 2).requires_grad_()
    out = document_attention(q, k, v, _segments(tokens, whole_row_calls([(None, window)], 256)), window=window,
                             sinks=sinks)
    alone = torch.cat([torch.cat([sink_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], sinks,
                                                 window) for s, e in _documents(row, EOS)], dim=-2)
                       for b, row in enumerate(tokens.tolist())])
    torch.testing.assert_close(out, alone, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(alone, (q, k, v, sinks), grad)
    for name, got, want in zip("qkvs", torch.autograd.grad(out, (q, k, v, sinks), grad, retain_graph=True), expected):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=name)
    row = sink_attention(q, k, v, sinks, window)  # the row as one document: other numbers
    assert window == 1 or (out - row).abs().max() > 1e-2  # (a window of 1 key sees no other document)
    for start in (96, 128):
        m = start if window is None else min(window - 1, start)
        segments = _segments(tokens, [AttentionCall(None, start, 256 - start, m, window)])
        piece = document_attention(q[..., start:, :], k[..., start:, :], v[..., start:, :], segments, start=start,
                                   prefix=(k[..., start - m:start, :], v[..., start - m:start, :]), window=window,
                                   sinks=sinks)
        torch.testing.assert_close(piece, out[..., start:, :], rtol=1e-12, atol=1e-12)
        expected = torch.autograd.grad(out[..., start:, :], (q, k, v, sinks), grad[..., start:, :], retain_graph=True)
        for name, got, want in zip("qkvs", torch.autograd.grad(piece, (q, k, v, sinks), grad[..., start:, :]),
                                   expected):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=name)


def test_a_prefix_too_short_is_refused() -> None:
    """Row 0's first document began at 0: queries from 30 need its 30 earlier keys; the tables
    are refused when built, on the host, before any layer runs."""
    with pytest.raises(ValueError, match="starts 30 positions before the queries at 30, but the prefix holds 4"):
        _segments(_packed_rows(), [AttentionCall(None, 30, 226, 4)])


def test_a_call_other_than_its_table_is_refused() -> None:
    tokens = _packed_rows()
    q, k = torch.randn(2, 4, 256, 16), torch.randn(2, 2, 256, 16)
    segments = _segments(tokens, [AttentionCall(None, 30, 226, 30)])
    with pytest.raises(ValueError, match="built for 226 queries after 30 prefix keys, but the call has 226 after 4"):
        document_attention(q[..., 30:, :], k[..., 30:, :], k[..., 30:, :], segments, start=30,
                           prefix=(k[..., 26:30, :], k[..., 26:30, :]))


def _trainer(dump_folder: Path, *flags: str) -> Trainer:
    cfg = load_job_config([
        "--config", str(REPO / "configs" / "debug_model.toml"), "--job.dump_folder", str(dump_folder),
        "--training.seq_len", "256", "--training.local_batch_size", "4", "--training.steps", "2",
        "--training.mixed_precision_param", "float32", "--training.document_masking", *SHORT_DOCUMENTS, *flags,
    ])
    return Trainer(cfg)


def test_step_one_loss_is_the_cross_entropy_of_each_document_alone(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    eos = trainer.tokenizer.eos_id
    [(inputs, labels)] = batch = trainer.dataloader.next_batch()
    assert max(len(_documents(row, eos)) for row in inputs.tolist()) >= 2  # the batch packs documents
    with torch.no_grad():
        logits = _per_document_logits(trainer.model, inputs, eos)
        # Token by token first (a boundary off by one moves the mean loss by less than 1e-5).
        local_inputs, _, documents, _ = trainer._local_columns(inputs, labels)
        torch.testing.assert_close(trainer.model(local_inputs, documents), logits, rtol=1e-5, atol=1e-5)
    expected = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    assert trainer.train_step(batch).loss == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("family", ["llama4", "gpt_oss"])
def test_packed_row_on_flash_equals_each_document_alone(family: str) -> None:
    """On CUDA flash's path (emulated: `varlen_attn`'s operands checked against what the kernel
    assumes; for gpt-oss its sliding window and log-sum-exp, and flash's varlen backward given the
    sinks' joined output), one call per layer for both rows, no host read forward or backward,
    and the logits of each document alone (a dense fp64 attention at its global positions, with
    the window and the sink column)."""
    args = FAMILY_FLAVORS[family]["tiny"]
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens, reads = _packed_rows(), HostReads()
    segments = document_segments(document_starts(tokens, EOS), whole_row_calls(args.attention_spans(), 256),
                                 tokens.device)
    with emulated_flash(reads) as calls, reads.counting():
        packed = model(tokens, segments)
        packed.float().pow(2).mean().backward()
    assert len(calls) == args.n_layers and not reads.counts
    with torch.no_grad():
        torch.testing.assert_close(packed, _per_document_logits(model.eval(), tokens), rtol=1e-5, atol=1e-5)


def test_a_masked_step_on_flash_reads_nothing_on_the_host(tmp_path: Path, monkeypatch) -> None:
    """Two steps of two micro-batches on flash's path (emulated) against the host kernels' path:
    the same losses and gradient norms; one `varlen_attn` call per layer and micro-batch; the
    segment tables built once per micro-batch (not per layer); and no host read at all in the
    model's forward and backward, in any step."""
    built = []
    monkeypatch.setattr("torchmoe.training.placement.document_segments",
                        lambda *args: built.append(1) or document_segments(*args))
    flags = ("--training.global_batch_size", "8")  # two micro-batches of 4 rows
    reference = _trainer(tmp_path / "host", *flags)
    expected = [reference.train_step(reference.dataloader.next_batch()) for _ in range(2)]
    trainer, reads = _trainer(tmp_path / "flash", *flags), HostReads()
    with emulated_flash(reads) as calls, counting_model_reads(trainer, reads):
        got = [trainer.train_step(trainer.dataloader.next_batch()) for _ in range(2)]
    assert not reads.counts
    assert len(built) == 2 * (2 * 2)  # both runs: 2 steps x 2 micro-batches
    assert len(calls) == (2 * 2) * trainer.model_args.n_layers
    for want, have in zip(expected, got):
        assert have.loss == pytest.approx(want.loss, rel=1e-6)
        assert have.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)


def test_compiled_and_checkpointed_equals_eager(tmp_path: Path) -> None:
    """torch.compile (aot_eager) of every block with per-op selective AC, two steps: the document
    attention is one node, so the blocks stay one graph each (fullgraph), and the second step's
    other documents compile nothing new."""
    runs = []
    for flags in ((), ("--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode",
                       "selective", "--activation_checkpoint.selective_ac_option", "op")):
        trainer = _trainer(tmp_path / str(len(flags)), *flags)
        first = trainer.train_step(trainer.dataloader.next_batch())
        compiled = DynamoCounts.now()
        second = trainer.train_step(trainer.dataloader.next_batch())
        runs.append((first, second, DynamoCounts.now().since(compiled)))
    (eager_1, eager_2, _), (compiled_1, compiled_2, recompiled) = runs
    assert recompiled.graphs == 0
    for eager, compiled in ((eager_1, compiled_1), (eager_2, compiled_2)):
        assert compiled.loss == pytest.approx(eager.loss, rel=1e-5)
        assert compiled.grad_norm == pytest.approx(eager.grad_norm, rel=1e-5)


def test_torchtitan_attn_mask_type() -> None:
    def masking(value: str) -> bool:
        return load_job_config(["--model.attn_mask_type", value]).training.document_masking

    assert masking("block_causal") and not masking("causal")
    with pytest.raises(ConfigError, match="model.attn_mask_type"):
        masking("sliding_window")


def test_flex_attention_with_masking_is_refused() -> None:
    cfg = load_job_config(["--training.document_masking", "--model.attn_backend", "flex"])
    with pytest.raises(ConfigError, match="document masking runs the fused kernels per document"):
        check_features(cfg, model_args_from_config(cfg.model), {"cp": 1}, check_device=False)
