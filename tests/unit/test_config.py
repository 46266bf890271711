"""Config front door: TOML + flag loading, strict validation, degree arithmetic, TOML round trip.

    python -m pytest -q tests/unit/test_config.py
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.helpers import write_toml
from torchmoe.arch.llama4 import FLAVORS
from torchmoe.arch.model_args import ModelArgs
from torchmoe.commands import cli
from torchmoe.config import (
    ConfigError,
    JobConfig,
    load_job_config,
    resolve_degrees,
    write_config_toml,
)
from torchmoe.config.errors import show_value
from torchmoe.config.job_config import Parallelism
from torchmoe.preflight import validate_job_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEBUG = str(CONFIGS / "debug_model.toml")


def _raises(fn, *args, key: str, value: str, fix: str, problem: str = "", **kwargs) -> ConfigError:
    """Assert `fn` raises a ConfigError naming `key`, showing `value` and suggesting `fix`."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    err = info.value
    message = str(err)
    assert err.key == key, message
    assert f"{key} = {value}" in message, message
    assert fix in err.fix and fix in message, message
    assert problem in err.problem, message
    return err


# ---- shipped configs -------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "world_size"), [("debug_model", 1), ("llama4_16e", 64), ("llama4_128e", 256),
                                                  ("llama4_128e", 1024), ("qwen3_30b_a3b", 64), ("qwen3_30b_a3b", 1)])
def test_shipped_configs_load_and_validate(name: str, world_size: int) -> None:
    cfg = load_job_config(["--config", str(CONFIGS / f"{name}.toml")])
    validate_job_config(cfg, world_size, check_device=name == "debug_model")


def test_shipped_configs_have_run_command_header() -> None:
    for path in CONFIGS.glob("*.toml"):
        assert f"-m torchmoe train --config configs/{path.name}" in path.read_text(), path


def test_debug_config_values() -> None:
    cfg = load_job_config(["--config", DEBUG])
    assert (cfg.model.flavor, cfg.training.device) == ("tiny", "cpu")
    assert cfg.training.mixed_precision_param == "float32"
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.checkpoint.enable) == (128, 8, False)
    assert cfg.job.dump_folder == "./outputs/debug"


# ---- precedence and flag syntax --------------------------------------------------------------


def test_flag_beats_toml_beats_default(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = load_job_config(["--config", path, "--training.steps", "7"])
    assert cfg.training.steps == 7  # flag
    assert cfg.training.seq_len == 64  # TOML
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # TOML int for a float field
    assert cfg.training.seed == JobConfig().training.seed  # default
    assert load_job_config([]) == JobConfig()


def test_equals_form_hyphens_and_negative_numbers() -> None:
    cfg = load_job_config(["--config=" + DEBUG, "--parallelism.tensor_parallel_degree=4",
                           "--optimizer.lr", "1e-4", "--parallelism.data-parallel-shard-degree", "-1"])
    assert cfg.parallelism.tensor_parallel_degree == 4
    assert cfg.optimizer.lr == 1e-4
    assert cfg.parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize(("args", "expected"), [
    (["--compile.enable", "true"], True),
    (["--compile.enable=True"], True),
    (["--compile.enable", "FALSE"], False),
    (["--compile.enable"], True),
])
def test_boolean_flags(args: list[str], expected: bool) -> None:
    assert load_job_config(args).compile.enable is expected


def test_boolean_flag_false_overrides_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[checkpoint]\nenable = true\n")
    assert load_job_config(["--config", path, "--checkpoint.enable", "false"]).checkpoint.enable is False


_FLOAT8 = ["--float8.enable", "true"]  # the switch float8.filter_fqns needs (`dependent_keys`)


def test_list_flags() -> None:
    assert load_job_config([*_FLOAT8, "--float8.filter_fqns", "output", "router", "gate"]).float8.filter_fqns == \
        ["output", "router", "gate"]
    assert load_job_config([*_FLOAT8, "--float8.filter_fqns=output"]).float8.filter_fqns == ["output"]
    assert load_job_config([*_FLOAT8, "--float8.filter_fqns"]).float8.filter_fqns == []


# Each list flag beside the setting it needs (`dependent_keys`).
_SWITCHES = {"lora": ["--lora.enable", "true"], "float8": _FLOAT8, "optimizer": ["--optimizer.name", "Muon"],
             "parallelism": ["--parallelism.pipeline_parallel_degree", "2"]}


@pytest.mark.parametrize(("flag", "value", "field", "want"), [
    ("--lora.targets", '["attention", "experts"]', ("lora", "targets"), ["attention", "experts"]),
    ("--lora.targets", "[ 'mlp' ]", ("lora", "targets"), ["mlp"]),
    ("--float8.filter_fqns", "[]", ("float8", "filter_fqns"), []),
    ("--optimizer.ns_coefficients", "[3, -4.5, 2.0]", ("optimizer", "ns_coefficients"), [3.0, -4.5, 2.0]),
    ("--parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"], ["layers.1", "output"]]',
     ("parallelism", "module_fqns_per_model_part"), [["tok_embeddings", "layers.0"], ["layers.1", "output"]]),
])
def test_a_list_flag_takes_the_toml_array_a_config_file_holds(flag, value, field, want) -> None:
    """Not split at its commas into bracketed, quoted names (which named no LoRA target)."""
    got = getattr(getattr(load_job_config([*_SWITCHES[field[0]], flag, value]), field[0]), field[1])
    assert got == want and all(type(a) is type(b) for a, b in zip(got, want))


@pytest.mark.parametrize(("flag", "value", "problem"), [
    ("--lora.targets", '["attention", 1]', "expected an array of strings"),
    ("--lora.targets", '["attention"', "not a TOML array"),
    ("--optimizer.ns_coefficients", "[3, true, 2]", "expected an array of numbers"),
    ("--parallelism.module_fqns_per_model_part", '["layers.0"]', "expected an array of arrays of strings"),
])
def test_a_bad_toml_array_flag_names_the_flag_and_the_forms(flag, value, problem) -> None:
    _raises(load_job_config, [flag, value], key=flag, value=show_value(value), problem=problem,
            fix="pass a TOML array, e.g.")


