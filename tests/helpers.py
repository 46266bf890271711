"""What several test files share: the repo's configs, user-error checks, checkpoint folders, the
tiny job of the distributed parity tests (and running many of them in one torchrun world), and an
empty CPU tiny model.

Running the CLI itself is `tests.launch`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.launch import cli_env, run_train

if TYPE_CHECKING:
    from torchmoe.models.llama4 import Transformer

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(REPO / "configs" / "debug_model.toml")
# 900 short documents (2-45 words, one .jsonl line each): every window of the document-masking
# tests packs several (python_docs' windows mostly lie inside one file).
SHORT_DOCUMENTS = ["--training.dataset", "local", "--training.dataset_path",
                   str(REPO / "tests" / "assets" / "short_documents.jsonl")]

# The distributed parity tests' job: the tiny flavor, global batch 8 x 64 tokens, log every step,
# checkpoints on so the seed checkpoint is picked up; warmup 2 so the LR changes across the
# compared steps.
# TINY_JOB without checkpoints: a flag setting a checkpoint key beside checkpoint.enable = false
# has no effect and is refused (`config.dependent_keys`), so a job without saves starts from this.
TINY_RUN = [
    "--config", DEBUG_CONFIG,
    "--training.seq_len", "64", "--training.global_batch_size", "8", "--training.steps", "5",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
]
TINY_JOB = [*TINY_RUN, "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]


# MoE settings of the EP and PP parity tests: an expert-bias rate high enough (0.05, from 1e-3) that
# routing changes visibly from step to step, and the sequence-wise balance loss and router z-loss
# on, so their gradients must be scaled and reduced exactly.
BALANCE = ["--model.load_balance_coeff", "0.05", "--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001"]

# Muon's parity runs (the layout suites' `muon_*` jobs, `muon_reference`): Moonlight's recipe
# (AdamW's lr and weight decay for Muon's matrices through match_rms_adamw, the routers' gates
# under Muon too) over 20 steps, Newton-Schulz in float32. Why float32: the layouts' gradients
# differ from the single process's by summation order (~1e-7 relative); cast to bfloat16 before
# the NS, such a difference flips an element's rounding now and then, a 2^-9 (2e-3) change that
# the NS spreads over the whole matrix: in bf16, EP 2 ended 5.3e-4 off in the loss and 1.8e-3 in
# the gradient norm (CP 2: 4.9e-5 in the norm). In float32 the NS's own rounding stays at ~1e-7
# and the curves agree as AdamW's do (<= 2.1e-7).
MUON = ["--optimizer.name", "Muon", "--optimizer.ns_dtype", "float32", "--optimizer.adjust_lr", "match_rms_adamw",
        "--optimizer.muon_router", "true", "--training.steps", "20"]

# A Llama 4 run that exports Hugging Face weights (checkpoint.last_save_in_hf) trains without the
# aux-loss-free expert bias, Llama 4's default, which its Hugging Face model has no place for (a
# run that trains it is refused: the folder would select other experts).
HF_EXPORT = ["--model.load_balance_coeff", "0"]


def assert_same_curve(got: dict[int, dict], reference: dict[int, dict], label: str, *, rtol: float = 1e-5) -> None:
    """`got` (step -> metrics record) continues `reference` step for step: loss, gradient norm
    and MoE imbalance within `rtol`, per-expert token counts exactly."""
    assert sorted(got) == sorted(reference), label
    for step, ref in reference.items():
        for key in ("loss", "grad_norm", "moe_imbalance"):
            assert got[step][key] == pytest.approx(ref[key], rel=rtol), (label, step, key)
        assert got[step]["tokens_per_expert"] == ref["tokens_per_expert"], (label, step)


def write_toml(tmp_path: Path, text: str) -> str:
    """`text` as `tmp_path/job.toml`; returns its path."""
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def assert_user_error(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    """A user error as the CLI reports it: exit 2, one `error:` line, no traceback, and each of
    `expected` in the message."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


