"""Settings without effect (`config.dependent_keys`): a flag that sets a key the job does not use
is exit 2 naming the flag, what it needs and both fixes; a job file's gets one warning line; a
run's own config.toml none. `--key none` unsets an optional key.

    python -m pytest -q tests/unit/test_dependent_keys.py
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, write_toml
from torchmoe.commands import cli
from torchmoe.config import ConfigError, JobConfig, load_job_config, write_config_toml
from torchmoe.config.dependent_keys import RULES, Needs, unused_rule
from torchmoe.config.files.paths import key_value
from torchmoe.config.unset import optional_keys

# For each rule (by its condition): flags under which it does not hold, and flags under which it
# does. The defaults leave every switch off; these are the rules a default meets or a flag must break.
_OFF_ON: dict[str, tuple[list[str], list[str]]] = {
    "model.tokenizer_path not set (the folder's tokenizer), or checkpoint.initial_load_in_hf = true without "
    "checkpoint.initial_load_path (its weights)": (["--model.tokenizer_path", "tok"], []),
    "model.mtp_layers > 0": ([], ["--model.mtp_layers", "1"]),
    'optimizer.name = "Muon"': ([], ["--optimizer.name", "Muon"]),
    "a weight decay to apply (optimizer.weight_decay > 0; with Muon, optimizer.adamw_weight_decay's)":
        (["--optimizer.weight_decay", "0"], []),
    "a warmup (lr_scheduler.warmup_steps > 0)": (["--lr_scheduler.warmup_steps", "0"], []),
    "a decay (lr_scheduler.decay_ratio other than 0)": (["--lr_scheduler.decay_ratio", "0"], []),
    "a decay that lowers the LR (lr_scheduler.min_lr_factor < 1)": (["--lr_scheduler.min_lr_factor", "1"], []),
    "no training.dataset_mix (a mixture names each source's dataset)":
        (["--training.dataset_mix", "1:local:a.txt"], []),
    'a dataset read from a path (training.dataset other than "python_docs")': ([], ["--training.dataset", "local"]),
    "pipeline parallelism (parallelism.pipeline_parallel_degree > 1)":
        ([], ["--parallelism.pipeline_parallel_degree", "2"]),
    "tensor parallelism (parallelism.tensor_parallel_degree > 1)": ([], ["--parallelism.tensor_parallel_degree", "2"]),
    'activation checkpointing (activation_checkpoint.mode other than "none")':
        ([], ["--activation_checkpoint.mode", "full"]),
    'activation_checkpoint.mode = "selective"': (["--activation_checkpoint.mode", "full"],
                                                ["--activation_checkpoint.mode", "selective"]),
    'activation_checkpoint.selective_ac_option = "op"': (["--activation_checkpoint.mode", "selective",
                                                         "--activation_checkpoint.selective_ac_option", "2"],
                                                        ["--activation_checkpoint.mode", "selective"]),
    "the flight recorder (comm.trace_buf_size > 0)": (["--comm.trace_buf_size", "0"], []),
    'a hub dataset or a saved chat dataset (validation.dataset "hf" or "chat")':
        (["--validation.enable", "true"], ["--validation.enable", "true", "--validation.dataset", "hf"]),
    'fault_tolerance.semi_sync_method = "local_sgd" or "diloco"':
        (["--fault_tolerance.enable", "true"], ["--fault_tolerance.enable", "true",
                                                "--fault_tolerance.semi_sync_method", "local_sgd"]),
    'fault_tolerance.semi_sync_method = "diloco"': (["--fault_tolerance.enable", "true"],
                                                    ["--fault_tolerance.enable", "true",
                                                     "--fault_tolerance.semi_sync_method", "diloco"]),
    "streaming DiLoCo (fault_tolerance.num_fragments > 1)":
        (["--fault_tolerance.enable", "true", "--fault_tolerance.semi_sync_method", "diloco"],
         ["--fault_tolerance.enable", "true", "--fault_tolerance.semi_sync_method", "diloco",
          "--fault_tolerance.num_fragments", "2"]),
}
_CHAT = ["--training.dataset", "chat"]
_ROWS = ["--training.dataset", "local"]


def _off_on(rule: Needs, key: str) -> tuple[list[str], list[str]]:
    """Flags under which `rule` fails (or holds) for `key`, with the other rules of `key` met (and
    those of the switches they set: `checkpoint.export_dtype` needs last_save_model_only, which
    needs checkpoint.enable). Where it fails, no flag it refuses itself comes first."""
    others = _met([pair for other in RULES if other is not rule and key in other.keys for pair in _own(other)[1]])
    off, on = _own(rule)
    kept = [pair for pair in others if pair[0][2:] not in rule.keys]
    return _flat(_met([*kept, *off])), _flat(_met([*others, *on]))


def _met(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`pairs` (flag, value) after those that the rules of the keys they set need."""
    keys = {flag[2:] for flag, _ in pairs}
    needed = [pair for rule in RULES if keys & set(rule.keys) for pair in _own(rule)[1] if pair not in pairs]
    return [*_met(needed), *pairs] if needed else pairs


