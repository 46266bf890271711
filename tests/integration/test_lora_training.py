"""`torchmoe train` with `[lora]` from a tiny random Qwen3-MoE folder made by transformers
(`tests/any_checkpoint.py`): the base stays frozen (no gradient, no optimizer state), checkpoints
hold the adapters alone and resume exactly (from the folder, or from the run's own copy of the base
with `lora.checkpoint_base`; never on another base), the exported adapter loads in
``peft.PeftModel.from_pretrained`` with torchmoe's logits, imports (`lora.adapter`) to go on, and
`torchmoe convert` of a step-N folder writes the run's own export.

    python -m pytest -q tests/integration/test_lora_training.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
from transformers import Qwen3MoeForCausalLM  # noqa: E402

from tests.any_checkpoint import reference_model, save_checkpoint  # noqa: E402
from tests.helpers import start_from  # noqa: E402
from tests.hf_parity import max_rel_err, random_tokens  # noqa: E402
from tests.launch import read_metrics, run_cli, run_train  # noqa: E402
from torchmoe.commands import cli  # noqa: E402
from torchmoe.components.checkpoint_state import read_dcp_metadata  # noqa: E402
from torchmoe.components.peft_adapter import load_peft_adapter  # noqa: E402
from torchmoe.config.job_config import LoRA  # noqa: E402
from torchmoe.hf import load_model  # noqa: E402
from torchmoe.models.decoder.lora import apply_lora  # noqa: E402
from torchmoe.nn.lora import is_adapter_name  # noqa: E402

TARGETS = ["attention", "experts", "router"]
LORA = LoRA(enable=True, targets=TARGETS, rank=8, alpha=16.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("qwen3", tmp_path_factory.mktemp("lora") / "qwen3")


def _train(folder: Path, dump: Path, steps: int, *extra: str) -> list[dict]:
    """`torchmoe train` of LoRA on `folder` in this process, checkpointing every 2 steps and
    exporting at the end; its metrics records."""
    assert _status(folder, dump, steps, *extra) == 0
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _status(folder: Path, dump: Path, steps: int, *extra: str) -> int:
    """The exit status of `_train`'s run."""
    job = dump.parent / f"{dump.name}.toml"
    job.write_text(f'[training]\nlocal_batch_size = 2\nseq_len = 32\nsteps = {steps}\ndataset = "python_docs"\n'
                   f'[optimizer]\nlr = 0.01\n[lr_scheduler]\nwarmup_steps = 1\n'
                   f'[checkpoint]\nenable = true\ninterval = 2\ninitial_load_in_hf = true\nlast_save_in_hf = true\n'
                   f'initial_load_path = "{folder}"\n'
                   f'[lora]\nenable = true\ntargets = {json.dumps(TARGETS)}\nrank = 8\nalpha = 16.0\n'
                   '[compile]\nenable = false\n[metrics]\nlog_freq = 1\nenable_tensorboard = false\n')
    return cli.main(["train", "--config", str(job), "--job.dump_folder", str(dump), *extra])


@pytest.fixture(scope="module")
def run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    dump = tmp_path_factory.mktemp("run") / "run"
    return dump, _train(folder, dump, 4)


