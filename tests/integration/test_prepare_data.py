"""`torchmoe prepare-data` in a subprocess: shards that read back, and its user errors.

    python -m pytest -q -m integration tests/integration/test_prepare_data.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_user_error
from tests.launch import run_cli
from torchmoe.data.token_shards import TokenShards

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
    assert_user_error(zero, '--workers = "0": must be an integer from 1 to ')


def test_ctrl_c_stops_every_process_with_one_line_and_the_same_command_resumes(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole process group: the main process and every tokenizing
    worker. Once a shard is written, SIGINT to the group: one line, exit 130, no traceback (its
    workers printed KeyboardInterrupt tracebacks in about 40% of trials, and once the main
    process waited for ever on a task a dying worker dropped), no process left; the same command
    then finishes the job."""
    import os
    import signal
    import subprocess
    import time

    from tests.launch import cli_command, cli_env

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "{"word " * (50 + i % 50)}{i}"}}\n' for i in range(60_000)))
    tokens = tmp_path / "tokens"
    command = cli_command(["prepare-data", corpus, tokens, "--workers", "2", "--shard-tokens", "50000"])
    proc = subprocess.Popen(command, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a group of its own, as a terminal's job
    try:
        deadline = time.monotonic() + 120
        while not list(tokens.glob("shard-*.tokens.npy")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:  # a command that hangs (the failure this test catches) takes its workers with it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted by SIGINT: stopped", err
    # The workers are terminated with the pool; the fork server and multiprocessing's resource
    # tracker leave when the main process's pipes to them close (within moments).
    for _ in range(100):
        left = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.05)
    assert left == "", left
    again = run_cli(["prepare-data", corpus, tokens, "--workers", "2", "--shard-tokens", "50000"], timeout=300)
    assert "wrote 60,000 documents" in again.stdout, again.stdout
