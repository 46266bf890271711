"""`scripts/gpu_check.sh`, the command for the day a GPU is lent: on this machine (no CUDA) it
parses, checks that every step is reachable and skips each with the reason; which steps run
depends on the GPUs present.

    python -m pytest -q tests/unit/test_gpu_check.py
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from tests.launch import cli_env

STEPS = ["gpu_tier", "sdpa_kernels", "scout_bench", "compiled_train", "nccl_parity"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run for real")
def test_without_a_gpu_every_step_is_reachable_and_skipped(tmp_path):
    """What CI runs: the shell script parses, each step's scripts load, its tests collect, its
    jobs pass the dry run; then one table and gpu_check.json, every step SKIP with the reason."""
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")]).returncode == 0
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)], env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["step"] for s in report["steps"]] == STEPS
    for step in report["steps"]:
        assert step["status"] == "SKIP" and step["detail"].startswith("no CUDA device; reachable: "), step
    assert "GPU check on a machine without CUDA" in proc.stdout and all(name in proc.stdout for name in STEPS)


@pytest.mark.parametrize(("gpus", "ran"), [(0, []), (1, STEPS[:4]), (2, STEPS)])
def test_steps_run_where_the_gpus_allow(tmp_path, monkeypatch, gpus, ran):
    """One GPU runs every step but NCCL parity (2 ranks); a failing step fails the run and the
    others still run."""
    gpu_check = _module()
    calls = []

    def run(name):
        def step(out, timeout):
            calls.append(name)
            return gpu_check.Verdict(name, "FAIL" if name == "scout_bench" else "PASS", "ran")
        return step

    monkeypatch.setattr(gpu_check, "STEPS", [gpu_check.Step(s.name, s.gpus, s.timeout, run(s.name),
                                                            lambda out: "checked") for s in gpu_check.STEPS])
    verdicts = gpu_check.run_checks(tmp_path, gpus)
    assert calls == ran
    assert [v.status for v in verdicts] == [("FAIL" if s == "scout_bench" else "PASS") if s in ran else "SKIP"
                                            for s in STEPS]
    if gpus == 1:
        assert verdicts[-1].detail == "needs 2 GPUs, this machine has 1; reachable: checked"


def test_one_gpu_steps_fit_in_8_minutes() -> None:
    """The issue's bound holds by construction: the limits of the steps one GPU runs add up to less."""
    gpu_check = _module()
    assert sum(s.timeout for s in gpu_check.STEPS if s.gpus == 1) < gpu_check.ONE_GPU_LIMIT_S == 8 * 60


def test_an_older_torch_gets_the_shim_of_the_api_it_lacks(monkeypatch):
    """A lent GPU's image may hold an older torch that can't be replaced: the steps then run with
    `scripts/gpu_compat` first on their path, whose `varlen_attn` takes 2.13's `enable_gqa` and
    calls the older one without it; on torch 2.13 the path holds the repo alone."""
    import torch.nn.attention.varlen as varlen

    gpu_check = _module()
    compat = REPO / "scripts" / "gpu_compat"
    assert not gpu_check._env()["PYTHONPATH"].startswith(str(compat))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert gpu_check._env()["PYTHONPATH"].split(":")[:2] == [str(compat), str(REPO)]

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *args, window_size=(-1, -1): calls.append((args, window_size)))
    exec(compile((compat / "sitecustomize.py").read_text(), "sitecustomize.py", "exec"), {})
    varlen.varlen_attn("q", "k", window_size=(-1, 0), enable_gqa=True)
    assert calls == [(("q", "k"), (-1, 0))]