def start_from(checkpoint: Path, dump_folder: Path) -> Path:
    """Place a copy of `checkpoint` (a step-N folder) where a run in `dump_folder` resumes from;
    returns `dump_folder`."""
    shutil.copytree(checkpoint, dump_folder / "checkpoint" / checkpoint.name)
    return dump_folder


def train_tiny(dump_folder: Path, args: list[str], *, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    """`torchmoe train TINY_JOB + args` into `dump_folder` on `nproc` ranks; raises on failure."""
    return run_train([*TINY_JOB, *args], dump_folder=dump_folder, nproc=nproc, timeout=300)


def train_tiny_here(dump_folder: Path, args: list[str]) -> None:
    """`train_tiny` on one rank in this process: the same job without starting an interpreter
    (seconds a run). Its numbers match other runs of this process, not `train_tiny`'s (another
    thread count); its log lines reach this process's stderr."""
    from torchmoe.commands import cli

    assert cli.main(["train", *TINY_JOB, *args, "--job.dump_folder", str(dump_folder)]) == 0


def seed_checkpoint(folder: Path, args: list[str] = ()) -> Path:
    """Write a seed checkpoint of TINY_JOB in this process (no step is computed: the weights do
    not depend on the process's thread count) and return its step-0 folder."""
    train_tiny_here(folder, ["--checkpoint.create_seed_checkpoint", "true", *args])
    return folder / "checkpoint" / "step-0"


@dataclass(frozen=True)
class Job:
    """A `train_tiny` run of `TinyRuns`: TINY_JOB + `args` on `nproc` ranks, starting from `start`:
    "seed" (the runs' seed checkpoint), a step-N checkpoint folder, (label, N) (the step-N
    checkpoint of another job), or None (no checkpoint: a fresh run, or one that loads
    `checkpoint.initial_load_path`). `preflight` False skips the checks before training that
    refuse what this machine cannot run usefully (FSDP CPU offload without an accelerator), to
    run that code path anyway. `saves` False runs with `checkpoint.load_only` (the job loads
    its start and writes no checkpoint, a DCP save of every rank it would not need): what
    `TinyRuns` picks for a job no other job starts from, unless `saves` is True (a test reads
    its checkpoints)."""

    nproc: int
    args: list[str]
    start: str | Path | tuple[str, int] | None = "seed"
    preflight: bool = True  # False: force a code path the preflight refuses on this machine
    flash: bool = False  # attention on CUDA flash's path, emulated, host reads counted (train_jobs.py)
    saves: bool = False  # True: a test reads its checkpoints (a job another starts from saves anyway)


class TinyRuns:
    """`train_tiny` jobs, run on first use. All jobs on the same number of ranks (> 1) run, in the
    order given, in one world (`tests/distributed/train_jobs.py`): starting a world costs more
    than a tiny job. One-process jobs run in the test's own process (without a process group, as
    `torchmoe train` runs on one rank, on one thread as each rank), except those starting from
    another job's checkpoint: each of these runs alone, once that job has run.

    Args:
        seed: the step-0 folder of the runs' seed checkpoint.
        root: where each job gets its dump folder, `root / label`.
        jobs: label -> job. A job may start from a checkpoint of a job in another world (or of a
            one-process job), or of an earlier job in its own.
    """

    def __init__(self, seed: Path, root: Path, jobs: dict[str, Job]) -> None:
        self.seed, self.root, self.jobs = seed, root, jobs
        self._outcome: dict[int | str, BaseException | None] = {}  # group -> the error its run ended with

    def folder(self, label: str) -> Path:
        """The dump folder of `label`, once it (and every job of its world) has run."""
        self._run(self._group(label))
        return self.root / label

    def _group(self, label: str) -> int | str:
        """What runs together: a world (or one process) per rank count; a one-process job that
        starts from another job's checkpoint alone."""
        job = self.jobs[label]
        return label if job.nproc == 1 and isinstance(job.start, tuple) else job.nproc

    def _start(self, label: str) -> Path | None:
        start = self.jobs[label].start
        if start == "seed":
            return self.seed
        if not isinstance(start, tuple):
            return start
        source, step = start
        if self._group(source) != self._group(label):
            self._run(self._group(source))
        else:
            assert list(self.jobs).index(source) < list(self.jobs).index(label), (label, "starts from a later job")
        return self.root / source / "checkpoint" / f"step-{step}"

    def _run(self, group: int | str) -> None:
        if group not in self._outcome:
            # What a job of `group` meets if it (through others) starts from a checkpoint of `group` itself.
            self._outcome[group] = RuntimeError(f"the jobs of {group!r} start from their own checkpoints")
            try:
                self._train(group)
                self._outcome[group] = None
            except BaseException as err:  # the tests of the group's other jobs fail with it too
                self._outcome[group] = err
        if self._outcome[group] is not None:
            raise self._outcome[group]

    def _train(self, group: int | str) -> None:
        labels = [label for label in self.jobs if self._group(label) == group]
        sources = {job.start[0] for job in self.jobs.values() if isinstance(job.start, tuple)}
        jobs = [{"label": label, "args": [*TINY_JOB, *self.jobs[label].args, *(
                    () if self.jobs[label].saves or label in sources else ("--checkpoint.load_only", "true"))],
                 "dump_folder": str(self.root / label),
                 "start_from": str(start) if (start := self._start(label)) else None,
                 "preflight": self.jobs[label].preflight, "flash": self.jobs[label].flash} for label in labels]
        if self.jobs[labels[0]].nproc == 1:
            from tests.distributed.train_jobs import run_here

            run_here(jobs)
            return
        out = self.root / f"jobs_{group}"
        out.mkdir()
        (out / "jobs.json").write_text(json.dumps(jobs))
        run_rank_script(str(REPO / "tests" / "distributed" / "train_jobs.py"), out, world=self.jobs[labels[0]].nproc,
                        timeout=120 + 120 * len(jobs))


@contextmanager
def refusing_attention_masks():
    """While inside, any `torch.nn.functional.scaled_dot_product_attention` call given a mask
    tensor raises: what fused GPU kernels do (flash attention takes no mask; with one, SDPA falls
    back to the math kernel and its score matrix). Every training path must run under it."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def refusing(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None:
            raise AssertionError(f"scaled_dot_product_attention got a {tuple(attn_mask.shape)} mask tensor")
        return sdpa(query, key, value, None, *args, **kwargs)

    F.scaled_dot_product_attention = refusing
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


class HostReads:
    """Counts the reads of tensor values on the host (``item``, ``bool``/``int``/``float`` of a
    tensor, ``tolist``, ``numpy``, ``nonzero`` and the other ops whose result's size depends on
    the values) made while `counting`: on a GPU every one of them waits for the device. The
    tensor methods and functions themselves are wrapped, so reads inside custom operators'
    kernels count too (torch's function and dispatch modes do not see inside them). Reads made
    while `paused` (a test's own bookkeeping) are not counted."""

    METHODS = ("item", "tolist", "numpy", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
               "__bool__", "__int__", "__float__", "__index__")
    FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive")

    def __init__(self) -> None:
        from collections import Counter

        self.counts: Counter[str] = Counter()
        self.paused = False

    @contextmanager
    def counting(self):
        import torch

        def wrap(name, read):
            def counted(*args, **kwargs):
                if not self.paused:
                    self.counts[name] += 1
                return read(*args, **kwargs)
            return counted

        patched = [(torch.Tensor, name) for name in self.METHODS] + [(torch, name) for name in self.FUNCTIONS]
        saved = [getattr(owner, name) for owner, name in patched]
        for (owner, name), read in zip(patched, saved):
            setattr(owner, name, wrap(name, read))
        try:
            yield self
        finally:
            for (owner, name), read in zip(patched, saved):
                setattr(owner, name, read)

    @contextmanager
    def pause(self):
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


@contextmanager
def counting_model_reads(trainer, reads: HostReads):
    """While inside, the host reads of `trainer`'s forward and backward passes are counted in
    `reads` (`Trainer.forward_backward`, but the batch's own host work, `_local_columns`, which
    builds the segment tables from the host token ids before they travel)."""
    forward_backward, local_columns = trainer.forward_backward, trainer._local_columns

    def counted(micro_batches):
        with reads.counting():
            return forward_backward(micro_batches)

    def uncounted(inputs, labels, starts=None, real=None):
        with reads.pause():
            return local_columns(inputs, labels, starts, real)

    trainer.forward_backward, trainer._local_columns = counted, uncounted
    try:
        yield reads
    finally:
        trainer.forward_backward, trainer._local_columns = forward_backward, local_columns


@contextmanager
def emulated_flash(reads: HostReads | None = None):
    """While inside, document masking takes CUDA flash's path on the CPU: `nn.segment_attention`
    chooses the flash kernel, and torch's ``varlen_attn`` is replaced by a stand-in that checks
    what the CUDA kernel assumes of its operands (3-D with the head dim contiguous; int32,
    contiguous cumulative offsets on the queries' device from 0 to the packed lengths, never
    decreasing; bounds no shorter than any segment; causal windows, sliding ones as (W - 1, 0);
    grouped heads) and computes the same attention with the host segments' kernels, returning its
    log-sum-exp when asked (``return_aux``). Flash's varlen backward given another output and
    log-sum-exp (`_torch_private.flash_varlen_attention_backward`, what sinks need) is replaced
    the same way, its operands checked as well. Their own reads are paused in `reads`. Yields the
    list of the forward calls' (q, k, v, cu_q, cu_k, max_q, max_k, window_size) shapes and values,
    for the test."""
    import torch

    from torchmoe import _torch_private as private
    from torchmoe.nn import segment_attention
    from torchmoe.nn.attention_kernel_choice import FLASH

    calls = []
    pause = (lambda: reads.pause()) if reads is not None else contextlib.nullcontext

    def check(q, k, v, cu_q, cu_k, max_q, max_k, window_size):
        assert window_size[1] == 0 and (window_size[0] == -1 or window_size[0] >= 0), window_size
        assert q.dim() == k.dim() == v.dim() == 3 and all(t.stride(-1) == 1 for t in (q, k, v))
        assert q.shape[1] % k.shape[1] == 0
        for cu, packed_rows, bound in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and cu.device == q.device
            values = cu.tolist()
            assert values[0] == 0 and values[-1] == packed_rows, (values, packed_rows)
            lengths = [b - a for a, b in zip(values, values[1:])]
            assert min(lengths) >= 0 and max(lengths) <= bound, (lengths, bound)
        assert cu_q.shape == cu_k.shape

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, return_aux=None,
               **kwargs):
        with pause():
            assert not kwargs, kwargs
            assert enable_gqa or q.shape[1] == k.shape[1]
            check(q, k, v, cu_q, cu_k, max_q, max_k, window_size)
            calls.append(tuple(tuple(t.shape) for t in (q, k, v, cu_q, cu_k)) + (max_q, max_k, tuple(window_size)))
        out, lse = Varlen.apply(q, k, v, cu_q, cu_k, window_size[0] + 1)
        return (out, lse) if return_aux is not None and return_aux.lse else out

    def varlen_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, window_left):
        with pause():
            check(q, k, v, cu_q, cu_k, max_q, max_k, (window_left, 0))
            assert out.shape == q.shape and out.dtype == q.dtype and grad.shape == q.shape
            assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
            assert lse.is_contiguous() and lse.shape == (q.shape[1], q.shape[0])
            return segment_attention.host_segments_backward(grad, q, k, v, out, lse, cu_q.cpu(), cu_k.cpu(),
                                                            window_left + 1)

    class Varlen(torch.autograd.Function):
        """The kernel's result from the host segments' kernels, its reads (forward and backward)
        paused; its log-sum-exp, as the kernel's, takes no gradient."""

        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, window):
            with pause():
                tables = (cu_q.cpu(), cu_k.cpu())
                out, lse = segment_attention.host_segments_forward(q, k, v, *tables, window)
                out = out.to(q.dtype)  # the log-sum-exp in fp32 (fp64 for fp64 inputs, which the tests run)
            ctx.save_for_backward(q, k, v, out, lse, *tables)
            ctx.window = window
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad, _grad_lse):
            with pause():
                q, k, v, out, lse, *tables = ctx.saved_tensors
                grads = segment_attention.host_segments_backward(grad.contiguous(), q, k, v, out, lse, *tables,
                                                                 ctx.window)
            return *grads, None, None, None

    saved = segment_attention.kernel_for, segment_attention.varlen_attn, private.flash_varlen_attention_backward
    segment_attention.kernel_for, segment_attention.varlen_attn = (lambda q: FLASH), varlen
    private.flash_varlen_attention_backward = varlen_backward
    try:
        yield calls
    finally:
        segment_attention.kernel_for, segment_attention.varlen_attn, private.flash_varlen_attention_backward = saved


