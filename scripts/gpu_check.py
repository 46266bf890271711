"""The checks for the day a GPU is lent: one command, one summary table (`scripts/gpu_check.sh`).

    bash scripts/gpu_check.sh                  # every check this machine's GPUs allow
    bash scripts/gpu_check.sh --out DIR        # logs and gpu_check.json there (default outputs/gpu_check)

Steps (each a subprocess with its own time limit; one GPU: under 8 minutes in all):

    gpu_tier        the GPU test tier (tests/gpu, but the attention file): grouped GEMMs, init,
                    one-GPU training and MFU, float8
    sdpa_kernels    tests/gpu/test_attention_gpu.py: every attention kind and CP mode's calls with
                    SDPA's math kernel excluded; document masking in bf16/fp16 on flash's varlen
                    kernel and fp32 on the memory-efficient one against each document alone
                    (forward and the three gradients, CP prefixes too), torchmoe's math fallback
                    never run; gpt-oss's sinks and windows on flash and memory-efficient kernels
                    (forward, gradients and the sinks' gradient); peak memory vs the planner on a Scout stack (2 layers, seq 32K, cp 1)
    scout_bench     scripts/bench_scout_stack.py in bf16 and float8: tokens/s, MFU against the
                    GPU's bf16 peak, peak memory against the planner's
    compiled_train  the debugmodel flavor, compiled, bf16, 50 steps on one GPU, against the same
                    job in fp32 on the host: the first EARLY steps' losses within LOSS_RTOL
                    and the last TAIL steps' mean within LOSS_TAIL_RTOL (bf16's bounds)
    nccl_parity     (2+ GPUs) the gloo parity jobs on NCCL, 2 ranks: FSDP, TP, EP, CP, PP and FSDP
                    with CPU offload against one GPU, loss and gradient norm within PARITY_RTOL

Without a GPU (CI) every step is skipped with the reason, after checking that it is reachable:
its scripts and test files exist and load, its tests collect, its training job passes
`torchmoe train --dry-run`. The table and `gpu_check.json` say what ran and what it measured.
Exit status: 0 when no step failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers, for the parity jobs' common arguments

from tests.helpers import TINY_RUN  # noqa: E402
from tests.launch import cli_env, metrics_by_step  # noqa: E402

# bf16 against fp32 over 50 steps of the debugmodel flavor. On an H200 (2026-12-04) the first 12
# steps' losses agreed within 5.5e-4; then routing ties flip, single steps part (one bf16 spike:
# 1.1e-1 off, gradient norm 10.3 against 1.2) and the last 10 steps' mean sat 2.8e-2 above fp32
# (on CPU, 2026-12-02: 9.1e-3). Before the flips a step's loss is a kernel check (bound 1e-2);
# after them only the curve's level is (bound 3e-2 on the last 10 steps' mean).
LOSS_RTOL, EARLY, LOSS_TAIL_RTOL, TAIL = 1e-2, 12, 3e-2, 10
# fp32 on NCCL against one GPU: the same arithmetic but for reduction orders (atomics in the
# embedding and MoE combine backward, NCCL's ring sums), ~1e-6 relative; the bound is 1e-4.
PARITY_RTOL = 1e-4
MEMORY_RTOL = 0.10  # the planner's promise for a step's peak
COMPILED_STEPS = 50

# The NCCL parity layouts: the gloo parity jobs' flags (tests/distributed), on 2 GPUs.
PARITY_LAYOUTS = {
    "fsdp2": ["--training.local_batch_size", "4"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--training.local_batch_size", "8"],
    "ep2": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--training.seq_len", "384", "--training.local_batch_size", "8"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--training.local_batch_size", "8"],
    "fsdp2_cpu_offload": ["--training.local_batch_size", "4", "--parallelism.fsdp_cpu_offload", "true"],
}
GPU = ["--training.device", "cuda", "--training.mixed_precision_param", "float32"]  # without checkpoints: TINY_RUN


@dataclass
class Verdict:
    step: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0
    measured: dict | None = None


@dataclass(frozen=True)
class Step:
    """One check: `run` on a machine with at least `gpus` GPUs, else `reachable` (returns what it
    checked) and a skip."""

    name: str
    gpus: int
    timeout: int
    run: Callable[[Path, int], Verdict]
    reachable: Callable[[Path], str]


def _old_torch() -> bool:
    """This machine's torch predates the 2.13 torchmoe needs (a lent GPU's image can't upgrade)."""
    import torch

    return tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)