def _flat(pairs: list[tuple[str, str]]) -> list[str]:
    return [token for pair in pairs for token in pair]


def _own(rule: Needs) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(flag, value) pairs under which `rule` alone fails, and under which it holds."""
    if rule.when in _OFF_ON:
        off, on = _OFF_ON[rule.when]
    elif rule.when.startswith("chat data"):
        off, on = [], _CHAT
    elif rule.when.startswith("a hub dataset"):
        off, on = [], ["--training.dataset", "hf"]
    elif rule.when.startswith("rows with fields") or rule.when.startswith("folders or globs"):
        off, on = ["--training.dataset", "tokens"], _ROWS
    elif rule.when == "checkpoint.enable = true or checkpoint.last_save_in_hf = true":
        off, on = [], ["--checkpoint.last_save_in_hf", "true"]
    elif rule.when == "profiling.enable_profiling = true or profiling.enable_step_breakdown = true":
        off, on = [], ["--profiling.enable_step_breakdown", "true"]
    else:  # a boolean switch
        off, on = [f"--{rule.reads[0]}", "false"], [f"--{rule.reads[0]}", "true"]
    return list(zip(off[::2], off[1::2])), list(zip(on[::2], on[1::2]))


def _flag_value(key: str) -> list[str]:
    """A value of `key` as a flag: its default (a flag set to it is still set), or one item."""
    value = key_value(JobConfig(), key)
    typ = typing.get_type_hints(type(getattr(JobConfig(), key.partition(".")[0])))[key.partition(".")[2]]
    if typ is bool:
        return ["true" if value else "false"]
    if typ == list[list[str]]:
        return ["layers.0,output"]
    if typ == list[float]:
        return ["1,2,3"]
    if isinstance(value, list) or value == "":
        return ["x"]
    return [str(value)]


_CASES = [(rule, key) for rule in RULES for key in rule.keys]


@pytest.mark.parametrize(("rule", "key"), _CASES, ids=[f"{key}-{i}" for i, (_, key) in enumerate(_CASES)])
def test_every_dependent_flag_is_refused_without_what_it_needs_and_accepted_with_it(rule: Needs, key: str) -> None:
    """Every member of the table: refused where its condition fails (naming the flag, the
    condition, the job's values of what it reads, and a fix that drops the flag), accepted where
    it holds."""
    off, on = _off_on(rule, key)
    flag = [f"--{key}", *_flag_value(key)]
    with pytest.raises(ConfigError) as caught:
        load_job_config([*off, *flag])
    err = caught.value
    assert err.key == f"--{key}" and err.problem.startswith(f"has no effect: it only matters with {rule.when}, "), err
    assert err.fix.endswith(f"or drop --{key}") or err.fix.startswith(f"drop --{key}, or give the job "), err
    cfg = load_job_config([*on, *flag])
    assert unused_rule(cfg, key) is None


def test_every_rule_is_covered_and_the_table_names_real_keys() -> None:
    fields = {f"{s.name}.{f.name}" for s in dataclasses.fields(JobConfig)
              for f in dataclasses.fields(s.default_factory())}
    assert {k for rule in RULES for k in (*rule.keys, *rule.reads, *(s for s, _ in rule.turn_on))} <= fields
    for rule in RULES:  # each way out the message offers does make the rule hold
        if rule.turn_on:
            pairs = [(f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)) for k, v in rule.turn_on]
            cfg = load_job_config(_flat(_met(pairs)))
            assert rule.holds(cfg), rule.when
    # the sections' own switches depend on nothing; every section with one has its keys under it
    dependent = {k for r in RULES for k in r.keys}
    switches = {k for k in fields if k.endswith(".enable")}
    assert not switches & dependent
    assert {k.partition(".")[0] for k in switches} == {"checkpoint", "compile", "float8", "lora", "validation",
                                                       "fault_tolerance"}
    for switch in switches - {"checkpoint.enable"}:  # checkpoint's paths also serve the HF export: their own rule
        section = switch.partition(".")[0]
        assert {k for k in fields if k.startswith(f"{section}.")} - {switch} - dependent == set() or \
            section == "float8", section  # float8.routed_experts is a switch of its own


def test_the_issue_s_lora_flags_without_lora_enable_are_one_error_and_write_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They trained the whole model and wrote a merged full checkpoint, without a word."""
    for command in (["train"], ["train", "--dry-run"], ["plan", "--gpus", "8"]):
        status = cli.main([*command, "--config", DEBUG_CONFIG, "--lora.rank", "4", "--lora.targets", "attention",
                           "--lora.export", "adapter", "--job.dump_folder", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
        assert ("error: --lora.rank = 4: has no effect: it only matters with lora.enable = true, and this job has "
                "lora.enable = false\n  fix: add --lora.enable true, or drop --lora.rank") in err, err
        assert not (tmp_path / "run").exists()


def test_a_torchtitan_flag_is_named_as_typed() -> None:
    with pytest.raises(ConfigError) as caught:
        load_job_config(["--quantize.linear.float8.recipe_name", "rowwise"])
    assert str(caught.value) == (
        '--quantize.linear.float8.recipe_name = "rowwise": has no effect: it only matters with float8.enable = true, '
        "and this job has float8.enable = false\n  fix: add --float8.enable true, or drop "
        "--quantize.linear.float8.recipe_name")


def test_eval_reads_validation_whatever_validation_enable_says() -> None:
    with pytest.raises(ConfigError, match="validation.enable = true"):
        load_job_config(["--validation.dataset_path", "data/val"])
    cfg = load_job_config(["--validation.dataset_path", "data/val"], runs_with={"validation.enable": True})
    assert cfg.validation.dataset_path == "data/val" and not cfg.validation.enable  # judged, not changed


def test_the_eval_command_takes_validation_flags_and_generate_judges_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torchmoe eval` reads [validation] (its flags pass, and the next fault is the missing
    weights); `generate` does not (the flag is refused)."""
    flags = ["--config", DEBUG_CONFIG, "--validation.dataset_path", "data/val", "--job.dump_folder", str(tmp_path)]
    assert cli.main(["eval", *flags, "--checkpoint", str(tmp_path / "gone")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--checkpoint" in err and "has no effect" not in err, err
    assert cli.main(["generate", *flags, "--checkpoint", str(tmp_path / "gone"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "error: --validation.dataset_path = \"data/val\": has no effect: it only matters with validation.enable = " \
           "true" in err, err


def test_a_job_file_s_idle_keys_warn_once_each_and_run(tmp_path: Path) -> None:
    """One line per key not at its default; a key at its default asks for nothing; a switch a
    flag set silences the file's keys under it; a flag beside the file's key is refused."""
    path = write_toml(tmp_path, "[lora]\nrank = 4\nalpha = 32.0\ntargets = [\"attention\"]\n"
                                "[checkpoint]\ninterval = 7\nfolder = \"checkpoint\"\n"
                                "[optimizer]\nmomentum = 0.9\n")
    notes: list[str] = []
    cfg = load_job_config(["--config", path], notes=notes)
    assert cfg.lora.rank == 4 and not cfg.lora.enable
    assert notes == [
        "lora.rank = 4 in the job file has no effect: it only matters with lora.enable = true, and the job has "
        "lora.enable = false (set lora.enable = true, or remove lora.rank)",
        'lora.targets = ["attention"] in the job file has no effect: it only matters with lora.enable = true, and the '
        "job has lora.enable = false (set lora.enable = true, or remove lora.targets)",
        "checkpoint.interval = 7 in the job file has no effect: it only matters with checkpoint.enable = true, and the "
        "job has checkpoint.enable = false (set checkpoint.enable = true, or remove checkpoint.interval)",
        'optimizer.momentum = 0.9 in the job file has no effect: it only matters with optimizer.name = "Muon", and the '
        'job has optimizer.name = "AdamW" (set optimizer.name = "Muon", or remove optimizer.momentum)',
    ]
    notes = []
    load_job_config(["--config", path, "--lora.enable", "false", "--checkpoint.enable", "false",
                     "--optimizer.name", "AdamW"], notes=notes)
    assert notes == []
    with pytest.raises(ConfigError, match="^--checkpoint.interval = 9: has no effect"):
        load_job_config(["--config", path, "--checkpoint.interval", "9"])


def test_a_run_s_own_config_toml_warns_of_nothing_it_wrote(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """config.toml holds every key (a job file's idle ones included): read back by eval, generate
    or a resume it says nothing; a flag beside it is still judged."""
    path = write_toml(tmp_path, "[lora]\nrank = 4\n[checkpoint]\ninterval = 7\n[profiling]\nprofile_freq = 3\n")
    notes: list[str] = []
    cfg = load_job_config(["--config", path], notes=notes)
    assert len(notes) == 3
    written = write_config_toml(cfg, tmp_path / "run" / "config.toml")
    notes = []
    assert load_job_config(["--config", str(written)], notes=notes) == cfg and notes == []
    with pytest.raises(ConfigError, match="^--lora.alpha = 8.0: has no effect"):
        load_job_config(["--config", str(written), "--lora.alpha", "8"])
    # The same file under another first line is a job file again.
    (tmp_path / "copy.toml").write_text("# my job\n" + written.read_text())
    load_job_config(["--config", str(tmp_path / "copy.toml")], notes=notes)
    assert len(notes) == 3


def test_none_unsets_an_optional_key_as_if_the_file_left_it_out(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[training]\nglobal_batch_size = 64\n[checkpoint]\nenable = true\n'
                                'exclude_from_loading = ["optimizer"]\n[model]\nname = "qwen3"\nflavor = "30B-A3B"\n'
                                '[activation_checkpoint]\nmode = "full"\n')
    set_keys: set[str] = set()
    cfg = load_job_config(["--config", path, "--training.global_batch_size", "none",
                           "--checkpoint.exclude_from_loading", "none", "--model.flavor", "none",
                           "--activation_checkpoint.mode", "none"], set_keys=set_keys)
    assert (cfg.training.global_batch_size, cfg.checkpoint.exclude_from_loading) == (-1, [])
    assert (cfg.model.name, cfg.model.flavor, cfg.activation_checkpoint.mode) == ("qwen3", "tiny", "none")
    assert {"training.global_batch_size", "checkpoint.exclude_from_loading", "model.flavor"}.isdisjoint(set_keys)
    assert {"model.name", "activation_checkpoint.mode", "checkpoint.enable"} <= set_keys  # mode's own "none"
    # Which keys take it: "" / -1 / [] defaults, the model's name and flavor; never a key with a value "none".
    optional = optional_keys()
    assert optional["model.flavor"] == "tiny" and optional["lora.adapter"] == "" and "activation_checkpoint.mode" \
        not in optional and optional["lr_scheduler.total_steps"] == -1 and "training.steps" not in optional
    with pytest.raises(ConfigError, match="expected an integer"):  # not optional: "none" is no value of it
        load_job_config(["--training.steps", "none"])
