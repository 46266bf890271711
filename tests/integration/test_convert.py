"""`python -m torchmoe convert` both ways on the tiny flavor, and its user errors.

    python -m pytest -q -m integration tests/integration/test_convert.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

transformers = pytest.importorskip("transformers")

from tests.helpers import DEBUG_CONFIG, assert_user_error, empty_tiny_model, small_bpe  # noqa: E402
from tests.launch import run_cli  # noqa: E402
from torchmoe.checkpoints.checkpoint_state import load_model_only  # noqa: E402
from torchmoe.commands.convert import dcp_to_hf, hf_to_dcp  # noqa: E402
from torchmoe.config import ConfigError  # noqa: E402
from torchmoe.weights.checksums import SIDECAR, digest_file  # noqa: E402

# In-process DCP calls here run without a process group, which DCP warns about on every call.
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _torchmoe(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=120, expect=None)


def _ok(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=120)


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    """The step-2 checkpoint of a short run (expert bias kept at zero, which HF cannot hold)."""
    folder = tmp_path_factory.mktemp("run")
    _ok("train", "--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "2",
        "--model.load_balance_coeff", "0", "--checkpoint.enable", "true", "--job.dump_folder", folder)
    return folder / "checkpoint" / "step-2"


def test_hf_to_dcp_to_hf_is_lossless(hf_dir: Path, tmp_path: Path) -> None:
    proc = _ok("convert", "hf-to-dcp", hf_dir, tmp_path / "dcp")
    assert "--model.flavor tiny" in proc.stdout  # the flavor to train it with
    recorded = json.loads((tmp_path / "dcp" / SIDECAR).read_text())["files"]  # checksummed like a checkpoint
    assert recorded == {name: digest_file(tmp_path / "dcp" / name) for name in (".metadata", "__0_0.distcp")}
    _ok("convert", "dcp-to-hf", tmp_path / "dcp", tmp_path / "back", "--flavor", "tiny")
    original = load_file(hf_dir / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_dcp_to_hf_copies_the_tokenizer(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    small_bpe(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"eos_token": "<|end_of_text|>"}')
    _ok("convert", "hf-to-dcp", hf_dir, tmp_path / "dcp")
    # A tokenizer that is not there is refused before anything is written.
    proc = _torchmoe("convert", "dcp-to-hf", tmp_path / "dcp", tmp_path / "bad", "--flavor", "tiny",
                     "--tokenizer", tmp_path / "nope")
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "--tokenizer" in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists()
    proc = _ok("convert", "dcp-to-hf", tmp_path / "dcp", tmp_path / "hf", "--flavor", "tiny",
               "--tokenizer", tmp_path / "tok" / "tokenizer.json")
    assert "tokenizer: tokenizer.json, special_tokens_map.json" in proc.stdout
    for name in ("tokenizer.json", "special_tokens_map.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "tok" / name).read_bytes()


def test_dcp_to_hf_of_a_runs_step_copies_the_runs_tokenizer(step_dir: Path, tmp_path: Path) -> None:
    """The tokenizer too is the run's (its config.toml's model.tokenizer_path) unless --tokenizer
    names one: here a copy of the run whose config.toml names a BPE tokenizer."""
    small_bpe(tmp_path / "tokenizer.json")
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "step-2").symlink_to(step_dir, target_is_directory=True)
    config = (step_dir.parent.parent / "config.toml").read_text()
    (run / "config.toml").write_text(config.replace('tokenizer_path = ""', f'tokenizer_path = "{tmp_path}"'))
    proc = _ok("convert", "dcp-to-hf", run / "checkpoint" / "step-2", tmp_path / "hf")
    assert f"(llama4 tiny from {run / 'config.toml'}, float32; tokenizer: tokenizer.json)" in proc.stdout, proc.stdout
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_hf_to_dcp_bfloat16_trains_as_initial_load_path(hf_dir: Path, tmp_path: Path) -> None:
    _ok("convert", "hf-to-dcp", hf_dir, tmp_path / "dcp", "--dtype", "bfloat16")
    stored = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert stored["tok_embeddings.weight"].properties.dtype == torch.bfloat16
    model = empty_tiny_model()
    load_model_only(tmp_path / "dcp", [model])  # what checkpoint.initial_load_path does
    expected = load_file(hf_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.tok_embeddings.weight, expected.bfloat16().float())
    proc = _ok("train", "--config", DEBUG_CONFIG, "--training.seq_len", "64", "--training.steps", "1",
               "--checkpoint.initial_load_path", tmp_path / "dcp", "--job.dump_folder", tmp_path / "run")
    assert "loaded model weights from" in proc.stderr


def test_step_checkpoint_to_hf_matches_in_transformers(step_dir: Path, tmp_path: Path) -> None:
    """A run's step-N with no --model-name or --flavor: the run's config.toml names its model."""
    proc = _ok("convert", "dcp-to-hf", step_dir, tmp_path / "hf")
    assert f"(llama4 tiny from {step_dir.parent.parent / 'config.toml'}, float32)" in proc.stdout, proc.stdout
    trained = empty_tiny_model()
    load_model_only(step_dir, [trained])
    hf = transformers.Llama4ForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(0))  # > chunk 64
    with torch.no_grad():
        want, got = trained(tokens), hf(tokens).logits
    assert ((want - got).abs().max() / want.abs().max()).item() <= 1e-5


def test_wrong_flavor_names_the_one_that_fits(step_dir: Path, tmp_path: Path) -> None:
    proc = _torchmoe("convert", "dcp-to-hf", step_dir, tmp_path / "hf", "--flavor", "bench256")
    assert_user_error(proc, '--flavor = "bench256"', "does not fit", "fix: pass --flavor tiny")
    assert not (tmp_path / "hf").exists()


def test_missing_folder_is_a_user_error(tmp_path: Path) -> None:
    assert_user_error(_torchmoe("convert", "hf-to-dcp", tmp_path / "nope", tmp_path / "out"), "HF_DIR",
                      "No such file or directory")


def test_in_process_errors(hf_dir: Path, step_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.safetensors").touch()
    with pytest.raises(ConfigError, match="OUT_DIR .* is not empty"):
        hf_to_dcp(hf_dir, tmp_path / "full")
    with pytest.raises(ConfigError, match="HF_DIR .* has no config.json"):
        hf_to_dcp(step_dir, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"CKPT_DIR .*\(no \.metadata\)"):
        dcp_to_hf(hf_dir, tmp_path / "out", flavor="tiny")
    with pytest.raises(ConfigError, match='--flavor = "huge": not a flavor of --model-name = "llama4"'):
        dcp_to_hf(step_dir, tmp_path / "out", flavor="huge")


def test_damaged_inputs_are_config_errors(tmp_path):
    from torchmoe.commands.convert import dcp_to_hf, hf_to_dcp

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_text("garbage")
    with pytest.raises(ConfigError, match=r"\.metadata is damaged or truncated"):
        dcp_to_hf(tmp_path / "ckpt", tmp_path / "hf_out", flavor="tiny")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json is not JSON"):
        hf_to_dcp(tmp_path / "hf", tmp_path / "dcp_out")


def test_usage_errors_are_one_message(capsys) -> None:
    from torchmoe.commands import cli

    assert cli.main(["convert", "dcp-to-hf", "a"]) == 2
    err = capsys.readouterr().err
    assert 'torchmoe convert = "dcp-to-hf a"' in err and "the following arguments are required: OUT_DIR" in err
    assert "fix: run `torchmoe convert dcp-to-hf --help` for the usage" in err and "Traceback" not in err
    assert cli.main(["convert", "--help"]) == 0 and "hf-to-dcp" in capsys.readouterr().out


# A tensor of layer 1's experts, as each family stores them.
_EXPERT_TENSOR = {"qwen3": "model.layers.1.mlp.experts.7.down_proj.weight",
                  "deepseek_v3": "model.layers.1.mlp.experts.7.down_proj.weight",
                  "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj"}


@pytest.mark.parametrize("family", sorted(_EXPERT_TENSOR))
def test_family_folders_convert_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    """A Qwen3-MoE, DeepSeek-V3 or gpt-oss folder (experts one tensor each; DeepSeek's expert bias
    as e_score_correction_bias and its multi-token prediction layer as released; gpt-oss's fused,
    input-major, with biases): hf-to-dcp names the family and flavor to train it with, and
    dcp-to-hf --model-name writes back exactly its tensors and config."""
    from torchmoe.arch.registry import FLAVORS
    from torchmoe.commands.convert import convert_main
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    model = Transformer(FLAVORS[family]["tiny"].replace(mtp_layers=int(family == "deepseek_v3")))
    model.init_weights(seed=5)
    if family == "deepseek_v3":  # a trained bias, which its folders keep; an MTP layer (model.layers.4)
        for moe in model.moe_layers():
            moe.expert_bias.normal_(0, 0.1)
    save_model(model, tmp_path / "hf")
    assert convert_main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert f"--model.name {family} --model.flavor tiny" in capsys.readouterr().out
    assert convert_main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--model-name", family,
                         "--flavor", "tiny"]) == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert _EXPERT_TENSOR[family] in original and original.keys() == back.keys()
    assert ("model.layers.4.eh_proj.weight" in original) == (family == "deepseek_v3")
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text())
    # Read as Llama 4 (the library's default family), the tensors are another family's: the family
    # is named as the fault, not the flavor, with the family they are.
    with pytest.raises(ConfigError, match='--model-name = "llama4"') as err:
        dcp_to_hf(tmp_path / "dcp", tmp_path / "wrong", flavor="tiny")
    assert f"holds a {family} model" in str(err.value) and f"pass --model-name {family} --flavor tiny" in str(err.value)
    # Without --model-name and --flavor the command takes them from the tensors: the one flavor they fit.
    assert convert_main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "inferred")]) == 0
    assert f"({family} tiny, the one flavor its tensors fit, " in capsys.readouterr().out
    assert load_file(tmp_path / "inferred" / "model.safetensors").keys() == original.keys()
    with pytest.raises(ConfigError, match="--model-name"):
        dcp_to_hf(tmp_path / "dcp", tmp_path / "wrong", flavor="tiny", name="llama3")


def test_released_mxfp4_gpt_oss_folder_converts_to_training_weights(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss's releases' form (experts as MXFP4 blocks and scales): hf-to-dcp dequantises them
    and names the flavor; dcp-to-hf writes the unquantized folder, equal tensor for tensor to the
    unpacked twin the packed one was made from."""
    from tests.hf_parity import mxfp4_exact_experts, mxfp4_folder
    from torchmoe.arch.registry import FLAVORS
    from torchmoe.commands.convert import convert_main
    from torchmoe.hf import save_model
    from torchmoe.models.decoder.model import Transformer

    model = Transformer(FLAVORS["gpt_oss"]["tiny"])
    model.init_weights(seed=6)
    mxfp4_exact_experts(model, torch.Generator().manual_seed(6))
    save_model(model, tmp_path / "plain")
    packed = mxfp4_folder(tmp_path / "plain", tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in load_file(packed / "model.safetensors")
    assert convert_main(["hf-to-dcp", str(packed), str(tmp_path / "dcp")]) == 0
    assert "--model.name gpt_oss --model.flavor tiny" in capsys.readouterr().out
    assert convert_main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--model-name", "gpt_oss",
                         "--flavor", "tiny"]) == 0
    want, got = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