def test_help_shows_docstrings_and_toml_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_toml(tmp_path, "[parallelism]\ntensor_parallel_degree = 4\n")
    with pytest.raises(SystemExit) as info:
        load_job_config(["--config", path, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--parallelism.tensor_parallel_degree" in out and "Tensor-parallel degree" in out
    assert "(default: 4)" in out
    assert "--float8.filter_fqns" in out


@pytest.mark.parametrize(("training", "flags", "masked"), [
    ('dataset = "chat"\ndataset_path = "c.jsonl"', [], True),  # separate examples: masked by default
    ('dataset = "chat"\ndataset_path = "c.jsonl"', ["--training.dataset", "local"], False),  # the flag's kind
    ('dataset = "local"\ndataset_path = "d.jsonl"', ["--training.dataset", "chat"], True),
    ('dataset = "chat"\ndataset_path = "c.jsonl"\ndocument_masking = false', [], False),  # set: as it is
    ('dataset = "chat"\ndataset_path = "c.jsonl"', ["--training.document_masking", "false"], False),
    ('dataset = "python_docs"', [], False),  # text keeps torchtitan's default
    ('dataset = "python_docs"\ndocument_masking = true', [], True),
    ('dataset_mix = ["web=0.7:local:w.jsonl", "chat=0.3:chat:c.jsonl"]', [], True),  # a chat source
    ('dataset_mix = ["web=0.7:local:w.jsonl", "c=0.3:tokens:x"]', [], False),
])
def test_document_masking_defaults_to_the_dataset_s_kind(tmp_path: Path, training: str, flags: list[str],
                                                          masked: bool) -> None:
    """`training.document_masking` left out: true for data of separate examples (chat), false for
    text, whichever of the file and the flags names the dataset; set in either, as it is."""
    path = write_toml(tmp_path, f"[training]\n{training}\n")
    assert load_job_config(["--config", path, *flags]).training.document_masking is masked


def test_torchtitan_s_causal_mask_type_keeps_chat_unmasked(tmp_path: Path) -> None:
    """torchtitan's ``attn_mask_type = "causal"`` sets document_masking (false) as the key itself
    would: a torchtitan file for chat data runs unchanged, unmasked."""
    path = write_toml(tmp_path, '[model]\nattn_mask_type = "causal"\n[training]\ndataset = "chat"\n'
                                'dataset_path = "c.jsonl"\n')
    assert load_job_config(["--config", path]).training.document_masking is False


def test_help_and_the_written_config_show_the_resolved_masking(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A chat job file without the key: `--help` shows true as the default the job would use,
    and the run's config.toml writes it out (a resumed run reads the same)."""
    path = write_toml(tmp_path, '[training]\ndataset = "chat"\ndataset_path = "c.jsonl"\n')
    with pytest.raises(SystemExit):
        load_job_config(["--config", path, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--training.document_masking {true,false}" in out
    assert out.split("--training.document_masking", 1)[1].split("--training.", 1)[0].rstrip().endswith(
        "(default: true)")
    written = write_config_toml(load_job_config(["--config", path]), tmp_path / "run" / "config.toml")
    assert "document_masking = true" in written.read_text()
    assert load_job_config(["--config", str(written), "--training.dataset", "local"]).training.document_masking


# ---- flag errors -----------------------------------------------------------------------------


def test_unknown_flag_suggests_closest() -> None:
    _raises(load_job_config, ["--training.stesp", "5"], key="--training.stesp", value='"5"',
            fix="did you mean --training.steps?", problem="unknown option")
    _raises(load_job_config, ["--optimizer.warmup_steps", "5"], key="--optimizer.warmup_steps", value='"5"',
            fix="--lr_scheduler.warmup_steps")


@pytest.mark.parametrize(("args", "key", "value", "fix"), [
    (["--training.steps", "ten"], "--training.steps", '"ten"', "pass an integer"),
    (["--optimizer.lr", "fast"], "--optimizer.lr", '"fast"', "pass a number"),
    (["--compile.enable", "yes"], "--compile.enable", '"yes"', "pass true or false"),
    (["--training.steps"], "--training.steps", '""', "pass one value"),
    (["--training.steps", "1", "2"], "--training.steps", '"1 2"', "pass one value"),
    (["configs/debug_model.toml"], "argument", '"configs/debug_model.toml"', "--config configs/debug_model.toml"),
    (["--config", "a.toml", "--config", "b.toml"], "--config", '"b.toml"', "single --config"),
])
def test_bad_flag_values(args: list[str], key: str, value: str, fix: str) -> None:
    _raises(load_job_config, args, key=key, value=value, fix=fix)


# ---- TOML errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "value", "fix", "problem"), [
    ("[trainig]\nsteps = 5\n", "[trainig]", "{steps = 5}", "did you mean [training]?", "unknown section"),
    ("[training]\nstesp = 5\n", "training.stesp", "5", "did you mean training.steps?", "unknown key"),
    ("[optimizer]\nwarmup_steps = 5\n", "optimizer.warmup_steps", "5", "lr_scheduler.warmup_steps", "unknown key"),
    ("steps = 5\n", "steps", "5", "[training] steps", "outside any [section]"),
    ('[training]\nsteps = "5"\n', "training.steps", '"5"', "steps = 5", "expected an integer"),
    ("[training]\nsteps = 5.0\n", "training.steps", "5.0", "as an integer", "expected an integer"),
    ('[optimizer]\nlr = "3e-4"\n', "optimizer.lr", '"3e-4"', "lr = 0.0003", "expected a number"),
    ('[compile]\nenable = "true"\n', "compile.enable", '"true"', "enable = true", "expected a boolean"),
    ("[model]\nflavor = 7\n", "model.flavor", "7", "as a string", "expected a string"),
    ('[float8]\nfilter_fqns = "output"\n', "float8.filter_fqns", '"output"', 'filter_fqns = ["output"]',
     "expected a list"),
    ("training = 3\n", "training", "3", "[training] followed by", "expected a [section] table"),
])
def test_toml_errors(tmp_path: Path, text: str, key: str, value: str, fix: str, problem: str) -> None:
    _raises(load_job_config, ["--config", write_toml(tmp_path, text)], key=key, value=value, fix=fix, problem=problem)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    _raises(load_job_config, ["--config", missing], key="--config", value=f'"{missing}"',
            fix="configs/debug_model.toml", problem="No such file or directory")
    bad = write_toml(tmp_path, '[training]\nsteps = 5\nseq_len = "abc\n')
    err = _raises(load_job_config, ["--config", bad], key="--config", value=f'"{bad}"', fix="TOML syntax",
                  problem="malformed TOML")
    assert "line 3" in err.problem


# ---- validation rules ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def debug_cfg() -> JobConfig:
    return load_job_config(["--config", DEBUG])


def _with(base: JobConfig, settings: dict[str, object]) -> JobConfig:
    cfg = copy.deepcopy(base)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


# (settings on top of debug_model.toml, world size, key, value as shown, fix substring, problem substring)
RULES = [
    ({"training.steps": 0}, 1, "training.steps", "0", "1 or more", ">= 1"),
    ({"optimizer.lr": 0.0}, 1, "optimizer.lr", "0.0", "positive", "> 0"),
    ({"optimizer.lr": math.nan}, 1, "optimizer.lr", "nan", "positive", "> 0"),
    ({"training.seq_len": 0}, 1, "training.seq_len", "0", "1 or more", ">= 1"),
    ({"training.local_batch_size": 0}, 1, "training.local_batch_size", "0", "1 or more", ">= 1"),
    ({"lr_scheduler.warmup_steps": -1}, 1, "lr_scheduler.warmup_steps", "-1", "0 for no warmup", ">= 0"),
    ({"lr_scheduler.min_lr_factor": 1.5}, 1, "lr_scheduler.min_lr_factor", "1.5", "between 0 and 1", "[0, 1]"),
    ({"lr_scheduler.decay_ratio": -0.5}, 1, "lr_scheduler.decay_ratio", "-0.5", "or -1", "[0, 1]"),
    ({"lr_scheduler.decay_ratio": 1.5}, 1, "lr_scheduler.decay_ratio", "1.5", "or -1", "[0, 1]"),
    ({"metrics.log_freq": 0}, 1, "metrics.log_freq", "0", "1 or more", ">= 1"),
    ({"training.dataset_extensions": [".py", "md"]}, 1, "training.dataset_extensions", '[".py", "md"]',
     'write it as ".md"', '"md" is not a file extension'),
    ({"training.dataset_extensions": ["*.rs"]}, 1, "training.dataset_extensions", '["*.rs"]', 'write it as ".rs"',
     "without slashes, wildcards or spaces"),
    ({"metrics.log_level": "WARNING"}, 1, "metrics.log_level", '"WARNING"', 'did you mean "warning"', "allowed"),
    ({"metrics.log_level": "verbose"}, 1, "metrics.log_level", '"verbose"', '"warning", "info", "debug"', "allowed"),
    ({"checkpoint.keep_latest_k": -1}, 1, "checkpoint.keep_latest_k", "-1", "0 to keep every", ">= 0"),
    ({"checkpoint.interval": 0}, 1, "checkpoint.interval", "0", "1 or more", ">= 1"),
    ({"lr_scheduler.decay_type": "cosin"}, 1, "lr_scheduler.decay_type", '"cosin"', 'did you mean "cosine"', "allowed"),
    ({"activation_checkpoint.mode": "ful"}, 1, "activation_checkpoint.mode", '"ful"', 'did you mean "full"', "allowed"),
    ({"parallelism.fsdp_reshard_after_forward": "sometimes"}, 1, "parallelism.fsdp_reshard_after_forward",
     '"sometimes"', '"always"', "allowed"),
    ({"training.mixed_precision_param": "fp16"}, 1, "training.mixed_precision_param", '"fp16"', '"bfloat16"',
     "allowed"),
    ({"training.mixed_precision_reduce": "float16"}, 1, "training.mixed_precision_reduce", '"float16"',
     '"float32"', "allowed"),
    ({"training.dtype": "bf16"}, 1, "training.dtype", '"bf16"', 'did you mean "bfloat16"', "allowed"),
    # debug_model.toml computes in float32: over pure bf16 parameters that would only upcast them.
    ({"training.dtype": "bfloat16"}, 1, "training.mixed_precision_param", '"float32"',
     'mixed_precision_param = "bfloat16" for pure bf16', 'would compute in float32 from bf16 parameters'),
    ({"model.flavor": "17bx16"}, 1, "model.flavor", '"17bx16"', 'did you mean "17bx16e"',
     'not a flavor of model.name = "llama4"'),
    ({"optimizer.name": "adamw"}, 1, "optimizer.name", '"adamw"', 'did you mean "AdamW"', "allowed"),
    ({"optimizer.implementation": "triton"}, 1, "optimizer.implementation", '"triton"', '"foreach"', "allowed"),
    ({"checkpoint.async_mode": "asynch"}, 1, "checkpoint.async_mode", '"asynch"', 'did you mean "async"', "allowed"),
    # keys torchmoe shares with torchtitan v0.2.2
    ({"model.name": "llama3"}, 1, "model.name", '"llama3"', "use one of them, with one of its flavors",
     'the mixture-of-experts families "llama4", "qwen3"'),
    ({"lr_scheduler.total_steps": 0}, 1, "lr_scheduler.total_steps", "0", "-1 for training.steps", ">= 1"),
    ({"training.gc_freq": -1}, 1, "training.gc_freq", "-1", "0 for Python's automatic", ">= 0"),
    ({"training.dataset": "C4"}, 1, "training.dataset", '"C4"', 'did you mean "c4"', "allowed"),
    ({"parallelism.expert_tensor_parallel_degree": 4}, 1, "parallelism.expert_tensor_parallel_degree", "4",
     "set it to 1", "must be 1 or tensor_parallel_degree (1)"),
    ({"parallelism.expert_tensor_parallel_degree": 2, "parallelism.tensor_parallel_degree": 2,
      "parallelism.expert_parallel_degree": 2}, 4, "parallelism.expert_tensor_parallel_degree", "2",
     "EP then borrows the tp ranks", "ep(2) and tp(2) at once (2-D) are not supported"),
    ({"checkpoint.export_dtype": "fp16"}, 1, "checkpoint.export_dtype", '"fp16"', '"float16"', "allowed"),
    ({"checkpoint.load_step": -2}, 1, "checkpoint.load_step", "-2", "-1 for the newest", ">= 0"),
    ({"checkpoint.exclude_from_loading": ["optimiser"]}, 1, "checkpoint.exclude_from_loading", '"optimiser"',
     'did you mean "optimizer"', "allowed"),
    ({"checkpoint.enable": True, "checkpoint.create_seed_checkpoint": True, "checkpoint.load_only": True}, 1,
     "checkpoint.load_only", "true", "load_only = false", "which load_only forbids"),
    ({"compile.components": ["model", "los"]}, 1, "compile.components", '"los"', 'did you mean "loss"', "allowed"),
    ({"compile.backend": ""}, 1, "compile.backend", '""', '"inductor"', "must name a torch.compile backend"),
    ({"profiling.profiler_active": 0}, 1, "profiling.profiler_active", "0", "1 or more", ">= 1"),
    ({"profiling.profiler_active": 11}, 1, "profiling.profiler_active", "11", "raise profile_freq",
     "profile_freq = 10"),
    ({"profiling.profiler_warmup": -1}, 1, "profiling.profiler_warmup", "-1", "0 or more", ">= 0"),
    ({"profiling.enable_step_breakdown": True, "profiling.profile_freq": 6, "training.steps": 5}, 1,
     "profiling.profile_freq", "6", "at most 5", "traces no step of a 5-step run (training.steps)"),
    ({"validation.freq": 0}, 1, "validation.freq", "0", "1 or more", ">= 1"),
    ({"validation.steps": 0}, 1, "validation.steps", "0", "-1 for one pass", ">= 1"),
    ({"validation.dataset": "local"}, 1, "validation.dataset_path", '""', "set dataset_path", "needs a path"),
    ({"validation.enable": True, "validation.dataset": "python_docs", "parallelism.pipeline_parallel_degree": 2,
      "training.local_batch_size": 2}, 2, "validation.enable", "true", "without pipeline parallelism",
     "does not run under pipeline parallelism (pp = 2)"),
    ({"validation.enable": True, "validation.dataset": "python_docs", "parallelism.context_parallel_degree": 2,
      "validation.seq_len": 64}, 2, "validation.seq_len", "64", "validation.seq_len = 128",
     "under context parallelism (cp = 2) it must be training.seq_len (128)"),
    ({"validation.enable": True, "validation.dataset": "python_docs", "parallelism.tensor_parallel_degree": 2,
      "validation.seq_len": 65}, 2, "validation.seq_len", "65", "multiple of 2", "65 % 2 = 1"),
    ({"profiling.profile_freq": 0}, 1, "profiling.profile_freq", "0", "1 or more", ">= 1"),
    # numbers that would overflow later: 64-bit integers, timeouts, positions
    ({"training.seed": 2**64}, 1, "training.seed", str(2**64), "smaller number", "does not fit in 64 bits"),
    ({"training.steps": 2**63}, 1, "training.steps", str(2**63), "smaller number", "9223372036854775807"),
    ({"comm.init_timeout_seconds": 10**14}, 1, "comm.init_timeout_seconds", str(10**14), "seconds",
     "<= 2147483647"),
    ({"training.seq_len": 4096}, 1, "training.seq_len", "4096", "at most 2048", "has 2048 positions"),
    ({"checkpoint.create_seed_checkpoint": True}, 1, "checkpoint.create_seed_checkpoint", "true",
     "--checkpoint.enable true", "needs checkpoint.enable"),
    ({"training.dataset": "c5"}, 1, "training.dataset", '"c5"', '"python_docs"', "allowed"),
    ({"parallelism.pipeline_parallel_schedule": "1f1b"}, 1, "parallelism.pipeline_parallel_schedule", '"1f1b"',
     'did you mean "1F1B"', "allowed"),
    ({"model.attn_backend": "flash"}, 1, "model.attn_backend", '"flash"', '"sdpa"', "allowed"),
    ({"training.dataset": "local"}, 1, "training.dataset_path", '""', "set dataset_path", "needs a path"),
    ({"checkpoint.initial_load_in_hf": True}, 1, "checkpoint.initial_load_in_hf", "true", "initial_load_path",
     "no checkpoint.initial_load_path"),
    ({"activation_checkpoint.selective_ac_option": "abc"}, 1, "activation_checkpoint.selective_ac_option", '"abc"',
     '"op"', "positive integer"),
    # degrees
    ({"parallelism.data_parallel_replicate_degree": 2, "parallelism.data_parallel_shard_degree": 4,
      "parallelism.tensor_parallel_degree": 3}, 16, "parallelism.data_parallel_shard_degree", "4",
     "data_parallel_shard_degree = -1",
     "dp_replicate(2) * dp_shard(4) * cp(1) * tp(3) * pp(1) = 24 != WORLD_SIZE(16)"),
    ({"parallelism.tensor_parallel_degree": 3}, 16, "parallelism.data_parallel_shard_degree", "-1",
     "multiple of 3", "WORLD_SIZE(16) / (dp_replicate(1) * cp(1) * tp(3) * pp(1)) = 16/3 is not an integer"),
    ({"parallelism.data_parallel_shard_degree": 0}, 1, "parallelism.data_parallel_shard_degree", "0",
     "set it to 1", "or -1"),
    ({"parallelism.tensor_parallel_degree": 2, "parallelism.expert_parallel_degree": 3}, 4,
     "parallelism.expert_parallel_degree", "3", "divides 4: 1, 2, 4",
     "must divide dp_shard(2) * cp(1) * tp(2) = 4"),
    ({"parallelism.tensor_parallel_degree": 2, "parallelism.expert_parallel_degree": 6}, 6,
     "parallelism.expert_parallel_degree", "6", "divides 8: 1, 2, 4, 8", "has 8 experts; 8 % 6 = 2"),
    ({"parallelism.data_parallel_replicate_degree": 2, "parallelism.data_parallel_shard_degree": 1,
      "parallelism.tensor_parallel_degree": 2}, 4, "parallelism.data_parallel_replicate_degree", "2",
     "plain DDP with every other degree 1", "HSDP needs dp_shard > 1"),
    ({"parallelism.data_parallel_replicate_degree": 2, "parallelism.pipeline_parallel_degree": 2}, 4,
     "parallelism.data_parallel_replicate_degree", "2", "data_parallel_shard_degree > 1", "pp(2)"),
    # model shape vs degrees
    ({"parallelism.tensor_parallel_degree": 3}, 3, "parallelism.tensor_parallel_degree", "3", "1, 2, 4",
     "n_heads (8); 8 % 3 = 2"),
    ({"parallelism.tensor_parallel_degree": 8}, 8, "parallelism.tensor_parallel_degree", "8", "1, 2, 4",
     "n_kv_heads (4)"),
    ({"parallelism.pipeline_parallel_degree": 5}, 5, "parallelism.pipeline_parallel_degree", "5", "at most 4 stages",
     "5 pipeline stages (1F1B) on pp(5), but the model has 4 layers"),
    ({"parallelism.pipeline_parallel_degree": 4, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B"}, 4,
     "parallelism.pipeline_parallel_degree", "4", "single-stage schedule", "8 pipeline stages (Interleaved1F1B)"),
    # forced MoE balance (8 experts, top 1): whole runs of 8 tokens per rank, in every layout
    ({"model.moe_force_load_balance": True, "training.seq_len": 60}, 1, "model.moe_force_load_balance", "true",
     "a training.seq_len that makes it a multiple of 8", "only if a sequence holds a multiple of num_experts / "
     "gcd(num_experts, top_k) = 8 tokens, not 60"),
    ({"model.moe_force_load_balance": True, "training.seq_len": 72, "parallelism.context_parallel_degree": 2}, 2,
     "model.moe_force_load_balance", "true", "multiple of 8", "a context-parallel piece (seq_len / 2cp = 72 / 4) "
     "holds a multiple of num_experts / gcd(num_experts, top_k) = 8 tokens, not 18"),
    ({"model.moe_force_load_balance": True, "training.seq_len": 24, "parallelism.tensor_parallel_degree": 2,
      "parallelism.expert_parallel_degree": 2}, 2, "model.moe_force_load_balance", "true", "multiple of 8",
     "a rank's sequence shard under EP with TP (seq_len / cp / tp = 24 / 1 / 2) holds a multiple"),
    # pipeline schedules, stages and micro-batches
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatch_size": 8}, 2,
     "parallelism.pipeline_parallel_microbatch_size", "8", ">= 2", "gives 1 micro-batches (local_batch_size 8), "
     "but 1F1B needs at least 2"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "DualPipeV",
      "training.local_batch_size": 2}, 2, "parallelism.pipeline_parallel_microbatch_size", "1", ">= 4",
     "DualPipeV needs at least 4 (stages)"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
      "training.local_batch_size": 5}, 2, "parallelism.pipeline_parallel_microbatch_size", "1", "multiple of 2",
     "rounds of pp(2)"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatches": 3}, 2,
     "parallelism.pipeline_parallel_microbatches", "3", "divides 8", "local_batch_size(8)"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatches": 2,
      "parallelism.pipeline_parallel_microbatch_size": 2}, 2, "parallelism.pipeline_parallel_microbatches", "2",
     "only one of the two", "!= training.local_batch_size(8)"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_layers_per_stage": 1}, 2,
     "parallelism.pipeline_parallel_layers_per_stage", "1", "multi-stage schedule", "2 per rank, but 1F1B runs one"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "LoopedBFS",
      "parallelism.pipeline_parallel_layers_per_stage": 2}, 2, "parallelism.pipeline_parallel_layers_per_stage", "2",
     "GPipe or 1F1B", "one per rank, but LoopedBFS interleaves"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_layers_per_stage": 3,
      "parallelism.pipeline_parallel_schedule": "ZBVZeroBubble"}, 2, "parallelism.pipeline_parallel_layers_per_stage",
     "3", "use 4 stages", "1 per rank, but ZBVZeroBubble runs exactly two"),
    ({"parallelism.pipeline_parallel_degree": 2,
      "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm"],
                                                 ["layers.3", "output"]]}, 2,
     "parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"', "multiple of 2", "3 pipeline stages (1F1B) on pp(2)"),
    ({"parallelism.pipeline_parallel_degree": 2,
      "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0", "norm"], ["layers.1", "layers.2",
                                                                                          "layers.3", "output"]]}, 2,
     "parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"', "move it", "'norm' is in stage 0"),
    ({"parallelism.pipeline_parallel_degree": 2,
      "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["layers.2", "layers.1",
                                                                                  "layers.3", "norm", "output"]]}, 2,
     "parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"', "in order", "they hold [0, 2, 1, 3]"),
    ({"parallelism.pipeline_parallel_degree": 2,
      "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0", "layers.1"],
                                                 ["layers.2", "layer.3", "norm", "output"]]}, 2,
     "parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"', "write it like", "'layer.3' is not a module"),
    ({"parallelism.pipeline_parallel_degree": 2,
      "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"],
                                                 ["norm", "output"]]}, 2,
     "parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"', "at least one layers.N", "stage 1 holds no"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "ZBVZeroBubble",
      "compile.enable": True}, 2, "parallelism.pipeline_parallel_schedule", '"ZBVZeroBubble"', "compile.enable = false",
     "input and weight halves"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "DualPipeV",
      "activation_checkpoint.mode": "selective"}, 2, "activation_checkpoint.selective_ac_option", '"op"',
     'mode = "full"', "runs each block's backward twice"),
    ({"parallelism.pipeline_parallel_layers_per_stage": 0}, 1, "parallelism.pipeline_parallel_layers_per_stage", "0",
     "-1 for the default", ">= 1"),
    # Both split keys, disagreeing: one would be ignored (the explicit stages won, silently), with
    # or without PP. (Agreeing, as torchtitan's own Maverick preset sets them, they are accepted:
    # tests/integration/test_torchtitan_files.py.)
    *[({"parallelism.pipeline_parallel_degree": pp, "parallelism.pipeline_parallel_layers_per_stage": 3,
        "parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0", "layers.1"],
                                                   ["layers.2", "layers.3", "norm", "output"]]}, pp,
       "parallelism.pipeline_parallel_layers_per_stage", "3",
       "set only one (pipeline_parallel_layers_per_stage = -1 keeps the explicit stages), or make them agree",
       "parallelism.module_fqns_per_model_part also sets the stages, with [2, 2] blocks per stage: the explicit "
       "stages would run and this be ignored")
      for pp in (1, 2)],
    ({"comm.init_timeout_seconds": 0}, 1, "comm.init_timeout_seconds", "0", "1 or more", ">= 1"),
    ({"comm.train_timeout_seconds": -5}, 1, "comm.train_timeout_seconds", "-5", "1 or more", ">= 1"),
    ({"comm.trace_buf_size": -1}, 1, "comm.trace_buf_size", "-1", "flight recorder off", ">= 0"),
    ({"checkpoint.timeout_seconds": 0}, 1, "checkpoint.timeout_seconds", "0", "-1 for comm.init_timeout_seconds",
     ">= 1"),
    ({"checkpoint.timeout_seconds": 10**14}, 1, "checkpoint.timeout_seconds", str(10**14), "seconds", "<="),
    ({"parallelism.fsdp_cpu_offload": True, "training.device": ""}, 1, "parallelism.fsdp_cpu_offload", "true",
     "data_parallel_shard_degree > 1", "applies no FSDP"),
    ({"parallelism.context_parallel_degree": 2, "training.seq_len": 130}, 2, "training.seq_len", "130",
     "multiple of 4", "2 * cp = 4 chunks; 130 % 4 = 2"),
    ({"parallelism.tensor_parallel_degree": 2, "training.seq_len": 127}, 2, "training.seq_len", "127",
     "multiple of 2", "sequence parallelism"),
    ({"training.global_batch_size": 100, "parallelism.data_parallel_shard_degree": 2}, 2,
     "training.global_batch_size", "100", "multiple of 16",
     "local_batch_size(8) * dp_replicate(1) * dp_shard(2) = 16; 100 % 16 = 4"),
    ({"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatch_size": 3}, 2,
     "parallelism.pipeline_parallel_microbatch_size", "3", "divides 8", "local_batch_size(8)"),
    ({"optimizer.lr": float("inf")}, 1, "optimizer.lr", "inf", "positive value", "finite number > 0"),
    ({"training.max_norm": float("nan")}, 1, "training.max_norm", "nan", "0 to disable", "finite number"),
    ({"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "²"}, 1,
     "activation_checkpoint.selective_ac_option", '"²"', "", ""),
    # feature combinations
    ({"parallelism.enable_async_tensor_parallel": True}, 1, "parallelism.enable_async_tensor_parallel", "true",
     "compile.enable = true", "torch.compile"),
    ({"activation_checkpoint.mode": "selective", "model.attn_backend": "flex"}, 1, "activation_checkpoint.mode",
     '"selective"', 'attn_backend = "sdpa"', '"flex"'),
    ({"float8.enable": True}, 1, "float8.enable", "true", "float8.emulate = true", "compute capability 8.9"),
    ({"parallelism.fsdp_cpu_offload": True}, 2, "parallelism.fsdp_cpu_offload", "true",
     "fsdp_cpu_offload = false", 'training.device = "cpu"'),
    ({"parallelism.enable_async_tensor_parallel": True, "compile.enable": True}, 1,
     "parallelism.enable_async_tensor_parallel", "true", "= false", 'training.device = "cpu"'),
    ({"float8.enable": True, "float8.enable_fsdp_float8_all_gather": True, "float8.recipe_name": "rowwise"}, 1,
     "float8.enable_fsdp_float8_all_gather", "true", 'recipe_name = "tensorwise"', "only works with"),
]


