"""`torchmoe prepare-data` in a subprocess: shards that read back, and its user errors.

    python -m pytest -q -m integration tests/integration/test_prepare_data.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_user_error
from torchmoe.data.token_shards import TokenShards
from torchmoe.launch import run_cli

pytestmark = pytest.mark.integration


def test_prepare_data_writes_shards_and_refuses_bad_input(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"document {i}: " + "some text " * i for i in range(30)]
    for i, text in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_text(text)
    tokens = tmp_path / "data" / "tokens"
    proc = run_cli(["prepare-data", f"{corpus}/", tokens, "--workers", "2", "--shard-tokens", "1000"], timeout=120)
    assert "Traceback" not in proc.stderr and f"wrote 30 documents, {sum(map(len, texts)):,} tokens" in proc.stdout
    shards = TokenShards(tokens)
    assert [bytes(shards.tokens(i).astype(np.uint8)).decode() for i in range(30)] == texts
    assert len(shards.manifest["shards"]) >= 2

    missing = run_cli(["prepare-data", tmp_path / "nothing", tmp_path / "out"], timeout=120, expect=None)
    assert_user_error(missing, f'INPUT = "{tmp_path / "nothing"}": No such file or directory')
    zero = run_cli(["prepare-data", corpus, tmp_path / "out", "--workers", "0"], timeout=120, expect=None)
    assert_user_error(zero, '--workers = "0": expected a positive integer')
