"""`torchmoe train` with `[lora]` from a tiny random Qwen3-MoE folder made by transformers
(`tests/any_checkpoint.py`): the base stays frozen (no gradient, no optimizer state), checkpoints
hold the adapters alone and resume exactly, the exported adapter loads in
``peft.PeftModel.from_pretrained`` with torchmoe's logits, and imports (`lora.adapter`) to go on.

    python -m pytest -q tests/integration/test_lora_training.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
from transformers import Qwen3MoeForCausalLM  # noqa: E402

from tests.any_checkpoint import reference_model, save_checkpoint  # noqa: E402
from tests.helpers import start_from  # noqa: E402
from tests.hf_parity import max_rel_err, random_tokens  # noqa: E402
from tests.launch import read_metrics, run_train  # noqa: E402
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
    job = dump.parent / f"{dump.name}.toml"
    job.write_text(f'[training]\nlocal_batch_size = 2\nseq_len = 32\nsteps = {steps}\ndataset = "python_docs"\n'
                   f'[optimizer]\nlr = 0.01\n[lr_scheduler]\nwarmup_steps = 1\n'
                   f'[checkpoint]\nenable = true\ninterval = 2\ninitial_load_in_hf = true\nlast_save_in_hf = true\n'
                   f'initial_load_path = "{folder}"\n'
                   f'[lora]\nenable = true\ntargets = {json.dumps(TARGETS)}\nrank = 8\nalpha = 16.0\n'
                   '[compile]\nenable = false\n[metrics]\nlog_freq = 1\nenable_tensorboard = false\n')
    assert cli.main(["train", "--config", str(job), "--job.dump_folder", str(dump), *extra]) == 0
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    dump = tmp_path_factory.mktemp("run") / "run"
    return dump, _train(folder, dump, 4)


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


def test_the_exports_load_in_peft_and_transformers_with_our_logits(run, folder, tmp_path):
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
    _train(folder, tmp_path / "merged", 4, "--lora.export", "merged")
    merged = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged" / "checkpoint" / "step-4-hf").eval()
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


def test_convert_refuses_a_lora_checkpoint_naming_the_export(run, tmp_path, capsys):
    dump, _ = run
    step = dump / "checkpoint" / "step-4"
    assert cli.main(["convert", "dcp-to-hf", str(step), str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"error: CKPT_DIR = \"{step}\": is a LoRA run's checkpoint: it holds the adapters, not the frozen base "
            "(the run's checkpoint.initial_load_path) fix: export it from the run: checkpoint.last_save_in_hf = true "
            "writes lora.export (the PEFT adapter, or the merged model) at the run's last step") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_an_ep_and_fsdp_run_exports_its_gathered_adapter(folder, tmp_path):
    """2 gloo ranks, the experts split by EP and the rest sharded by FSDP: the export gathers
    each adapter whole to rank 0, and PEFT loads it with torchmoe's logits; imported again
    (`lora.adapter`, each rank taking its shards), the next run starts from the trained loss."""
    job = tmp_path / "job.toml"
    dump = tmp_path / "ep"
    job.write_text(f'[training]\nlocal_batch_size = 2\nseq_len = 32\nsteps = 2\ndataset = "python_docs"\n'
                   f'[optimizer]\nlr = 0.01\n[lr_scheduler]\nwarmup_steps = 1\n'
                   f'[checkpoint]\nenable = false\ninitial_load_in_hf = true\nlast_save_in_hf = true\n'
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
    run_train(["--config", str(job), "--lora.adapter", str(adapter)], dump_folder=tmp_path / "on", nproc=2, timeout=300)
    first, go_on = read_metrics(dump)[0], read_metrics(tmp_path / "on")[0]
    assert go_on["loss"] < first["loss"] - 1e-3