# Every numeric key of [optimizer], [lr_scheduler] and [lora] in its domain (debug_model.toml: lr
# 3e-3), the model-dependent ones (a pattern, a target) against the model: (settings, key, value
# as shown, fix substring, problem substring).
_MUON = {"optimizer.name": "Muon"}
_LORA = {"lora.enable": True, "lora.export": "merged"}
DOMAINS = [
    ({"optimizer.qk_clip_threshold": 1e-300}, "optimizer.qk_clip_threshold", "1e-300", "Kimi K2: 100",
     "must be 0 (off) or a finite logit >= 0.01: a head held below it attends uniformly"),
    ({"optimizer.qk_clip_threshold": 0.005}, "optimizer.qk_clip_threshold", "0.005", "Kimi K2: 100", ">= 0.01"),
    ({"optimizer.qk_clip_threshold": math.inf}, "optimizer.qk_clip_threshold", "inf", "Kimi K2: 100", ">= 0.01"),
    ({"optimizer.weight_decay": 400.0}, "optimizer.weight_decay", "400.0",
     "use a weight decay below 1 / optimizer.lr = 333.3 (typical: 0.1), or lower optimizer.lr",
     "each step multiplies the decayed weights by 1 - optimizer.lr * weight_decay = 1 - 0.003 * 400 = -0.2 at the "
     "peak LR: they would be zeroed or change sign every step"),
    ({**_MUON, "optimizer.adamw_lr": 0.5, "optimizer.adamw_weight_decay": 2.0}, "optimizer.adamw_weight_decay",
     "2.0", "below 1 / optimizer.adamw_lr = 2", "1 - optimizer.adamw_lr * weight_decay = 1 - 0.5 * 2 = 0"),
    # adamw_weight_decay -1: the AdamW parameters decay by weight_decay at adamw_lr
    ({**_MUON, "optimizer.adamw_lr": 0.5, "optimizer.weight_decay": 3.0}, "optimizer.weight_decay", "3.0",
     "below 1 / optimizer.adamw_lr = 2", "1 - optimizer.adamw_lr * weight_decay = 1 - 0.5 * 3 = -0.5"),
    ({**_LORA, "lora.alpha": 1e308}, "lora.alpha", "1e+308", "set alpha between 0.015625 and 16384 for rank 16",
     "scales the adapters' output by alpha / rank = 1e+308 / 16 = 6.25e+306, outside [0.000976562, 1024]"),
    ({**_LORA, "lora.alpha": 0.001}, "lora.alpha", "0.001", "between 0.015625 and 16384", "outside"),
    ({**_LORA, "lora.alpha": 1.0, "lora.rank": 4096}, "lora.alpha", "1.0", "between 4 and 4.1943e+06", "outside"),
    ({**_MUON, "optimizer.muon_params": ["layers.*.moe.router.gat.weight"]}, "optimizer.muon_params",
     '"layers.*.moe.router.gat.weight"', "write a glob over the model's parameter names",
     'matches no parameter of the llama4 model (its names are like "layers.*.moe.router.gate.weight"'),
    ({**_MUON, "optimizer.adamw_params": ["layer.0.*"]}, "optimizer.adamw_params", '"layer.0.*"', "or remove it",
     "so it moves nothing between Muon and AdamW"),
    ({**_LORA, "model.name": "qwen3", "lora.targets": ["attention", "shared_experts"]}, "lora.targets",
     '["attention", "shared_experts"]', 'drop "shared_experts" from lora.targets; this model has "attention", "mlp", '
     '"experts", "router"', '"shared_experts": the qwen3 model (tiny) has no shared expert, so no adapter would be '
     "put there"),
    ({**_LORA, "model.name": "gpt_oss", "lora.targets": ["mlp"]}, "lora.targets", '["mlp"]',
     'this model has "attention", "experts", "router"', "has no dense (non-MoE) layer"),
    # Not named by the issue: each numeric key's domain.
    ({"optimizer.eps": 0.0}, "optimizer.eps", "0.0", "positive value", "finite number > 0"),
    ({"optimizer.lr": 0.0}, "optimizer.lr", "0.0", "positive value", "finite number > 0"),
    ({"optimizer.beta1": 1.0}, "optimizer.beta1", "1.0", "beta1 = 0.9", "[0, 1)"),
    ({"optimizer.beta2": math.nan}, "optimizer.beta2", "nan", "beta2 = 0.95", "[0, 1)"),
    ({"optimizer.weight_decay": math.inf}, "optimizer.weight_decay", "inf", "disable weight decay", ">= 0"),
    ({"optimizer.weight_decay": -0.1}, "optimizer.weight_decay", "-0.1", "disable weight decay", ">= 0"),
    ({**_MUON, "optimizer.ns_eps": math.nan}, "optimizer.ns_eps", "nan", "positive value", "finite number > 0"),
    ({**_MUON, "optimizer.adamw_lr": math.inf}, "optimizer.adamw_lr", "inf", "positive value", "finite"),
    ({"lr_scheduler.min_lr_factor": 1.5}, "lr_scheduler.min_lr_factor", "1.5", "between 0 and 1", "[0, 1]"),
    ({"lr_scheduler.decay_ratio": math.nan}, "lr_scheduler.decay_ratio", "nan", "between 0 and 1", "[0, 1]"),
    ({"lr_scheduler.warmup_steps": -1}, "lr_scheduler.warmup_steps", "-1", "0 for no warmup", ">= 0"),
    ({"lr_scheduler.total_steps": 0}, "lr_scheduler.total_steps", "0", "-1 for training.steps", ">= 1"),
    ({**_LORA, "lora.dropout": 1.0}, "lora.dropout", "1.0", "such as 0.05", "[0, 1)"),
    ({**_LORA, "lora.rank": 0}, "lora.rank", "0", "a rank such as 16", "integer >= 1"),
    ({**_LORA, "lora.alpha": -1.0}, "lora.alpha", "-1.0", "positive value", "finite number > 0"),
]


