"""README.md's commands, run in the order a new user runs them, in one fresh folder (a copy of
`configs/` and the test corpus the README names): each after the ones before it, so that no
command trips over what an earlier one wrote (a dump folder, a file).

Left to their own tests: the installs and the test suite (this is it, installed), and fault
tolerance's lighthouse and replica groups (two terminals and torchft:
`tests/distributed/test_fault_tolerance.py`).

    python -m pytest -q -m integration tests/integration/test_readme_in_order.py
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_check import commands
from tests.helpers import REPO
from tests.launch import cli_env, free_port, read_metrics, run_command

pytestmark = pytest.mark.integration

# Every command of README.md, in order, that this test runs (the installs, the tests and fault
# tolerance's are the others; the test checks it saw exactly these).
README_COMMANDS = [
    "torchmoe train --config configs/debug_model.toml",
    "torchmoe train --config configs/debug_model.toml --training.steps 40 --checkpoint.enable true "
    "--job.dump_folder outputs/debug-40",
    "torchmoe generate --job.dump_folder outputs/debug-40 --prompt 'def main('",
    "torchmoe eval --job.dump_folder outputs/debug-40 --split train --batches 4",
    "torchmoe train --config configs/llama4_16e.toml --dry-run --world-size 64",
    "torchrun --nproc_per_node=8 -m torchmoe train --config configs/debug_model.toml "
    "--parallelism.tensor_parallel_degree 2 --parallelism.expert_parallel_degree 4 --training.steps 10 "
    "--lr_scheduler.warmup_steps 2 --job.dump_folder outputs/debug-8ranks",
    "torchmoe plan --config configs/debug_model.toml --gpus 4 --free all --out best.toml --json all.json",
    "torchmoe prepare-data tests/assets/short_documents.jsonl data/tokens",
    "torchmoe train --config configs/debug_model.toml --training.dataset tokens --training.dataset_path data/tokens "
    "--training.steps 40 --job.dump_folder outputs/debug-tokens",
]
OTHERS = ("pip ", "python3 -m pytest", "torchmoe lighthouse", "TORCHFT_LIGHTHOUSE=")


def _argv(command: str) -> list[str]:
    """`command` as this interpreter runs it: `torchmoe` is `python -m torchmoe`, `torchrun` is
    `python -m torch.distributed.run` on a free port."""
    words = shlex.split(command)
    if words[0] == "torchmoe":
        return [sys.executable, "-m", "torchmoe", *words[1:]]
    assert words[0] == "torchrun", command
    return [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}", *words[1:]]


def _run(command: str) -> subprocess.CompletedProcess[str]:
    """`command` run in the current folder as `tests.launch.run_cli` runs a command."""
    return run_command(_argv(command), cli_env(), timeout=600)


def test_the_readme_runs_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown = [c.text for c in commands("README.md", (REPO / "README.md").read_text())[0]]
    assert [c for c in shown if not c.startswith(OTHERS)] == README_COMMANDS
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "tests" / "assets").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "assets" / "short_documents.jsonl", tmp_path / "tests" / "assets")
    monkeypatch.chdir(tmp_path)
    out: dict[str, subprocess.CompletedProcess[str]] = {}
    for command in README_COMMANDS:
        proc = _run(command)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out[command] = proc

    # The Quick start's run: 200 steps, the loss from 6.7 to about 2.1 as the README says; its
    # opening line names the job's description, the log the attention kernel once.
    first = out[README_COMMANDS[0]]
    rows = read_metrics(tmp_path / "outputs" / "debug")
    assert rows[0]["loss"] == pytest.approx(6.72, abs=0.05) and rows[-1]["step"] == 200
    assert rows[-1]["loss"] < 2.4, rows[-1]
    assert first.stdout.startswith("tiny-flavor smoke run on CPU\ntraining llama4 tiny (2.4 M parameters")
    assert (first.stdout + first.stderr).count("attention kernel: cpu_flash (cpu, float32, head_dim 16)") == 1
    assert f"done: step 200/200, loss {rows[-1]['loss']:.4f}" in first.stdout
    # Sampling and evaluation read the 40-step run's checkpoint.
    assert out[README_COMMANDS[2]].stdout.startswith("def main(")
    assert out[README_COMMANDS[3]].stdout.startswith("train loss ")
    assert (tmp_path / "outputs" / "debug-40" / "checkpoint" / "step-40").is_dir()
    for folder, steps in (("debug-8ranks", 10), ("debug-tokens", 40)):
        assert read_metrics(tmp_path / "outputs" / folder)[-1]["step"] == steps
    # No run warns about the schedule the README gave it (the 8-rank run's warm-up was longer than it).
    assert not [c for c, proc in out.items() if "warmup_steps" in proc.stderr]
    # Run again, the first command refuses to replace its finished run, naming a free folder.
    again = _run(README_COMMANDS[0])
    assert again.returncode == 2 and "holds a finished run of this config" in again.stderr, again.stderr[-3000:]
    assert "--job.dump_folder ./outputs/debug-2" in again.stderr and len(read_metrics(tmp_path / "outputs" / "debug")) == 200
    # plan's job file writes beside that finished run, not into it.
    assert "writing to ./outputs/debug-best" in out[README_COMMANDS[6]].stdout, out[README_COMMANDS[6]].stdout
    assert (tmp_path / "best.toml").is_file() and (tmp_path / "all.json").is_file()
