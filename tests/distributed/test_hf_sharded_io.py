"""Hugging Face weights in and out under sharded layouts: each rank reads and writes only its shards.

    python -m pytest -q tests/distributed/test_hf_sharded_io.py

One torchrun world of 4 CPU/gloo ranks. For each layout every rank builds the real `Trainer`
with `checkpoint.initial_load_in_hf` pointing at a Hugging Face folder the test wrote in one
process, loads it, and then writes it back with the trainer's `last_save_in_hf` path:

- every loaded local shard equals the matching slice of the folder's tensors (exactly: the
  weights are copied, not computed), as the single-process `load_model` (today's path) gives;
- the folder written back holds exactly the input folder's tensors, names and shapes
  (w1 and w3 written by different ranks, or as two column slices by one rank under MoE TP,
  must land in the right halves of Llama 4's fused `gate_up_proj`; Qwen3-MoE's and DeepSeek-V3's
  experts, one tensor each, are written by the ranks holding them, or in row slices under MoE
  TP; DeepSeek-V3's expert bias, a buffer, in and out as e_score_correction_bias, and its
  multi-token prediction layer with the release's copies of the embedding and head; gpt-oss's
  MXFP4 folder, each rank dequantising only its box of blocks, loads as its unpacked twin);
- the load's peak host memory per rank (VmHWM reset before the load, minus the resident size
  before it) stays near the rank's shard and well under the full model: measured on bench256
  under FSDP 4, whose full model is 4x a rank's shard.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import run_rank_script, write_rank_record
from tests.hf_parity import mxfp4_exact_experts, mxfp4_folder

pytestmark = pytest.mark.distributed

WORLD = 4
REPO = Path(__file__).resolve().parents[2]
BASE = ["--config", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "32",
        "--training.local_batch_size", "1", "--training.steps", "1", "--checkpoint.enable", "true",
        "--checkpoint.initial_load_in_hf", "true", "--model.load_balance_coeff", "0"]
LAYOUTS = {
    "fsdp4": [],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    "ddp4": ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
    "fsdp2_tp2_moe_tp": ["--parallelism.tensor_parallel_degree", "2"],
    "fsdp2_tp2_ep4": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
    "fsdp4_ep2": ["--parallelism.expert_parallel_degree", "2"],
    "pp2_fsdp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe"],
}
# The other families' tiny flavors, in the same world: Qwen3-MoE (one tensor per expert in the
# folder, per-head QK norms, a dense layer), DeepSeek-V3 (one tensor per expert, latent
# attention's replicated bottleneck under TP, the expert bias stored as e_score_correction_bias)
# and gpt-oss (fused input-major experts with biases, sinks split with the heads under TP).
_FAMILY_FLAGS = {
    "fsdp4": [],
    "fsdp2_tp2_moe_tp": ["--parallelism.tensor_parallel_degree", "2"],
    "fsdp2_tp2_ep4": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
    "pp2_ep2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe",
                "--parallelism.expert_parallel_degree", "2"],
}
# gpt-oss's FSDP and TP x EP layouts load its MXFP4 twin below, which checks more (the packed read,
# and the save of the unpacked folder): its plain folder is read under the others.
_FAMILY_SKIP = {"gpt_oss": {"fsdp4", "fsdp2_tp2_ep4"}}
FAMILY_LAYOUTS = {
    f"{family}_{name}": (family, ["--model.name", family, *flags]) for family in ("qwen3", "deepseek_v3", "gpt_oss")
    for name, flags in _FAMILY_FLAGS.items() if name not in _FAMILY_SKIP.get(family, ())
}
# DeepSeek-V3 with its multi-token prediction layer, as released (model.layers.{n_layers}, with its
# copies of the embedding and head): its block under TP x EP, its projection replicated over tp.
FAMILY_LAYOUTS["deepseek_v3_mtp_fsdp2_tp2_ep4"] = (
    "deepseek_v3_mtp", ["--model.name", "deepseek_v3", "--model.mtp_layers", "1", *_FAMILY_FLAGS["fsdp2_tp2_ep4"]])
# gpt-oss's folder in the releases' form (experts as MXFP4 blocks and scales): each rank reads and
# dequantises the box of blocks its shard covers. TP 4 gives each rank 16 of a down projection's
# 64 inputs: half a scale group, cut out of the group read.
MXFP4_LAYOUTS = {
    f"gpt_oss_mxfp4_{name}": ("gpt_oss_mxfp4", ["--model.name", "gpt_oss", *flags]) for name, flags in {
        "fsdp4": [],
        "tp4_moe_tp": ["--parallelism.tensor_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
        "fsdp2_tp2_ep4": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
    }.items()
}
MEMORY_LAYOUT = ["--model.flavor", "bench256"]


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


_OPENS: list[tuple[Path, list[str]]] = []  # (folder, names opened under it) while a load is counted


def _count_open(event: str, args: tuple) -> None:
    if event == "open" and _OPENS and isinstance(args[0], (str, Path)):
        folder, names = _OPENS[-1]
        if Path(args[0]).parent == folder:
            names.append(Path(args[0]).name)


@contextmanager
def _opens_under(folder: Path) -> Iterator[list[str]]:
    """The names of `folder`'s files this process opens meanwhile: through Python's `open` (an
    audit event) and through safetensors' `safe_open` (Rust's own open, which raises none), as
    torch's reader and torchmoe call it."""
    import safetensors

    from torchmoe.hf_files import hf_storage, mxfp4

    if not getattr(_count_open, "hooked", False):  # an audit hook stays for the process's life
        sys.addaudithook(_count_open)
        _count_open.hooked = True
    names: list[str] = []
    real = safetensors.safe_open

    def counted(filename, *args, **kwargs):
        if Path(filename).parent == folder:
            names.append(Path(filename).name)
        return real(filename, *args, **kwargs)

    _OPENS.append((folder, names))
    safetensors.safe_open = hf_storage.safe_open = mxfp4.safe_open = counted
    try:
        yield names
    finally:
        safetensors.safe_open = hf_storage.safe_open = mxfp4.safe_open = real
        _OPENS.pop()