@pytest.mark.parametrize(("settings", "key", "value", "fix", "problem"), DOMAINS,
                         ids=[f"{d[1]}-{i}" for i, d in enumerate(DOMAINS)])
def test_optimizer_schedule_and_lora_settings_in_their_domain(debug_cfg: JobConfig, settings: dict, key: str,
                                                             value: str, fix: str, problem: str) -> None:
    _raises(validate_job_config, _with(debug_cfg, settings), 1, key=key, value=value, fix=fix, problem=problem,
            check_device=False)


def test_the_domains_admit_their_edges(debug_cfg: JobConfig) -> None:
    """qk_clip_threshold 1 (and 0, off), lr * weight_decay just under 1, alpha / rank at 1/1024 and 1024."""
    for settings in ({"optimizer.qk_clip_threshold": 0.01}, {"optimizer.qk_clip_threshold": 0.0},
                     {"optimizer.weight_decay": 333.0}, {**_LORA, "lora.alpha": 16 / 1024},
                     {**_LORA, "lora.alpha": 16 * 1024.0}, {"optimizer.name": "Adam", "optimizer.weight_decay": 400.0}):
        validate_job_config(_with(debug_cfg, settings), 1, check_device=False)


@pytest.mark.parametrize(("settings", "world_size", "key", "value", "fix", "problem"), RULES,
                         ids=[f"{r[2]}-{i}" for i, r in enumerate(RULES)])