def empty_tiny_model() -> Transformer:
    """A tiny model on CPU in eval mode, its weights allocated but not initialised (to load into)."""
    import torch

    from torchmoe.models.llama4 import FLAVORS, Transformer

    with torch.device("meta"):
        model = Transformer(FLAVORS["tiny"])
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    return model.eval()


def write_rank_record(out_dir: Path, record: dict) -> None:
    """The end of a `run_rank_script` worker: write this rank's record, wait for every rank,
    leave the process group (in one process without a process group: write rank 0's)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_rank_script(script: str, out_dir: Path, *, world: int, timeout: int) -> dict[int, dict]:
    """Run a test file's ``_worker(OUT_DIR)`` on `world` CPU ranks (each rank writes
    ``OUT_DIR/rank<r>.json``) and return rank -> that record. The ranks are forked from one
    process that imported the stack once (`tests/fork_ranks.py`: torchrun's worker environment,
    a fraction of its start-up). `world` 1: ``python FILE OUT_DIR``, one plain process without a
    process group (no WORLD_SIZE)."""
    env = {**cli_env(), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # 1 thread a rank
    cmd = [sys.executable, script, str(out_dir)] if world == 1 else \
        [sys.executable, str(REPO / "tests" / "fork_ranks.py"), script, str(out_dir), str(world)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)}


def compute_dtypes(trainer) -> dict[str, list[str]]:
    """Run one `forward_backward` of `trainer` on its next batch and report the dtypes that ran:
    ``q_proj`` / ``experts`` (the outputs of every local block's attention q projection and
    routed experts), ``params`` and ``grads`` (every local parameter and its gradient), each as
    a sorted list of dtype names (a DTensor's local dtype)."""
    seen: dict[str, set[str]] = {"q_proj": set(), "experts": set()}

    def record(key: str):
        def hook(module, args, output) -> None:
            seen[key].add(str(output.dtype))
        return hook

    handles = []
    for block in trainer.model.layers.values():
        handles.append(block.attention.wq.register_forward_hook(record("q_proj")))
        if block.moe_enabled:
            handles.append(block.moe.experts.register_forward_hook(record("experts")))
    trainer.forward_backward(trainer.dataloader.next_batch())
    for handle in handles:
        handle.remove()
    params = list(trainer.model.parameters())
    seen["params"] = {str(p.dtype) for p in params}
    seen["grads"] = {str(p.grad.dtype) for p in params if p.grad is not None}
    return {key: sorted(values) for key, values in seen.items()}


def small_bpe(path: Path) -> Path:
    """A small byte-level BPE tokenizer.json with Llama 4's special tokens (vocab 300 < tiny's), at `path`."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "<|begin_of_text|>", "<|end_of_text|>", "<unk>"])
    tok.train_from_iterator(["def train(model): return model"] * 20, trainer)
    tok.save(str(path))
    return path


def leave_world() -> None:
    """Destroy this process's (test) world and forget what DTensor cached about its meshes.

    DTensor's sharding propagation caches output specs keyed by specs whose meshes compare by
    their ranks, so a later world's equal mesh would get this one's, naming its destroyed process
    groups ("Could not resolve the process group registered under the name 16", seen in random
    order). torch's own helper for it is private (torch.distributed.tensor.debug)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()
