"""`torchmoe train` with `[lora]` from a tiny random Qwen3-MoE folder made by transformers
(`tests/any_checkpoint.py`): the base stays frozen (no gradient, no optimizer state), checkpoints
hold the adapters alone and resume exactly (from the folder, or from the run's own copy of the base
with `lora.checkpoint_base`; never on another base), the exported adapter loads in
``peft.PeftModel.from_pretrained`` with torchmoe's logits, imports (`lora.adapter`) to go on, and
`torchmoe convert` of a step-N folder writes the run's own export. The expert biases (tiny
DeepSeek-V3 and Llama 4 folders): left as the base's by default; when the run trains them,
checkpointed, resumed bit for bit, fingerprinted as the base's and held by the merged export,
the adapter export refused. A resume with other [lora] settings, and a damaged or contradicting
`lora.adapter`, are exit 2 naming the key.

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
from torchmoe.checkpoints.checkpoint_state import read_dcp_metadata  # noqa: E402
from torchmoe.commands import cli  # noqa: E402
from torchmoe.config.job_config import LoRA  # noqa: E402
from torchmoe.hf import load_model  # noqa: E402
from torchmoe.hf_files.peft_adapter import load_peft_adapter  # noqa: E402
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


def test_dropout_masks_come_from_the_seeded_rng_and_resume_exactly(run, folder, tmp_path):
    """`lora.dropout = 0.1` (with the merged export: PEFT's expert and router adapters take no
    dropout): its masks are drawn (step 1's gradient norm is not the dropout-free run's, though
    its loss is: B starts at zero, so no adapter output reaches it), from the RNG `training.seed`
    seeds (a second run of 2 steps repeats the first 2, bit for bit) and checkpoints keep (a
    resume from step 2 is the uninterrupted curve, bit for bit)."""
    _, plain = run
    flags = ("--lora.dropout", "0.1", "--lora.export", "merged")
    dropped = _train(folder, tmp_path / "dropout", 4, *flags)
    assert dropped[0]["loss"] == plain[0]["loss"] and dropped[0]["grad_norm"] != plain[0]["grad_norm"]
    again = _train(folder, tmp_path / "again", 2, *flags)
    resumed = _train(folder, start_from(tmp_path / "dropout" / "checkpoint" / "step-2", tmp_path / "resumed"), 4,
                     *flags)
    curve = [(r["step"], r["loss"], r["grad_norm"]) for r in dropped]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in again] == curve[:2]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed if r["step"] > 2] == curve[2:]


def test_an_imported_adapter_continues_training(run, folder, tmp_path):
    """`lora.adapter` = the exported adapter: the new run's first loss is the loss the trained
    adapters give (below the first run's first), not PEFT's init's."""
    dump, first = run
    go_on = _train(folder, tmp_path / "on", 1, "--lora.adapter", str(dump / "checkpoint" / "step-4-hf"))
    assert go_on[0]["loss"] < first[0]["loss"] - 1e-3


def test_a_damaged_or_contradicting_adapter_is_exit_2(run, folder, tmp_path, capsys):
    """`lora.adapter` held to the base's rules on the command line: a truncated
    adapter_model.safetensors, or an adapter_config.json whose target_modules leave out a module it
    holds tensors for, is exit 2 with one message naming lora.adapter and the file, no traceback,
    before any step."""
    damaged = tmp_path / "damaged"
    shutil.copytree(run[0] / "checkpoint" / "step-4-hf", damaged)
    weights = damaged / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    contradicting = tmp_path / "contradicting"
    shutil.copytree(run[0] / "checkpoint" / "step-4-hf", contradicting)
    config = json.loads((contradicting / "adapter_config.json").read_text())
    config["target_modules"].remove("model.layers.2.self_attn.o_proj")
    (contradicting / "adapter_config.json").write_text(json.dumps(config))
    for adapter, problem in ((damaged, "adapter_model.safetensors is damaged or truncated"),
                             (contradicting, "it holds tensors for model.layers.2.self_attn.o_proj, which its "
                                             "adapter_config.json's target_modules does not name")):
        assert _status(folder, tmp_path / adapter.name / "run", 2, "--lora.adapter", str(adapter)) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.count("error:") == 1 and f'error: lora.adapter = "{adapter}": {problem}' in err, err
        assert "Traceback" not in err and not (tmp_path / adapter.name / "run" / "metrics.jsonl").exists()


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
    from torchmoe.checkpoints.checkpoint import CheckpointManager

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


# ---- the expert biases: left as the base's by default, else trained, checkpointed and exported ----

# A run that trains the expert biases beside the adapters (model.load_balance_coeff set; under
# LoRA they stay the base's otherwise) at a rate that moves them visibly every step, exports the
# merged model (which holds them; PEFT's format has no place for them), and drops out 10% of each
# adapter's input (whose draws a resume must continue: the RNG state). Llama 4's rate is lower: its
# top-1 choice over the tiny folder's router logits flips whole experts at 0.05 a step, and steps
# 1 and 2 then cancel (step 2's biases the base's, where a resume that lost them would not show).
BIASES = {"deepseek_v3": ["--model.load_balance_coeff", "0.05", "--lora.export", "merged", "--lora.dropout", "0.1"],
          "llama4": ["--model.load_balance_coeff", "0.003", "--lora.export", "merged", "--lora.dropout", "0.1",
                     "--checkpoint.last_save_in_hf", "false"]}  # Llama 4's Hugging Face model has no place for them


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 folder (Moonlight's form), its e_score_correction_bias drawn off zero."""
    return save_checkpoint("deepseek_v3", tmp_path_factory.mktemp("lora") / "deepseek_v3")


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama4", tmp_path_factory.mktemp("lora") / "llama4")


def _biases(step: Path) -> dict[str, torch.Tensor]:
    """The expert biases a step-N folder holds, by name (without the "model." prefix)."""
    import torch.distributed.checkpoint as dcp

    stored = read_dcp_metadata("folder", step, "").state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in stored.items()
             if k.endswith("expert_bias")}
    dcp.load(state, checkpoint_id=step, no_dist=True)
    return {k.removeprefix("model."): t for k, t in state.items()}


def _trained_model(folder: Path, step: Path, targets: list[str]) -> torch.nn.Module:
    """torchmoe's model as the run of `folder` trained it to `step`: the folder's base, the step's
    adapters and the expert biases it holds (eval mode: no dropout)."""
    from torchmoe.checkpoints.checkpoint_state import load_model_only

    model = load_model(folder)
    apply_lora(model, LoRA(enable=True, targets=targets, rank=8, alpha=16.0))
    biases = _biases(step)
    load_model_only(step, [model], key="step", keep=lambda n: is_adapter_name(n) or n in biases)
    return model.eval()


@pytest.fixture(scope="module")
def deepseek_run(deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    dump = tmp_path_factory.mktemp("ds") / "run"
    return dump, _train(deepseek, dump, 4, *BIASES["deepseek_v3"])


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4"])
def test_trained_expert_biases_are_checkpointed_and_resume_exactly(family, deepseek, llama4, deepseek_run, tmp_path):
    """A run that trains the expert biases (DeepSeek-V3; Llama 4 without the Hugging Face export,
    which has no place for them), resumed from its step-2 checkpoint: the uninterrupted run's steps
    3-4, loss and gradient norm bit for bit, and its step-4 biases bit for bit, which moved from
    step 2's, themselves off the base's."""
    folder, extra = (deepseek if family == "deepseek_v3" else llama4), BIASES[family]
    if family == "deepseek_v3":
        dump, whole = deepseek_run
    else:
        dump, whole = tmp_path / "run", _train(folder, tmp_path / "run", 4, *extra)
    ckpt = dump / "checkpoint"
    at_2, at_4 = _biases(ckpt / "step-2"), _biases(ckpt / "step-4")
    base = load_model(folder).state_dict()
    assert sorted(at_2) == sorted(at_4) == sorted(n for n in base if n.endswith("expert_bias")) and at_4
    assert all(not torch.equal(at_2[n], base[n]) and not torch.equal(at_4[n], at_2[n]) for n in at_4)
    resumed = start_from(ckpt / "step-2", tmp_path / "resumed")
    again = _train(folder, resumed, 4, *extra)
    assert [(r["loss"], r["grad_norm"]) for r in again if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"]) for r in whole if r["step"] > 2]
    _same_bits(_biases(resumed / "checkpoint" / "step-4"), at_4)


def test_trained_biases_on_the_seeds_base_resume_exactly(tmp_path):
    """A base that is the seed's init (no initial_load_path: Llama 4's tiny flavor), its expert
    biases zero: a resume from step 2 sets the trained biases aside, fingerprints the base as the
    run began (zero biases), and puts them back: step 3 and its biases bit for bit."""
    from tests.helpers import train_tiny_here

    flags = ["--training.steps", "3", "--checkpoint.interval", "2", "--training.global_batch_size", "2",
             "--training.local_batch_size", "2", "--training.seq_len", "32", "--lora.enable", "true",
             "--lora.export", "merged", "--model.load_balance_coeff", "0.003"]
    train_tiny_here(tmp_path / "run", flags)
    ckpt = tmp_path / "run" / "checkpoint"
    assert any(t.abs().max() > 0 for t in _biases(ckpt / "step-2").values())
    resumed = start_from(ckpt / "step-2", tmp_path / "resumed")
    train_tiny_here(resumed, flags)
    whole, again = read_metrics(tmp_path / "run"), read_metrics(resumed)
    assert [(r["loss"], r["grad_norm"]) for r in again if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"]) for r in whole if r["step"] > 2]
    _same_bits(_biases(resumed / "checkpoint" / "step-3"), _biases(ckpt / "step-3"))


def test_the_merged_export_routes_as_trained(deepseek, deepseek_run, tmp_path):
    """DeepSeek-V3's merged export holds the trained biases as e_score_correction_bias: transformers
    loads it with the logits of torchmoe's trained model (its base, step-4's adapters and biases);
    with the base's biases (what the export held before they were checkpointed) the logits differ.
    convert of step-4 writes that export again, bit for bit."""
    from transformers import DeepseekV3ForCausalLM

    dump, _ = deepseek_run
    export = dump / "checkpoint" / "step-4-hf"
    assert cli.main(["convert", "dcp-to-hf", str(dump / "checkpoint" / "step-4"), str(tmp_path / "merged")]) == 0
    _same_bits(_tensors(tmp_path / "merged"), _tensors(export))
    hf = DeepseekV3ForCausalLM.from_pretrained(export).eval()
    trained = _biases(dump / "checkpoint" / "step-4")
    for name, bias in trained.items():
        i = name.split(".")[1]
        assert torch.equal(hf.model.layers[int(i)].mlp.gate.e_score_correction_bias, bias), name
    tokens = random_tokens(512)
    ours = _trained_model(deepseek, dump / "checkpoint" / "step-4", TARGETS)
    with torch.no_grad():
        got = ours(tokens)
        assert max_rel_err(hf(tokens).logits, got) <= 1e-5
        base = load_model(deepseek).state_dict()
        ours.load_state_dict({n: base[n] for n in trained}, strict=False)
        assert max_rel_err(ours(tokens), got) > 1e-4


def test_an_adapter_export_of_trained_biases_is_refused(deepseek, deepseek_run, tmp_path, capsys):
    """PEFT's adapter format has no place for trained biases: a run that would train them and
    export the adapter is refused before training, naming model.load_balance_coeff; convert of a
    step that holds them into an adapter, naming --lora-export. Neither writes anything."""
    dump, _ = deepseek_run
    assert _status(deepseek, tmp_path / "refused", 4, "--model.load_balance_coeff", "0.05") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("error:") == 1 and (
        "error: model.load_balance_coeff = 0.05: trains the expert biases beside the adapters, and lora.export = "
        "\"adapter\" would write them without: PEFT's adapter format holds adapters on a base it leaves as it is, "
        "and has no place for the biases: on its base the adapter would select the base's experts, not the trained "
        "ones fix: set lora.export = \"merged\" (the model with each adapter folded into its weight, and the biases "
        "as trained), or leave model.load_balance_coeff unset (-1: under LoRA the biases stay the base's)") in err, err
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    step = dump / "checkpoint" / "step-4"
    assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "adapter"), "--lora-export", "adapter"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f'error: --lora-export = "adapter": {step} holds the expert biases its run trained (e.g. '
            "layers.1.moe.expert_bias): PEFT's adapter format holds adapters on a base it leaves as it is") in err, err
    assert "fix: pass --lora-export merged" in err and not (tmp_path / "adapter").exists()


def test_a_resume_on_a_base_with_other_expert_biases_is_refused(deepseek, deepseek_run, tmp_path, capsys):
    """The base's fingerprint covers the expert biases it starts from: a resume of the biased run's
    step-2 whose folder now holds one e_score_correction_bias element one ulp off is exit 2 naming
    the folder and the bias, before any step (the trained biases, restored after the base loads,
    would hide it otherwise)."""
    changed = tmp_path / "changed"
    shutil.copytree(deepseek, changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    weights[name][3] = torch.nextafter(weights[name][3], torch.tensor(float("inf")))
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    resumed = start_from(deepseek_run[0] / "checkpoint" / "step-2", tmp_path / "resumed")
    assert _status(changed, resumed, 4, *BIASES["deepseek_v3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f'error: checkpoint.initial_load_path = "{changed}": holds other base weights than the run\'s checkpoints '
            "were trained on (1 of ") in err and "tensors differ, e.g. layers.2.moe.expert_bias)" in err, err
    assert not (resumed / "metrics.jsonl").exists()


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4"])
def test_lora_leaves_the_base_biases_by_default(family, deepseek, llama4, tmp_path):
    """Under LoRA model.load_balance_coeff = -1 (its default) trains no bias: the checkpoint holds
    the adapters alone, the model routes with the base's biases, and the export is the trained model.
    DeepSeek-V3: PEFT loads the adapter export (which names its base) on the folder's model with
    torchmoe's logits, and the merged model holds the base's e_score_correction_bias bit for bit;
    Llama 4 (the adapter export has no PEFT mapping): the merged export, refused before when the
    bias trained, loads in transformers with torchmoe's logits."""
    folder = deepseek if family == "deepseek_v3" else llama4
    dump = tmp_path / "run"
    _train(folder, dump, 2, *(["--lora.export", "merged"] if family == "llama4" else []))
    step = dump / "checkpoint" / "step-2"
    stored = read_dcp_metadata("folder", step, "").state_dict_metadata
    assert not any(k.endswith("expert_bias") for k in stored)
    tokens = random_tokens(512)
    ours = _trained_model(folder, step, TARGETS)
    export = dump / "checkpoint" / "step-2-hf"
    if family == "deepseek_v3":
        assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
        hf = peft.PeftModel.from_pretrained(reference_model(family), export).eval()
        assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "merged"), "--lora-export", "merged"]) == 0
        base = load_file(folder / "model.safetensors")
        merged = _tensors(tmp_path / "merged")
        biases = [k for k in base if k.endswith("e_score_correction_bias")]
        assert biases and all(torch.equal(merged[k], base[k]) for k in biases)
    else:
        from transformers import Llama4ForCausalLM

        hf = Llama4ForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        assert max_rel_err(hf(tokens).logits, ours(tokens)) <= 1e-5


# ---- a resume is what was trained, or refused: the settings that decide what the adapters mean ----

_NEW_RUN = "or start a new run in another job.dump_folder"


@pytest.mark.parametrize("flags,message", [
    (["--lora.targets", "attention", "experts"],  # the router's trained adapters would be dropped
     'lora.targets = ["attention", "experts"]: the run\'s checkpoints were trained with lora.targets = ["attention", '
     '"experts", "router"] (they hold adapters such as layers.0.attention.wk.lora_a): they hold adapters on those '
     'modules alone fix: set lora.targets = ["attention", "experts", "router"] as the run trained, ' + _NEW_RUN),
    (["--lora.targets", "attention", "experts", "router", "mlp", "--lora.export", "merged"],  # the dense layer's
     'lora.targets = ["attention", "experts", "router", "mlp"]: the run\'s checkpoints were trained with lora.targets '
     '= ["attention", "experts", "router"]'),
    (["--lora.rank", "4"],
     "lora.rank = 4: the run's checkpoints were trained with lora.rank = 8 (layers.0.attention.wq.lora_a is (8, 48)): "
     "their adapters have that rank fix: set lora.rank = 8 as the run trained, " + _NEW_RUN),
    (["--lora.alpha", "8"],
     "lora.alpha = 8.0: the run's checkpoints were trained with lora.alpha = 16.0: their adapters are scaled by "
     "alpha / rank, so another alpha makes another model of the same tensors (and the adapter export would claim "
     "it) fix: set lora.alpha = 16.0 as the run trained, " + _NEW_RUN),
    (["--lora.dropout", "0.1", "--lora.export", "merged"],
     "lora.dropout = 0.1: the run's checkpoints were trained with lora.dropout = 0.0: the resumed run would not be "
     "the one trained (and the adapter export would claim its dropout) fix: set lora.dropout = 0.0 as the run "
     f"trained, {_NEW_RUN} whose lora.adapter is an adapter export of this run (its adapters, trained on with the "
     "new dropout)"),
    (["--model.load_balance_coeff", "0.01", "--lora.export", "merged", "--checkpoint.hf_drop_expert_bias", "true"],
     "model.load_balance_coeff = 0.01: the run's checkpoints hold no expert bias (the run left them at the base's), "
     "which this run would train from the base's in mid-run fix: set model.load_balance_coeff to -1 (unset) or 0, "
     "as the run had it, " + _NEW_RUN),
    (["--lora.enable", "false"],
     "lora.enable = false: the run's checkpoints are a LoRA run's (they hold adapters, e.g. "
     "layers.0.attention.wk.lora_a, not the base): a full fine-tuning run cannot continue them fix: set lora.enable "
     "= true with the run's [lora] settings (its config.toml); to fine-tune the whole trained model, write it merged "
     "(torchmoe convert dcp-to-hf STEP OUT --lora-export merged) and start a new run from that folder in another "
     "job.dump_folder"),
], ids=["fewer_targets", "more_targets", "rank", "alpha", "dropout", "balance", "enable"])
def test_a_resume_with_other_lora_settings_is_refused(run, folder, flags, message, tmp_path, capsys):
    """Resuming the run's step-2 with a setting that decides what its adapters mean changed: exit 2
    before any step, naming the key, the run's value, the checkpoint's and the fix (never "model.flavor",
    never a resume that drops, rescales or reshapes what was trained)."""
    resumed = start_from(run[0] / "checkpoint" / "step-2", tmp_path / "resumed")
    assert _status(folder, resumed, 4, *flags) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("error:") == 1 and f"error: {message}" in err, err
    assert "Traceback" not in err and not (resumed / "metrics.jsonl").exists()


def test_a_resume_with_another_export_goes_on_and_a_full_checkpoint_is_no_lora_run(run, folder, tmp_path, capsys):
    """lora.export only says what the export writes: the run's step-2 resumed with the merged export
    gives the uninterrupted run's steps 3-4. A full fine-tuning run's checkpoint resumed under LoRA is
    exit 2 naming lora.enable."""
    whole = run[1]
    resumed = _train(folder, start_from(run[0] / "checkpoint" / "step-2", tmp_path / "merged"), 4,
                     "--lora.export", "merged")
    assert [(r["loss"], r["grad_norm"]) for r in resumed if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"]) for r in whole if r["step"] > 2]
    full = tmp_path / "full"
    _train(folder, full, 1, "--lora.enable", "false", "--checkpoint.last_save_in_hf", "false")
    assert _status(folder, full, 2) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("error: lora.enable = true: the run's checkpoints are a full fine-tuning run's (the whole model, no "
            "adapters): a LoRA run cannot continue them fix: set lora.enable = false, or start a new run in another "
            "job.dump_folder (checkpoint.initial_load_path = a step-N of this run adapts what it trained)") in err, err