def _load_and_save(label: str, flags: list[str], hf_in: Path, out_dir: Path) -> dict:
    """Build the layout's trainer, load `hf_in` into it (measuring host memory), compare its
    shards with the full tensors, and save it back as a Hugging Face folder."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from torchmoe.config.loader import load_job_config
    from torchmoe.hf_files import mxfp4
    from torchmoe.models.registry import hf_mapping
    from torchmoe.training.loop import Trainer

    cfg = load_job_config([*BASE, *flags, "--checkpoint.initial_load_path", str(hf_in),
                           "--job.dump_folder", str(out_dir / label)])
    trainer = Trainer(cfg)
    params = dict(trainer.model.named_parameters())
    shard_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params.values())
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    rss_before = _vm_kib("VmRSS")
    with _opens_under(hf_in) as opened:
        trainer.load_initial_state()
    peak_kib = _vm_kib("VmHWM") - rss_before

    # Each parameter (and the expert bias where the family's folder keeps it), gathered, against
    # the folder's tensor in our layout.
    mismatched = []
    biases = {name: b for name, b in trainer.model.named_buffers() if name.endswith("expert_bias")}
    with safe_open(str(next(hf_in.glob("*.safetensors"))), framework="pt") as f:
        for name, p in {**params, **biases}.items():
            if (s := hf_mapping(trainer.model_args).hf_slice(name, p.shape)) is None:
                continue
            if s.per_expert:
                want = torch.stack([f.get_tensor(expert) for expert in s.stored()])
            elif s.hf_name not in f.keys():  # MXFP4-packed: [E, out, in], HF's transpose
                want = mxfp4.dequantize(*(f.get_tensor(p) for p in mxfp4.packed_names(s.hf_name))).transpose(1, 2)
                want = want.transpose(1, 2) if s.transposed else want
            else:
                stored = f.get_tensor(s.hf_name)
                want = stored[..., s.offset:s.offset + (p.shape[1] if s.transposed else stored.shape[-1])]
                want = want.transpose(1, 2) if s.transposed else want
            got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if not torch.equal(got, want):
                mismatched.append(name)
    trainer.step = 1
    trainer._save_hf()
    record = {"peak_load_bytes": peak_kib * 1024, "shard_bytes": shard_bytes,
              "full_bytes": sum(p.numel() * p.element_size() for p in params.values()) if not trainer.dims.pp_enabled
              else None, "mismatched": mismatched, "opened": opened}
    del trainer
    dist.barrier()
    return record


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the Trainer joins it; its meshes are built on top
    hf = json.loads((out_dir / "inputs.json").read_text())
    records = {label: _load_and_save(label, flags, Path(hf["tiny"]), out_dir) for label, flags in LAYOUTS.items()}
    records.update({label: _load_and_save(label, flags, Path(hf[f"{family}_tiny"]), out_dir)
                    for label, (family, flags) in FAMILY_LAYOUTS.items()})
    records.update({label: _load_and_save(label, flags, Path(hf[folder]), out_dir)
                    for label, (folder, flags) in MXFP4_LAYOUTS.items()})
    records["memory"] = _load_and_save("memory", MEMORY_LAYOUT, Path(hf["bench256"]), out_dir)
    write_rank_record(out_dir, records)


def _hf_folder(flavor: str, folder: Path, seed: int, family: str = "llama4") -> Path:
    """A Hugging Face folder of a randomly initialised model of `flavor` (one process); a `family`
    ending in ``_mtp`` has one multi-token prediction layer."""
    import torch

    from torchmoe.arch.registry import FLAVORS
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    mtp = family.endswith("_mtp")
    family = family.removesuffix("_mtp")
    model = Transformer(FLAVORS[family][flavor].replace(mtp_layers=int(mtp)))
    model.init_weights(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    if family == "deepseek_v3":  # its folders keep the expert bias (e_score_correction_bias): a trained one
        for moe in model.moe_layers():
            moe.expert_bias.normal_(0, 0.1, generator=generator)
    if family == "gpt_oss":  # expert matrices MXFP4 holds exactly, for its packed twin
        mxfp4_exact_experts(model, generator)
    save_model(model, folder)
    return folder


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict[int, dict], Path]:
    out = tmp_path_factory.mktemp("hf_sharded")
    inputs = {flavor: str(_hf_folder(flavor, out / f"hf_{flavor}", seed)) for seed, flavor in
              enumerate(("tiny", "bench256"))}
    for seed, family in enumerate(("qwen3", "deepseek_v3", "gpt_oss", "deepseek_v3_mtp"), start=2):
        inputs[f"{family}_tiny"] = str(_hf_folder("tiny", out / f"hf_{family}_tiny", seed, family))
    inputs["gpt_oss_mxfp4"] = str(mxfp4_folder(Path(inputs["gpt_oss_tiny"]), out / "hf_gpt_oss_mxfp4"))
    (out / "inputs.json").write_text(json.dumps(inputs))
    return run_rank_script(__file__, out, world=WORLD, timeout=600), out


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("label", [*LAYOUTS, *FAMILY_LAYOUTS, *MXFP4_LAYOUTS])
def test_load_gives_the_folders_tensors_and_save_writes_them_back(measured, label):
    """The MXFP4 folder loads as its unpacked twin and is written back as it (bf16 or fp32
    experts, no quantization_config: what transformers and torchmoe both read)."""
    import torch

    records, out = measured
    for rank in range(WORLD):
        assert records[rank][label]["mismatched"] == [], (label, rank)
    family = FAMILY_LAYOUTS.get(label, MXFP4_LAYOUTS.get(label, ("llama4",)))[0].removesuffix("_mxfp4")
    hf_in = out / ("hf_tiny" if family == "llama4" else f"hf_{family}_tiny")
    want = _tensors(hf_in)
    saved = out / label / "checkpoint" / "step-1-hf"
    got = _tensors(saved)
    assert sorted(got) == sorted(want), label
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (label, name)
    assert json.loads((saved / "config.json").read_text()) == json.loads((hf_in / "config.json").read_text())
    assert not (saved / ".rank-shards").exists()  # each rank's own files are gone once consolidated


@pytest.mark.parametrize("label", [*LAYOUTS, *FAMILY_LAYOUTS])
def test_only_rank_0_reads_the_folders_config_and_headers(measured, label):
    """On a shared file system every rank opening every file of the folder is a storm of
    requests for the same answer: rank 0 reads config.json and checks and reads every file's
    header, and each rank opens only the files it reads slices of, once. (These folders hold
    one safetensors file; before, every rank opened it three times before reading from it.)"""
    records, _ = measured
    # Checked, headers, read; with MTP also its names (for the layers the files hold: no index).
    headers = 4 if "_mtp_" in label else 3
    assert sorted(records[0][label]["opened"]) == ["config.json", *["model.safetensors"] * headers], label
    for rank in range(1, WORLD):
        assert records[rank][label]["opened"] == ["model.safetensors"], (label, rank)


def test_load_memory_per_rank_stays_near_its_shard(measured):
    records, _ = measured
    for rank in range(WORLD):
        rec = records[rank]["memory"]
        assert rec["shard_bytes"] * WORLD >= rec["full_bytes"] * 0.99, rec  # FSDP 4: a quarter each
        # Observed 1.8-2.7x the shard (0.42-0.64 of the full model): the file pages a rank's slices
        # touch (w1's and w3's columns interleave within every row of the fused gate_up_proj, so
        # both halves' pages are mapped), one slice read before its copy into the shard, and a few
        # MB of runtime. The rank-0 load this replaced held the whole model on rank 0 (>= 1.0).
        assert rec["peak_load_bytes"] < 0.75 * rec["full_bytes"], (rank, rec)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_convert_runs_as_a_sharded_torchrun_job(measured, tmp_path):
    """`torchmoe convert` under torchrun: hf-to-dcp on 4 ranks writes a DCP folder of row-sharded
    tensors equal to the Hugging Face folder's, which dcp-to-hf on 2 ranks (a different split)
    turns back into exactly the input tensors; each rank writes only its own part."""
    import torch

    from tests.launch import run_cli

    _, out = measured
    hf_in = out / "hf_tiny"
    proc = run_cli(["convert", "hf-to-dcp", hf_in, tmp_path / "dcp"], nproc=4, timeout=300)
    assert proc.stdout.count("wrote DCP folder") == 1  # rank 0 reports for the job
    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    experts = entries["layers.1.moe.experts.w1"]
    assert len(experts.chunks) == 4 and all(c.sizes[0] == experts.size[0] // 4 for c in experts.chunks)
    run_cli(["convert", "dcp-to-hf", tmp_path / "dcp", tmp_path / "back", "--flavor", "tiny"], nproc=2,
            timeout=300)
    want, got = _tensors(hf_in), _tensors(tmp_path / "back")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
