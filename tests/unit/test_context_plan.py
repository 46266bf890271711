"""The context-parallel plan: head-tail pieces, each layer's mode, halos, bytes, validation, fit.

    python -m pytest -q tests/unit/test_context_plan.py
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from torchmoe.config.errors import ConfigError
from torchmoe.config.loader import load_job_config
from torchmoe.plan.context import CPLayout
from torchmoe.plan.dry_run import run_dry_run
from torchmoe.preflight import validate_job_config


@pytest.mark.parametrize(("seq_len", "cp"), [(16, 2), (64, 4), (384, 2), (48, 3)])
def test_pieces_cover_the_sequence_and_balance_causal_work(seq_len, cp):
    layout = CPLayout(seq_len, cp)
    every = sorted(p for r in range(cp) for p in layout.positions(r))
    assert every == list(range(seq_len))
    # Causal attention work of a token is its position + 1: head-tail gives every rank the same sum.
    work = {sum(p + 1 for p in layout.positions(r)) for r in range(cp)}
    assert len(work) == 1
    for r in range(cp):
        assert [layout.owner(j) for j in layout.pieces(r)] == [r, r]


def test_modes_halos_and_keys():
    # seq 384 on cp 2: pieces of 96 tokens.
    layout = CPLayout(384, 2)
    assert layout.mode(None) == "global" and layout.mode(384) == "global"
    assert layout.mode(32) == "local" and layout.mode(96) == "local"
    assert layout.mode(64) == "halo" and layout.mode(128) == "gather"
    assert [layout.halo(j, 64) for j in range(4)] == [0, 32, 0, 32]
    assert [layout.keys(j, 64) for j in range(4)] == [96, 128, 96, 128]
    assert [layout.keys(j, None) for j in range(4)] == [96, 192, 288, 384]
    # gather, chunk 128: piece 2 (192..287) starts in chunk 1 (128..255): keys from 128.
    assert layout.keys(2, 128) == 288 - 128


def test_sliding_windows_take_the_keys_their_first_query_sees():
    """gpt-oss's windows (seq 384 on cp 2, pieces of 96): the W - 1 keys before a piece, from the
    previous piece when they fit in it (halo), else from the gathered keys; a window of one key
    sees nothing before; one no shorter than the sequence is full causal attention."""
    layout = CPLayout(384, 2)
    assert [layout.mode(None, w) for w in (1, 8, 97, 98, 200, 384, 500)] == \
        ["local", "halo", "halo", "gather", "gather", "global", "global"]
    assert [layout.halo(j, None, 8) for j in range(4)] == [0, 7, 7, 7]
    assert [layout.keys(j, None, 8) for j in range(4)] == [96, 103, 103, 103]
    assert [layout.prefix(j, None, 200) for j in range(4)] == [0, 96, 192, 199]
    assert layout.attention_calls(1, ((None, 8), (None, None))) == [
        (None, 96, 96, 7, 8), (None, 192, 96, 7, 8), (None, 96, 96, 96, None), (None, 192, 96, 192, None)]
    assert layout.bytes_received("halo", None, 10.0, 8) == 7 * 10.0  # rank 0 waits for piece 2's tail


def test_bytes_received_are_the_minimum():
    layout, kv = CPLayout(384, 2), 10.0
    assert layout.bytes_received("global", None, kv) == 192 * kv  # the other rank's half
    assert layout.bytes_received("local", 32, kv) == 0
    assert layout.bytes_received("halo", 64, kv) == 32 * kv  # each rank waits for one 32-token halo
    assert CPLayout(512, 4).bytes_received("gather", 128, kv) == 384 * kv


def _cfg(*flags: str, tmp_path=None):
    extra = ["--job.dump_folder", str(tmp_path)] if tmp_path else []
    return load_job_config(["--config", "configs/debug_model.toml", *flags, *extra])


def test_flex_attention_is_refused_with_cp_and_on_cpu():
    with pytest.raises(ConfigError) as err:
        validate_job_config(_cfg("--parallelism.context_parallel_degree", "2", "--model.attn_backend", "flex",
                                 "--training.seq_len", "128"), 2, check_device=False)
    assert err.value.key == "model.attn_backend" and "context parallelism" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate_job_config(_cfg("--model.attn_backend", "flex", "--training.device", "cpu"), 1)
    assert err.value.key == "model.attn_backend" and "no backward kernel" in str(err.value)
    validate_job_config(_cfg("--model.attn_backend", "flex", "--training.device", "cuda", "--compile.enable", "true"),
                        1, check_device=False)  # planned for a GPU cluster


def test_scout_at_128k_on_cp8_fits_80_gib(tmp_path):
    """Llama 4 Scout, seq 131072 on 64 GPUs (cp 8 x tp 8, FSDP over dp_shard x cp = 8, full AC,
    bf16): the planner's per-rank estimate fits an 80 GiB device."""
    cfg = load_job_config(["--config", "configs/llama4_16e.toml", "--job.dump_folder", str(tmp_path),
                           "--training.seq_len", "131072", "--parallelism.context_parallel_degree", "8"])
    validate_job_config(cfg, 64, check_device=False)
    out = io.StringIO()
    report = run_dry_run(cfg, 64, console=Console(file=out, width=200))
    total = report["memory_per_rank_gib"]["total"]
    assert 20 < total < 80, total
    assert "fits:" in out.getvalue()
    modes = report["context_parallel"]["modes"]
    # Pieces of 8192 tokens = Scout's chunk: the 36 chunked layers send nothing.
    assert len(modes["local"]["layers"]) == 36 and modes["local"]["bytes_per_step"] == 0
    assert modes["global"]["layers"] == list(range(3, 48, 4))