def test_validation_rules(debug_cfg: JobConfig, settings: dict, world_size: int, key: str, value: str,
                          fix: str, problem: str) -> None:
    _raises(validate_job_config, _with(debug_cfg, settings), world_size, key=key, value=value, fix=fix,
            problem=problem)


@pytest.mark.parametrize(("settings", "world_size"), [
    ({"parallelism.data_parallel_replicate_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),  # DDP
    ({"parallelism.data_parallel_replicate_degree": 2, "parallelism.tensor_parallel_degree": 2}, 8),  # HSDP + TP
    ({"parallelism.tensor_parallel_degree": 2, "parallelism.expert_parallel_degree": 4,
      "parallelism.context_parallel_degree": 2}, 8),
    ({"parallelism.pipeline_parallel_degree": 4, "parallelism.pipeline_parallel_microbatch_size": 2}, 4),
    ({"training.global_batch_size": 32, "parallelism.data_parallel_shard_degree": 2}, 2),
    ({"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2"}, 1),
    ({"profiling.enable_step_breakdown": True, "profiling.profile_freq": 5, "training.steps": 5}, 1),
])
def test_valid_layouts_pass(debug_cfg: JobConfig, settings: dict, world_size: int) -> None:
    # As the dry run validates: PP and CP are plannable, though training refuses them yet.
    validate_job_config(_with(debug_cfg, settings), world_size, check_device=False)


@pytest.mark.parametrize(("dim", "shape"), [
    ("ffn_hidden_dim", {"ffn_hidden_dim": 385}),
    ("moe_hidden_dim", {"moe_hidden_dim": 257}),
    ("vocab_size", {"vocab_size": 513}),
])
def test_tp_must_divide_every_sharded_dim(monkeypatch: pytest.MonkeyPatch, debug_cfg: JobConfig, dim: str,
                                          shape: dict) -> None:
    monkeypatch.setitem(FLAVORS, "odd", FLAVORS["tiny"].replace(**shape))
    cfg = _with(debug_cfg, {"model.flavor": "odd", "parallelism.tensor_parallel_degree": 2})
    _raises(validate_job_config, cfg, 2, key="parallelism.tensor_parallel_degree", value="2",
            fix="divides every sharded dim", problem=f"odd flavor's {dim}")


def test_tp_ignores_ffn_dim_without_dense_layers(monkeypatch: pytest.MonkeyPatch, debug_cfg: JobConfig) -> None:
    all_moe: ModelArgs = FLAVORS["tiny"].replace(ffn_hidden_dim=385, interleave_moe_layer_step=1)
    monkeypatch.setitem(FLAVORS, "all_moe", all_moe)
    validate_job_config(_with(debug_cfg, {"model.flavor": "all_moe", "parallelism.tensor_parallel_degree": 2}), 2, check_device=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_features_need_cuda_unless_dry_run(debug_cfg: JobConfig) -> None:
    cfg = _with(debug_cfg, {"training.device": "", "float8.enable": True})
    _raises(validate_job_config, cfg, 1, key="float8.enable", value="true", fix="float8.emulate = true",
            problem="not cpu")
    validate_job_config(cfg, 1, check_device=False)  # the dry-run plans for the target machine
    cuda = _with(debug_cfg, {"training.device": "cuda"})
    _raises(validate_job_config, cuda, 1, key="training.device", value='"cuda"', fix='"cpu"', problem="not available")


# ---- files the run reads ---------------------------------------------------------------------


@pytest.fixture
def load_dirs(tmp_path: Path) -> dict[str, Path]:
    """An empty folder, a DCP folder, a Hugging Face folder, a file, and a path to nothing."""
    dirs = {name: tmp_path / name for name in ("empty", "dcp", "hf")}
    for folder in dirs.values():
        folder.mkdir()
    (dirs["dcp"] / ".metadata").touch()
    (dirs["hf"] / "config.json").touch()
    (dirs["hf"] / "model.safetensors").touch()
    dirs["file"] = tmp_path / "weights.pt"
    dirs["file"].touch()
    dirs["missing"] = tmp_path / "nope"
    return dirs


def _loading(base: JobConfig, tmp_path: Path, path: Path, in_hf: bool) -> JobConfig:
    return _with(base, {"checkpoint.initial_load_path": str(path), "checkpoint.initial_load_in_hf": in_hf,
                        "job.dump_folder": str(tmp_path / "run")})


@pytest.mark.parametrize(("name", "in_hf", "fix", "problem"), [
    ("missing", False, "a DCP checkpoint folder", "No such file or directory"),
    ("missing", True, "a Hugging Face Llama 4 folder", "No such file or directory"),
    ("file", False, "a DCP checkpoint folder", "Not a directory"),
    ("empty", False, "a step-N folder of a run", "no .metadata"),
    ("empty", True, "config.json + *.safetensors", "no *.safetensors"),
    ("hf", False, "set checkpoint.initial_load_in_hf = true", "no .metadata"),
    ("dcp", True, "set checkpoint.initial_load_in_hf = false", "no *.safetensors"),
])
def test_initial_load_path_must_be_the_folder_it_names(debug_cfg: JobConfig, load_dirs: dict[str, Path],
                                                      tmp_path: Path, name: str, in_hf: bool, fix: str,
                                                      problem: str) -> None:
    path = load_dirs[name]
    cfg = _loading(debug_cfg, tmp_path, path, in_hf)
    _raises(validate_job_config, cfg, 1, key="checkpoint.initial_load_path", value=f'"{path}"', fix=fix,
            problem=problem)
    validate_job_config(cfg, 1, check_device=False)  # the dry-run plans for another machine's files


def test_initial_load_path_fix_names_the_runs_family(debug_cfg: JobConfig, load_dirs: dict[str, Path],
                                                     tmp_path: Path) -> None:
    cfg = _with(_loading(debug_cfg, tmp_path, load_dirs["missing"], True), {"model.name": "qwen3"})
    _raises(validate_job_config, cfg, 1, key="checkpoint.initial_load_path", value=f'"{load_dirs["missing"]}"',
            fix="a Hugging Face Qwen3-MoE folder", problem="No such file or directory")


@pytest.mark.parametrize(("name", "in_hf"), [("dcp", False), ("hf", True)])
def test_initial_load_path_of_the_right_kind_passes(debug_cfg: JobConfig, load_dirs: dict[str, Path],
                                                    tmp_path: Path, name: str, in_hf: bool) -> None:
    validate_job_config(_loading(debug_cfg, tmp_path, load_dirs[name], in_hf), 1)


def test_initial_load_path_is_not_checked_when_the_run_resumes(debug_cfg: JobConfig, tmp_path: Path) -> None:
    """A run resuming from its own checkpoint never reads initial_load_path (e.g. a deleted seed)."""
    cfg = _with(_loading(debug_cfg, tmp_path, tmp_path / "deleted_seed", False), {"checkpoint.enable": True})
    torn = tmp_path / "run" / "checkpoint" / "step-4"
    torn.mkdir(parents=True)  # no completion marker: not resumable
    _raises(validate_job_config, cfg, 1, key="checkpoint.initial_load_path", value=f'"{tmp_path / "deleted_seed"}"',
            fix="a DCP checkpoint folder", problem="No such file or directory")
    (torn / ".complete").touch()
    validate_job_config(cfg, 1)
    _raises(validate_job_config, _with(cfg, {"checkpoint.enable": False}), 1, key="checkpoint.initial_load_path",
            value=f'"{tmp_path / "deleted_seed"}"', fix="a DCP checkpoint folder", problem="No such file or directory")


# ---- resolve_degrees -------------------------------------------------------------------------


@pytest.mark.parametrize(("degrees", "world_size", "expected"), [
    ({}, 1, dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1)),
    ({"tensor_parallel_degree": 8}, 64, dict(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=8, ep=1)),
    ({"data_parallel_replicate_degree": 2, "context_parallel_degree": 2, "tensor_parallel_degree": 2,
      "pipeline_parallel_degree": 2, "expert_parallel_degree": 4}, 32,
     dict(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)),
    ({"data_parallel_shard_degree": 4, "tensor_parallel_degree": 2}, 8,
     dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=1)),
])
def test_resolve_degrees(degrees: dict, world_size: int, expected: dict) -> None:
    assert resolve_degrees(Parallelism(**degrees), world_size) == expected


def test_resolve_degrees_errors() -> None:
    _raises(resolve_degrees, Parallelism(), 0, key="WORLD_SIZE", value="0", fix="--world-size")
    _raises(resolve_degrees, Parallelism(data_parallel_shard_degree=3), 4, key="parallelism.data_parallel_shard_degree",
            value="3", fix="-1", problem="dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) = 3 != WORLD_SIZE(4)")
    _raises(resolve_degrees, Parallelism(tensor_parallel_degree=0), 4, key="parallelism.tensor_parallel_degree",
            value="0", fix="set it to 1", problem=">= 1")


# ---- write/reload round trip -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["debug_model", "llama4_16e", "llama4_128e", "qwen3_30b_a3b"])
def test_write_config_round_trip(tmp_path: Path, name: str) -> None:
    cfg = load_job_config(["--config", str(CONFIGS / f"{name}.toml"), "--optimizer.lr", "1.5e-4", *_FLOAT8,
                           "--float8.filter_fqns", "output", "router", "shared", "--job.description", 'say "hi"'])
    path = write_config_toml(cfg, tmp_path / "out" / "config.toml")
    reloaded = load_job_config(["--config", str(path)])
    assert reloaded == cfg
    assert dataclasses.asdict(reloaded) == dataclasses.asdict(cfg)


# ---- the CLI around the config (in process) --------------------------------------------------


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, attr: str, fn) -> None:
    module = types.ModuleType(name)
    setattr(module, attr, fn)
    monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--parallelism.tensor_parallel_degree", "2"], None, 2),  # product of the degrees, dp_shard -1 as 1
    (["--world-size", "4"], None, 4),
    (["--world-size=4"], "8", 4),
    ([], "8", 8),
])
def test_dry_run_world_size(monkeypatch: pytest.MonkeyPatch, args: list[str], env: str | None, expected: int) -> None:
    seen = {}
    _fake_module(monkeypatch, "torchmoe.plan.dry_run", "run_dry_run",
                 lambda cfg, world_size, machine_device_gib: seen.update(cfg=cfg, world_size=world_size))
    monkeypatch.delenv("RANK", raising=False)
    if env is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", env)
    assert cli.main(["train", "--config", DEBUG, "--dry-run", *args]) == 0
    assert seen["world_size"] == expected
    assert seen["cfg"].model.flavor == "tiny"