def _env() -> dict[str, str]:
    """The steps' environment: the repo importable without an install (a lent GPU machine runs the
    checkout with its own torch; `scripts/*.py` and `tests/*.py` otherwise see only their folder),
    and on an older torch `scripts/gpu_compat`'s shim of the 2.13 API the GPU paths call."""
    env = cli_env(threads=None)
    paths = [str(REPO / "scripts" / "gpu_compat")] if _old_torch() else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, str(REPO), env.get("PYTHONPATH")]))
    return env


def _python(*args: str, out: Path, name: str, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` from the repo root, its output kept in OUT/NAME.log."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env or _env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    (out / f"{name}.log").write_text(proc.stdout)
    return proc


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


# ---- pytest steps -------------------------------------------------------------------------------

ATTENTION_TESTS = "tests/gpu/test_attention_gpu.py"


def _pytest_step(name: str, targets: list[str]) -> tuple[Callable, Callable]:
    def run(out: Path, timeout: int) -> Verdict:
        proc = _python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *targets, out=out, name=name,
                       timeout=timeout)
        return Verdict(name, "PASS" if proc.returncode == 0 else "FAIL", _tail(proc.stdout))

    def reachable(out: Path) -> str:
        proc = _python("-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *targets, out=out,
                       name=f"{name}_collect", timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"collecting {' '.join(targets)} failed: {_tail(proc.stdout)}")
        return _tail(proc.stdout)

    return run, reachable


# ---- the Scout stack benchmark ------------------------------------------------------------------


def _scout_bench(out: Path, timeout: int) -> Verdict:
    result_file = out / "bench_scout_stack.json"
    proc = _python("scripts/bench_scout_stack.py", "--precisions", "bf16", "float8", "--steps", "6", "--warmup", "2",
                   "--out", str(result_file), out=out, name="scout_bench", timeout=timeout)
    if proc.returncode != 0:
        return Verdict("scout_bench", "FAIL", _tail(proc.stdout))
    runs = json.loads(result_file.read_text())["runs"]
    parts = [f"{name}: {run['tokens_per_sec']:,.0f} tok/s, MFU {run['mfu_pct']:.1f}%, "
             f"{run['memory_gib']:.1f}/{run['memory_planned_gib']:.1f} GiB planned" for name, run in runs.items()]
    # The planner models bf16 compute; float8 runs are reported, not held to it.
    ok = abs(runs["bf16"]["memory_vs_planner"] - 1) <= MEMORY_RTOL
    return Verdict("scout_bench", "PASS" if ok else "FAIL", "; ".join(parts), measured=runs)


def _scout_bench_reachable(out: Path) -> str:
    proc = _python("scripts/bench_scout_stack.py", "--help", out=out, name="scout_bench_help", timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_scout_stack.py --help failed: {_tail(proc.stdout)}")
    return "bench_scout_stack.py loads"


# ---- the compiled debugmodel run ------------------------------------------------------------------

COMPILED_JOB = ["--config", "configs/debug_model.toml", "--model.flavor", "debugmodel", "--training.steps",
                str(COMPILED_STEPS), "--metrics.log_freq", "1"]


def _train(args: list[str], dump: Path, out: Path, name: str, timeout: int, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ["-m", "torchmoe"] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                                      "-m", "torchmoe"]
    return _python(*launcher, "train", *args, "--job.dump_folder", str(dump), out=out, name=name, timeout=timeout)


def _compiled_train(out: Path, timeout: int) -> Verdict:
    # The fp32 reference trains on the host meanwhile (seconds of CPU, no GPU).
    host = subprocess.Popen([sys.executable, "-m", "torchmoe", "train", *COMPILED_JOB, "--training.device", "cpu",
                             "--training.mixed_precision_param", "float32", "--job.dump_folder", str(out / "host_fp32")],
                            cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    gpu = _train([*COMPILED_JOB, "--training.device", "cuda", "--compile.enable", "true",
                  "--training.mixed_precision_param", "bfloat16"], out / "gpu_bf16", out, "compiled_train", timeout)
    host_status = host.wait(timeout=timeout)
    if gpu.returncode != 0 or host_status != 0:
        return Verdict("compiled_train", "FAIL", _tail(gpu.stdout) if gpu.returncode else "the host fp32 run failed")
    got, ref = metrics_by_step(out / "gpu_bf16"), metrics_by_step(out / "host_fp32")
    if sorted(got) != sorted(ref):
        return Verdict("compiled_train", "FAIL", f"logged steps differ: {sorted(got)} vs {sorted(ref)}")
    worst = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in range(1, EARLY + 1))
    tail = range(COMPILED_STEPS - TAIL + 1, COMPILED_STEPS + 1)
    mean = lambda run: sum(run[s]["loss"] for s in tail) / TAIL
    tail_rel = abs(mean(got) - mean(ref)) / mean(ref)
    first = got[1]
    detail = (f"{COMPILED_STEPS} steps: loss {ref[1]['loss']:.3f} -> {ref[COMPILED_STEPS]['loss']:.3f} (fp32); "
              f"bf16 off by {worst:.1e} at worst over the first {EARLY} (bound {LOSS_RTOL:g}), {tail_rel:.1e} "
              f"over the last {TAIL} "
              f"(bound {LOSS_TAIL_RTOL:g}); {first.get('compile_graphs')} graphs, "
              f"{first.get('compile_graph_breaks')} breaks, first step {first.get('first_step_s', 0):.1f} s")
    ok = worst <= LOSS_RTOL and tail_rel <= LOSS_TAIL_RTOL
    return Verdict("compiled_train", "PASS" if ok else "FAIL", detail,
                   measured={"worst_rel": worst, "tail_rel": tail_rel})


def _dry_run(args: list[str], dump: Path, world_size: int = 1) -> None:
    """`torchmoe train ARGS --dry-run` in this process (no GPU needed); raises if it refuses."""
    from torchmoe.commands.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        status = main(["train", *args, "--job.dump_folder", str(dump), "--dry-run", "--world-size", str(world_size)])
    if status != 0:
        raise RuntimeError(f"the dry run of {' '.join(args)} exited {status}: {_tail(text.getvalue())}")


def _compiled_train_reachable(out: Path) -> str:
    _dry_run([*COMPILED_JOB, "--training.device", "cuda", "--compile.enable", "true"], out / "compiled_dry")
    return "its job passes --dry-run"


# ---- NCCL parity ----------------------------------------------------------------------------------


def _parity_jobs(out: Path, layouts: dict[str, list[str]]) -> Path:
    """A `tests/distributed/train_jobs.py` jobs folder for `layouts` on CUDA (fp32, no seed
    checkpoint: every layout draws the same weights)."""
    folder = out / f"jobs_{len(layouts)}"
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [{"label": label, "args": [*TINY_RUN, *flags, *GPU], "dump_folder": str(out / label), "start_from": None,
             "preflight": True} for label, flags in layouts.items()]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    return folder


def _nccl_parity(out: Path, timeout: int) -> Verdict:
    env = _env()
    # One GPU, the same global batch: each layout's reference (cp2 trains longer sequences).
    singles = {"single": ["--training.local_batch_size", "8"],
               "single_384": ["--training.local_batch_size", "8", "--training.seq_len", "384"]}
    started = time.monotonic()
    one = _python("tests/distributed/train_jobs.py", str(_parity_jobs(out / "one_gpu", singles)), out=out,
                  name="nccl_parity_single", timeout=timeout, env=env)
    left = max(60, timeout - int(time.monotonic() - started))
    two = _python("tests/fork_ranks.py", "tests/distributed/train_jobs.py",
                  str(_parity_jobs(out / "two_gpus", PARITY_LAYOUTS)), "2", out=out, name="nccl_parity", timeout=left,
                  env=env)
    if one.returncode != 0 or two.returncode != 0:
        return Verdict("nccl_parity", "FAIL", _tail((two if two.returncode else one).stdout))
    worst: dict[str, float] = {}
    for label, flags in PARITY_LAYOUTS.items():
        ref = metrics_by_step(out / "one_gpu" / ("single_384" if "384" in flags else "single"))
        got = metrics_by_step(out / "two_gpus" / label)
        worst[label] = max(abs(got[s][key] - ref[s][key]) / abs(ref[s][key]) for s in ref
                           for key in ("loss", "grad_norm"))
    ok = all(value <= PARITY_RTOL for value in worst.values())
    detail = ", ".join(f"{label} {value:.1e}" for label, value in worst.items()) + f" (bound {PARITY_RTOL:g})"
    return Verdict("nccl_parity", "PASS" if ok else "FAIL", detail, measured=worst)


def _nccl_parity_reachable(out: Path) -> str:
    for path in ("tests/fork_ranks.py", "tests/distributed/train_jobs.py"):
        if not (REPO / path).is_file():
            raise RuntimeError(f"{path} is missing")
    for label, flags in PARITY_LAYOUTS.items():
        _dry_run([*TINY_RUN, *flags, *GPU], out / f"dry_{label}", world_size=2)
    return f"{len(PARITY_LAYOUTS)} layouts pass --dry-run"


# Time limits in seconds: the one-GPU steps' add up to 460, so one GPU finishes within 8 minutes
# whatever happens (a step past its limit fails, and the next one starts).
ONE_GPU_LIMIT_S = 480
STEPS = [
    Step("gpu_tier", 1, 140, *_pytest_step("gpu_tier", ["tests/gpu", "--ignore", ATTENTION_TESTS])),
    Step("sdpa_kernels", 1, 90, *_pytest_step("sdpa_kernels", [ATTENTION_TESTS])),
    Step("scout_bench", 1, 140, _scout_bench, _scout_bench_reachable),
    Step("compiled_train", 1, 90, _compiled_train, _compiled_train_reachable),
    Step("nccl_parity", 2, 300, _nccl_parity, _nccl_parity_reachable),
]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_checks(out: Path, gpus: int) -> list[Verdict]:
    """Every step, run where this machine has the GPUs for it, else checked for reachability and
    skipped with the reason."""
    out.mkdir(parents=True, exist_ok=True)
    verdicts = []
    for step in STEPS:
        started = time.monotonic()
        try:
            if gpus >= step.gpus:
                verdict = step.run(out, step.timeout)
            else:
                why = "no CUDA device" if gpus == 0 else f"needs {step.gpus} GPUs, this machine has {gpus}"
                verdict = Verdict(step.name, "SKIP", f"{why}; reachable: {step.reachable(out)}")
        except subprocess.TimeoutExpired:
            verdict = Verdict(step.name, "FAIL", f"ran past its {step.timeout} s limit")
        except Exception as err:  # noqa: BLE001 - a broken step is that step's failure, the others still run
            verdict = Verdict(step.name, "FAIL", f"{type(err).__name__}: {err}")
        verdict.seconds = round(time.monotonic() - started, 1)
        verdicts.append(verdict)
    return verdicts


def _print_table(verdicts: list[Verdict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU check on {device}")
    for column in ("step", "verdict", "seconds", "detail"):
        table.add_column(column, overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for v in verdicts:
        table.add_row(v.step, f"[{colour[v.status]}]{v.status}[/]", f"{v.seconds:.0f}", v.detail)
    Console(soft_wrap=True).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/gpu_check", help="logs and gpu_check.json")
    opts = parser.parse_args(argv)
    out = Path(opts.out).resolve()
    gpus = _gpus()
    import torch

    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "a machine without CUDA"
    device += f", torch {torch.__version__}" + (" (scripts/gpu_compat shims 2.13's varlen_attn)" if _old_torch() else "")
    verdicts = run_checks(out, gpus)
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                    "steps": [asdict(v) for v in verdicts]}, indent=2) + "\n")
    _print_table(verdicts, device)
    return 1 if any(v.status == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