@pytest.fixture(scope="module")
def merged_run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`run` with `lora.export = "merged"`: its dump folder."""
    dump = tmp_path_factory.mktemp("merged") / "merged"
    _train(folder, dump, 4, "--lora.export", "merged")
    return dump


@pytest.fixture(scope="module")
def based(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """`run` with `lora.checkpoint_base = true`, from a copy of the folder that is moved away
    after it: (the copy's path, now gone; the dump folder; the metrics records)."""
    root = tmp_path_factory.mktemp("based")
    start = root / "qwen3"
    shutil.copytree(folder, start)
    records = _train(start, root / "run", 4, "--lora.checkpoint_base", "true")
    start.rename(root / "moved")
    return start, root / "run", records


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_alone(run):
    dump, records = run
    keys = read_dcp_metadata("folder", dump / "checkpoint" / "step-4", "").state_dict_metadata
    model = [k[len("model."):] for k in keys if k.startswith("model.")]
    moments = [k for k in keys if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
    assert model and all(is_adapter_name(k) for k in model), model
    # every adapter, nothing else: 3 layers x (wq, wk, wv, wo) x (A, B) + 2 MoE layers x (w13, w2, gate) x (A, B)
    assert len(model) == 3 * 4 * 2 + 2 * 3 * 2
    assert sorted(k[len("optimizer.state."):-len(".exp_avg")] for k in moments) == sorted(model)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in records)


def test_the_exports_load_in_peft_and_transformers_with_our_logits(run, merged_run, folder):
    """The adapter export (the default) on the folder's model in PEFT gives torchmoe's logits; the
    same run with `lora.export = "merged"` writes that model whole (its base the folder's, bit
    for bit frozen), which transformers loads with the same logits."""
    dump, _ = run
    adapter = dump / "checkpoint" / "step-4-hf"
    trained = load_file(adapter / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in trained.items())  # B left zero
    ours = load_model(folder)
    apply_lora(ours, LORA)
    load_peft_adapter(ours, adapter, LORA)
    tokens = random_tokens(512)
    peft_model = peft.PeftModel.from_pretrained(reference_model("qwen3"), adapter).eval()
    with torch.no_grad():
        got, ref = ours(tokens), peft_model(tokens).logits
        base = reference_model("qwen3")(tokens).logits
    assert max_rel_err(ref, got) <= 1e-5
    assert max_rel_err(base, got) > 1e-3  # the adapters changed the model
    merged = Qwen3MoeForCausalLM.from_pretrained(merged_run / "checkpoint" / "step-4-hf").eval()
    with torch.no_grad():
        assert max_rel_err(merged(tokens).logits, ref) <= 1e-5


def test_resume_is_exact(run, folder, tmp_path):
    """A resume from the run's step-2 checkpoint (adapters only; the base loads from the folder
    again) to step 4: the curve of the uninterrupted run, bit for bit."""
    dump, whole = run
    resumed = _train(folder, start_from(dump / "checkpoint" / "step-2", tmp_path / "resumed"), 4)
    assert [(r["loss"], r["grad_norm"]) for r in resumed if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"]) for r in whole if r["step"] > 2]


def test_an_imported_adapter_continues_training(run, folder, tmp_path):
    """`lora.adapter` = the exported adapter: the new run's first loss is the loss the trained
    adapters give (below the first run's first), not PEFT's init's."""
    dump, first = run
    go_on = _train(folder, tmp_path / "on", 1, "--lora.adapter", str(dump / "checkpoint" / "step-4-hf"))
    assert go_on[0]["loss"] < first[0]["loss"] - 1e-3


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face (or PEFT adapter) folder's safetensors files, by name."""
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), \
            name


def test_convert_of_a_lora_checkpoint_writes_the_runs_own_export(run, merged_run, tmp_path, capsys):
    """`torchmoe convert dcp-to-hf` of the run's step-4 (the base from its initial_load_path, the
    adapters from step-4) writes the adapter the run exported at step 4, bit for bit, and with
    ``--lora-export merged`` the merged model that run with `lora.export = "merged"` exported
    (docs/fine_tuning.md: ``torchmoe convert dcp-to-hf run/checkpoint/step-4 adapter``, and
    ``run/checkpoint/step-4 merged --lora-export merged``)."""
    dump, _ = run
    step = dump / "checkpoint" / "step-4"
    assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "adapter")]) == 0
    assert "the LoRA run's PEFT adapter" in capsys.readouterr().out
    exported = dump / "checkpoint" / "step-4-hf"
    _same_bits(_tensors(tmp_path / "adapter"), _tensors(exported))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((exported / "adapter_config.json").read_text())
    assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "merged"), "--lora-export", "merged"]) == 0
    merged = _tensors(tmp_path / "merged")
    _same_bits(merged, _tensors(merged_run / "checkpoint" / "step-4-hf"))
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_a_checkpoint_of_the_version_before_fingerprints_resumes_and_converts(folder, run, tmp_path, monkeypatch,
                                                                             capsys):
    """Checkpoints of LoRA runs written before base fingerprints hold no `base` entry: `run` saved
    so; a run resumed from its step-2 warns and gives the uninterrupted run's steps 3-4, and
    convert of that step-2 writes its adapter."""
    from torchmoe.components.checkpoint import CheckpointManager

    save = CheckpointManager.save
    monkeypatch.setattr(CheckpointManager, "save", lambda self, step, state, **kw: save(
        self, step, {name: part for name, part in state.items() if name != "base"}, **kw))
    old = tmp_path / "old"
    _train(folder, old, 4)
    monkeypatch.setattr(CheckpointManager, "save", save)
    step_2 = old / "checkpoint" / "step-2"
    assert "base" not in {k.split(".")[0] for k in read_dcp_metadata("f", step_2, "").state_dict_metadata}
    capsys.readouterr()
    records = _train(folder, start_from(step_2, tmp_path / "resumed"), 4)
    err = capsys.readouterr().err
    assert "holds no base (written by an older version): resuming without it" in " ".join(err.split()), err
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in run[1][2:]]
    assert cli.main(["convert", "dcp-to-hf", str(step_2), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_convert_refuses_under_torchrun_and_an_adapter_peft_cannot_hold(run, tmp_path, monkeypatch, capsys):
    """A LoRA step-N converts in one process: under torchrun (WORLD_SIZE 2) exit 2 says so. A run
    whose targets PEFT cannot hold (Qwen3's dense MLP under transformers 5; here the run's
    config.toml says `mlp`) is refused for the adapter export before anything is read, naming
    --lora-export and offering the merged model. Neither writes anything."""
    dump, _ = run
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["convert", "dcp-to-hf", str(dump / "checkpoint" / "step-4"), str(tmp_path / "ws2")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is a LoRA run's checkpoint, which convert writes in one process" in err, err
    assert "fix: run `torchmoe convert` without torchrun" in err and not (tmp_path / "ws2").exists()
    monkeypatch.delenv("WORLD_SIZE")
    other = tmp_path / "mlp_run"
    shutil.copytree(dump, other, ignore=shutil.ignore_patterns("step-4-hf", "*.lock", "logs"))
    config = other / "config.toml"
    config.write_text(config.read_text().replace('targets = [\n', 'targets = [\n    "mlp",\n', 1))
    assert '"mlp"' in config.read_text()
    assert cli.main(["convert", "dcp-to-hf", str(other / "checkpoint" / "step-4"), str(tmp_path / "a")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("error:") == 1 and 'error: --lora-export = "adapter": PEFT' in err, err
    assert "fix: pass --lora-export merged" in err, err
    assert not (tmp_path / "a").exists()


def test_checkpoint_base_saves_the_base_once_and_resumes_without_the_folder(based, run, tmp_path):
    """With `lora.checkpoint_base` the checkpoint folder holds base/ once (the base's tensors and
    the folder's config.json, no adapter); a resume from step-2 after the folder was moved away
    loads the base from there, leaves it as it was, and gives the uninterrupted run's curve."""
    start, dump, records = based
    whole = run[1]
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in whole]
    ckpt = dump / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["base", "step-2", "step-4", "step-4-hf"]
    keys = read_dcp_metadata("folder", ckpt / "base", "").state_dict_metadata
    model = [k[len("model."):] for k in keys if k.startswith("model.")]
    assert len(model) == len(keys) and model and not any(is_adapter_name(k) for k in model)
    assert "layers.1.moe.experts.w13" in model or any(".experts." in k for k in model), model
    assert (ckpt / "base" / "config.json").is_file() and not start.exists()
    marker = (ckpt / "base" / ".complete").read_text()
    resumed = start_from(ckpt / "step-2", tmp_path / "resumed")
    shutil.copytree(ckpt / "base", resumed / "checkpoint" / "base")
    again = _train(start, resumed, 4, "--lora.checkpoint_base", "true")
    assert [(r["loss"], r["grad_norm"]) for r in again if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"]) for r in whole if r["step"] > 2]
    assert (resumed / "checkpoint" / "base" / ".complete").read_text() == marker  # not written again


def test_convert_takes_the_saved_base_without_the_folder(based, run, tmp_path):
    """The step-4 of the run with `lora.checkpoint_base`, its initial folder gone: convert loads
    the base from base/ and writes the adapter the first run exported, bit for bit."""
    _, dump, _ = based
    assert cli.main(["convert", "dcp-to-hf", str(dump / "checkpoint" / "step-4"), str(tmp_path / "out")]) == 0
    _same_bits(_tensors(tmp_path / "out"), _tensors(run[0] / "checkpoint" / "step-4-hf"))


def test_convert_without_the_base_names_the_missing_folder(based, tmp_path, capsys):
    """The same run without base/ (a run of lora.checkpoint_base = false) and its initial folder
    gone: exit 2 naming checkpoint.initial_load_path, its path and the fix; nothing written."""
    start, dump, _ = based
    copy = tmp_path / "run"
    shutil.copytree(dump, copy, ignore=shutil.ignore_patterns("base"))
    step = copy / "checkpoint" / "step-4"
    assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f'error: checkpoint.initial_load_path = "{start}": is gone, and {step.parent} holds no copy of the frozen '
            "base (lora.checkpoint_base was false): the run's adapters cannot be put back on their base fix: "
            "restore the folder the run started from there; lora.checkpoint_base = true makes future LoRA runs keep "
            "the base with their checkpoints") in err, err
    assert not (tmp_path / "out").exists()


def test_a_resume_on_another_base_is_refused(run, folder, tmp_path, capsys):
    """A resume from step-2 whose initial_load_path now holds one weight changed (one element, by
    one ulp): exit 2 naming checkpoint.initial_load_path and the tensor, before any step; and
    convert of the run's checkpoint, its config.toml naming the changed folder, is refused the same way."""
    dump, _ = run
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name][7, 5] = torch.nextafter(weights[name][7, 5], torch.tensor(float("inf")))  # not the first element
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    resumed = start_from(dump / "checkpoint" / "step-2", tmp_path / "resumed")
    assert _status(changed, resumed, 4) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f'error: checkpoint.initial_load_path = "{changed}": holds other base weights than the run\'s checkpoints '
            "were trained on (1 of ") in err, err
    assert "tensors differ, e.g. layers.1.attention.wq.weight): the adapters belong to another base fix: restore " \
        "the folder the run started from there, or start a new run in another job.dump_folder " \
        "(lora.checkpoint_base = true keeps a copy of the base with the checkpoints)" in err, err
    assert not (resumed / "metrics.jsonl").exists() or "\"step\": 3" not in (resumed / "metrics.jsonl").read_text()
    copy = tmp_path / "run"  # the run's folder, its config.toml now naming the changed base
    shutil.copytree(dump, copy)
    (copy / "config.toml").write_text((copy / "config.toml").read_text().replace(str(folder), str(changed)))
    assert cli.main(["convert", "dcp-to-hf", str(copy / "checkpoint" / "step-4"), str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f'error: checkpoint.initial_load_path = "{changed}": holds other base weights than the run\'s checkpoints '
            "were trained on (1 of ") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_an_ep_and_fsdp_run_exports_its_gathered_adapter(folder, tmp_path):
    """2 gloo ranks, the experts split by EP and the rest sharded by FSDP: the export gathers
    each adapter whole to rank 0, and PEFT loads it with torchmoe's logits; imported again
    (`lora.adapter`, each rank taking its shards), the next run starts from the trained loss.
    `torchmoe eval` of the run's step-2 in its layout (each rank loading its shards of the base
    and of the step's adapters) gives the loss one process's eval gives of the exported adapter
    over the folder (fp32, 1e-5)."""
    job = tmp_path / "job.toml"
    dump = tmp_path / "ep"
    job.write_text(f'[training]\nlocal_batch_size = 2\nseq_len = 32\nsteps = 2\ndataset = "python_docs"\n'
                   f'[optimizer]\nlr = 0.01\n[lr_scheduler]\nwarmup_steps = 1\n'
                   f'[checkpoint]\nenable = true\ninterval = 2\ninitial_load_in_hf = true\nlast_save_in_hf = true\n'
                   f'initial_load_path = "{folder}"\n'
                   f'[lora]\nenable = true\ntargets = {json.dumps(TARGETS)}\nrank = 8\nalpha = 16.0\n'
                   '[parallelism]\ndata_parallel_shard_degree = 2\nexpert_parallel_degree = 2\n'
                   '[compile]\nenable = false\n[metrics]\nlog_freq = 1\nenable_tensorboard = false\n')
    run_train(["--config", str(job)], dump_folder=dump, nproc=2, timeout=300)
    adapter = dump / "checkpoint" / "step-2-hf"
    ours = load_model(folder)
    apply_lora(ours, LORA)
    load_peft_adapter(ours, adapter, LORA)
    assert all(t.abs().max() > 0 for k, t in load_file(adapter / "adapter_model.safetensors").items())
    tokens = random_tokens(512)
    peft_model = peft.PeftModel.from_pretrained(reference_model("qwen3"), adapter).eval()
    with torch.no_grad():
        assert max_rel_err(peft_model(tokens).logits, ours(tokens)) <= 1e-5
    run_train(["--config", str(job), "--lora.adapter", str(adapter), "--checkpoint.enable", "false"],
              dump_folder=tmp_path / "on", nproc=2, timeout=300)
    first, go_on = read_metrics(dump)[0], read_metrics(tmp_path / "on")[0]
    assert go_on["loss"] < first["loss"] - 1e-3
    batch = ["--split", "train", "--batches", "1", "--training.mixed_precision_param", "float32"]
    run_cli(["eval", "--job.dump_folder", dump, *batch, "--out", tmp_path / "ranks.json"], nproc=2, timeout=300)
    run_cli(["eval", "--config", dump / "config.toml", "--checkpoint", adapter, "--base", folder, *batch,
             "--parallelism.data_parallel_shard_degree", "1", "--parallelism.expert_parallel_degree", "1",
             "--training.local_batch_size", "4", "--out", tmp_path / "one.json"], timeout=300)  # the same 4 rows
    losses = [json.loads((tmp_path / f"{name}.json").read_text())["loss"] for name in ("ranks", "one")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=0)