def test_real_run_refuses_mismatched_world_size(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["train", "--config", DEBUG, "--world-size", "4"]) == 2
    assert "--world-size = 4" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "attr", "args"), [
    ("torchmoe.plan.dry_run", "run_dry_run", ["--dry-run"]),
    ("torchmoe.training.session", "train", []),
])
def test_config_error_inside_the_run_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             module: str, attr: str, args: list[str]) -> None:
    def fail(*_args, **_kwargs):
        raise ConfigError("model.tokenizer_path", "missing/", "no tokenizer.json there", "download it")

    _fake_module(monkeypatch, module, attr, fail)
    sys.modules[module].TrainingDiverged = RuntimeError  # cli imports it with `train`
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["train", "--config", DEBUG, *args]) == 2
    err = capsys.readouterr().err
    assert 'model.tokenizer_path = "missing/": no tokenizer.json there' in err and "fix: download it" in err


def test_tokenizer_must_fit_the_vocabulary_and_have_the_bos_asked_for() -> None:
    from types import SimpleNamespace

    from torchmoe.config.job_config import Model, Training
    from torchmoe.preflight.files import check_tokenizer

    no_bos = SimpleNamespace(vocab_size=512, bos_id=None)
    check_tokenizer(no_bos, 512, Model(), Training())
    with pytest.raises(ConfigError, match=r"the tokenizer has 600 tokens but flavor 'tiny' has vocab_size 512"):
        check_tokenizer(SimpleNamespace(vocab_size=600, bos_id=1), 512, Model(tokenizer_path="tok.json"), Training())
    with pytest.raises(ConfigError, match=r"training.add_bos = true: the tokenizer \(tok.json\) has no BOS token"):
        check_tokenizer(no_bos, 512, Model(tokenizer_path="tok.json"), Training(add_bos=True))
