"""torchtitan v0.2.2 job files as they are: every key of its JobConfig accepted, mapped onto
torchmoe's where one means the same, else accepted with one warning line naming why it does
nothing here; values torchmoe cannot honour are one error.

    python -m pytest -q tests/unit/test_torchtitan_config.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_toml
from torchmoe.commands import cli
from torchmoe.config import ConfigError, JobConfig, load_job_config
from torchmoe.config.loader import tomllib
from torchmoe.config.torchtitan import TORCHTITAN_KEYS

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "torchtitan"
FILES = ("debug_model.toml", "llama4_17bx16e.toml", "llama4_17bx128e.toml")

# Every leaf key of torchtitan v0.2.2's JobConfig (`torchtitan/config/job_config.py` of the
# released wheel), written out here rather than read from torchmoe's table.
TORCHTITAN_V022_KEYS = """
job.config_file job.dump_folder job.description job.print_config job.save_config_file job.custom_config_module
profiling.enable_profiling profiling.save_traces_folder profiling.profile_freq profiling.profiler_active
profiling.profiler_warmup profiling.enable_memory_snapshot profiling.save_memory_snapshot_folder
metrics.log_freq metrics.enable_tensorboard metrics.disable_color_printing metrics.save_tb_folder
metrics.save_for_all_ranks metrics.enable_wandb
model.name model.flavor model.hf_assets_path model.tokenizer_path model.converters model.print_after_conversion
optimizer.name optimizer.lr optimizer.beta1 optimizer.beta2 optimizer.eps optimizer.weight_decay
optimizer.implementation optimizer.early_step_in_backward
lr_scheduler.warmup_steps lr_scheduler.total_steps lr_scheduler.decay_ratio lr_scheduler.decay_type
lr_scheduler.min_lr_factor
training.dataset training.dataset_path training.local_batch_size training.global_batch_size training.seq_len
training.max_norm training.steps training.enable_cpu_offload training.dtype training.mixed_precision_param
training.mixed_precision_reduce training.gc_freq training.gc_debug training.dataloader.num_workers
training.dataloader.persistent_workers training.dataloader.pin_memory training.dataloader.prefetch_factor
parallelism.data_parallel_replicate_degree parallelism.data_parallel_shard_degree
parallelism.fsdp_reshard_after_forward parallelism.tensor_parallel_degree parallelism.disable_loss_parallel
parallelism.enable_async_tensor_parallel parallelism.pipeline_parallel_degree
parallelism.module_fqns_per_model_part parallelism.pipeline_parallel_first_stage_less_layers
parallelism.pipeline_parallel_last_stage_less_layers parallelism.pipeline_parallel_layers_per_stage
parallelism.pipeline_parallel_schedule parallelism.pipeline_parallel_schedule_csv
parallelism.pipeline_parallel_microbatch_size parallelism.pipeline_parallel_expert_parallel_overlap
parallelism.context_parallel_degree parallelism.context_parallel_load_balancer
parallelism.context_parallel_rotate_method parallelism.expert_parallel_degree
parallelism.expert_tensor_parallel_degree parallelism.expert_parallel_comm_backend
checkpoint.enable checkpoint.enable_ft_dataloader_checkpoints checkpoint.folder checkpoint.interval
checkpoint.initial_load_path checkpoint.initial_load_model_only checkpoint.initial_load_in_hf
checkpoint.initial_load_in_hf_quantized checkpoint.last_save_model_only checkpoint.last_save_in_hf
checkpoint.export_dtype checkpoint.async_mode checkpoint.keep_latest_k checkpoint.load_step
checkpoint.exclude_from_loading checkpoint.enable_first_step_checkpoint checkpoint.create_seed_checkpoint
checkpoint.load_only
activation_checkpoint.mode activation_checkpoint.selective_ac_option
activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns activation_checkpoint.early_stop
activation_checkpoint.memory_budget activation_checkpoint.visualize_memory_budget_pareto
activation_checkpoint.preserve_rng_state activation_checkpoint.determinism_check activation_checkpoint.debug
compile.enable compile.components compile.backend
quantize.linear.float8.enable_fsdp_float8_all_gather quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
quantize.linear.float8.recipe_name quantize.linear.float8.filter_fqns quantize.linear.float8.emulate
quantize.linear.mx.mxfp8_dim1_cast_kernel_choice quantize.linear.mx.recipe_name quantize.linear.mx.filter_fqns
quantize.grouped_mm.float8.fqns quantize.grouped_mm.mx.recipe_name quantize.grouped_mm.mx.fqns
comm.init_timeout_seconds comm.train_timeout_seconds comm.trace_buf_size comm.save_traces_folder
comm.save_traces_file_prefix comm.mode
memory_estimation.enable memory_estimation.disable_fake_mode
fault_tolerance.enable fault_tolerance.process_group fault_tolerance.process_group_timeout_ms
fault_tolerance.replica_id fault_tolerance.group_size fault_tolerance.min_replica_size
fault_tolerance.semi_sync_method
experimental.custom_import experimental.custom_args_module
validation.enable validation.dataset validation.dataset_path validation.local_batch_size validation.seq_len
validation.freq validation.steps validation.dataloader.num_workers validation.dataloader.persistent_workers
validation.dataloader.pin_memory validation.dataloader.prefetch_factor
debug.seed debug.deterministic debug.deterministic_warn_only debug.moe_force_load_balance
""".split()
# torchtitan's model arguments that its flavors set and torchmoe takes as job keys too.
TORCHTITAN_MODEL_ARGS = ["model.attn_mask_type"]


def _leaves(table: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        keys |= _leaves(value, f"{dotted}.") if isinstance(value, dict) else {dotted}
    return keys


def _torchmoe_keys() -> set[str]:
    return _leaves({s: dict.fromkeys(vars(getattr(JobConfig(), s))) for s in vars(JobConfig())})


def test_the_key_list_is_torchtitans_and_every_key_has_a_meaning_here() -> None:
    assert len(TORCHTITAN_V022_KEYS) == len(set(TORCHTITAN_V022_KEYS)) == 149
    shared = _torchmoe_keys()
    unknown = [k for k in TORCHTITAN_V022_KEYS if k not in shared and k not in TORCHTITAN_KEYS]
    assert unknown == []
    # The table holds torchtitan keys only, none that torchmoe already has under the same name.
    assert set(TORCHTITAN_KEYS) <= set(TORCHTITAN_V022_KEYS + TORCHTITAN_MODEL_ARGS)
    assert not set(TORCHTITAN_KEYS) & shared


# The settings of the three files that tune a feature the file leaves off: one warning line each
# (`config.dependent_keys`); the files run as they are.
_IDLE = {
    "debug_model.toml": ["quantize.linear.float8.filter_fqns", "quantize.grouped_mm.float8.fqns",
                         "profiling.save_traces_folder", "checkpoint.interval", "checkpoint.keep_latest_k",
                         "fault_tolerance.semi_sync_method", "validation.dataset_path"],
    "llama4_17bx16e.toml": ["profiling.save_traces_folder", "profiling.profile_freq"],
    "llama4_17bx128e.toml": ["checkpoint.last_save_model_only"],
}


def test_the_three_files_hold_every_key_and_warn_only_of_settings_they_leave_off() -> None:
    held = set()
    for name in FILES:
        held |= _leaves(tomllib.loads((ASSETS / name).read_text()))
        notes: list[str] = []
        load_job_config(["--config", str(ASSETS / name)], notes=notes)
        # torchtitan's defaults, or values torchmoe honours; but the idle settings, one line each
        assert [note.partition(" = ")[0] for note in notes] == _IDLE[name], (name, notes)
        assert all(" in the job file has no effect: it only matters with " in note for note in notes), notes
    assert held == set(TORCHTITAN_V022_KEYS)
    notes = []
    load_job_config(["--config", str(ASSETS / "debug_model.toml"), "--checkpoint.enable", "false"], notes=notes)
    assert "checkpoint.interval" not in " ".join(notes)  # the switch a flag set: the file's settings stay quiet


def test_mapped_keys_set_torchmoes() -> None:
    cfg = load_job_config(["--config", str(ASSETS / "llama4_17bx16e.toml")])
    assert cfg.float8.enable and cfg.float8.recipe_name == "tensorwise"  # model.converters, [quantize.linear.float8]
    assert cfg.float8.filter_fqns == ["output", "router.gate"] and cfg.float8.enable_fsdp_float8_all_gather
    assert cfg.parallelism.expert_tensor_parallel_degree == cfg.parallelism.tensor_parallel_degree == 8
    assert (cfg.checkpoint.last_save_model_only, cfg.checkpoint.export_dtype) == (True, "bfloat16")
    # hf_assets_path: the tokenizer, and with initial_load_in_hf the weights (set explicitly here too)
    assert cfg.model.tokenizer_path == cfg.checkpoint.initial_load_path == "./assets/hf/Llama-4-Scout-17B-16E"
    debug = load_job_config(["--config", str(ASSETS / "debug_model.toml")])
    assert (debug.training.seed, debug.training.deterministic) == (42, False)  # [debug]
    assert not debug.model.moe_force_load_balance
    # torchmoe's own keys, at the values torchtitan's file lists (its defaults)
    ac = debug.activation_checkpoint
    assert (ac.per_op_sac_force_recompute_mm_shapes_by_fqns, ac.early_stop) == (["moe.router.gate"], False)
    forced = load_job_config(["--config", str(ASSETS / "debug_model.toml"), "--debug.moe_force_load_balance"])
    assert forced.model.moe_force_load_balance
    assert (debug.training.dataset, debug.lr_scheduler.total_steps, debug.training.gc_freq) == ("c4_test", 10, 50)
    assert not debug.float8.enable  # converters = []


def test_training_dtype_is_torchmoes_own(tmp_path: Path) -> None:
    """torchtitan's pure bf16 key is torchmoe's (same name, same meaning): no mapping, no warning."""
    notes: list[str] = []
    cfg = load_job_config(["--config", write_toml(tmp_path, '[training]\ndtype = "bfloat16"\n')], notes=notes)
    assert cfg.training.dtype == "bfloat16" and cfg.training.mixed_precision_param == "bfloat16" and notes == []


def test_hf_assets_path_fills_what_is_not_given(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[model]\nhf_assets_path = "hf/scout"\n[checkpoint]\ninitial_load_in_hf = true\n')
    cfg = load_job_config(["--config", path])
    assert (cfg.model.tokenizer_path, cfg.checkpoint.initial_load_path) == ("hf/scout", "hf/scout")
    cfg = load_job_config(["--config", path, "--model.tokenizer_path", "tok.json",
                           "--checkpoint.initial_load_path", "ckpt"])
    assert (cfg.model.tokenizer_path, cfg.checkpoint.initial_load_path) == ("tok.json", "ckpt")
    cfg = load_job_config(["--model.hf_assets_path", "hf/scout"])  # no initial_load_in_hf: weights are not read
    assert (cfg.model.tokenizer_path, cfg.checkpoint.initial_load_path) == ("hf/scout", "")


@pytest.mark.parametrize("key", ["model.hf_assets_path", "model.tokenizer_path", "checkpoint.initial_load_path",
                                 "training.dataset_path", "validation.dataset_path"])
def test_a_read_path_from_a_file_is_unset_by_the_flag_none(tmp_path: Path, key: str) -> None:
    """A torchtitan preset's folder (a checkout's ./tests/assets/tokenizer) cleared without editing
    the file: `--KEY none` is the TOML's "" (unset), and what it filled in stays unfilled."""
    section, leaf = key.split(".")
    reads = {"training": 'dataset = "local"\n', "validation": "enable = true\n"}.get(section, "")  # what reads the path
    path = write_toml(tmp_path, f'[{section}]\n{reads}{leaf} = "./tests/assets/tokenizer"\n')
    cfg = load_job_config(["--config", path, f"--{key}", "none"])
    assert getattr(getattr(cfg, section), leaf) == ""
    if key == "model.hf_assets_path":
        assert cfg.model.tokenizer_path == ""  # not filled from the folder that was unset
    assert getattr(getattr(load_job_config(["--config", path, f"--{key}", "./none"]), section), leaf) == "./none"


def test_an_empty_read_path_flag_names_the_word_that_unsets_it(capsys, tmp_path: Path) -> None:
    status = cli.main(["train", "--model.hf_assets_path", "", "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert 'model.hf_assets_path = "": an empty path (an unset shell variable?)' in err
    assert "fix: pass the path, or `--model.hf_assets_path none` to unset it (what \"\" means in a TOML file)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("text", "problem"), [
    ("[training]\nseed = 1\n[debug]\nseed = 2\n",
     "training.seed = 1: contradicts debug.seed = 2 in the same file, which sets training.seed to 2"),
    # torchtitan's mask type and torchmoe's key: document masking was silently off before.
    ('[model]\nattn_mask_type = "block_causal"\n[training]\ndocument_masking = false\n',
     'training.document_masking = false: contradicts model.attn_mask_type = "block_causal" in the same file, '
     "which sets training.document_masking to true"),
    # torchtitan converts only what converters lists: float8 was on silently beside converters = [].
    ('[model]\nconverters = []\n[float8]\nenable = true\n',
     "float8.enable = true: contradicts model.converters = [] in the same file, which sets float8.enable to false"),
    ('[model]\nconverters = ["quantize.linear.float8"]\n[float8]\nrouted_experts = true\n',
     'float8.routed_experts = true: contradicts model.converters = ["quantize.linear.float8"] in the same file'),
])
def test_a_torchmoe_key_contradicting_a_mapped_one_in_one_file_is_refused(tmp_path: Path, text: str,
                                                                           problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_job_config(["--config", write_toml(tmp_path, text)])
    assert str(err.value).startswith(problem) and "fix: keep one of the two keys" in str(err.value), err.value


@pytest.mark.parametrize(("flags", "problem"), [
    # The later of the two flags won: document masking off (or on) by the order of the flags.
    (["--model.attn_mask_type", "block_causal", "--training.document_masking", "false"],
     '--training.document_masking = "false": contradicts --model.attn_mask_type on the same command line, which sets '
     "training.document_masking to true (this flag sets it to false)"),
    (["--training.document_masking", "false", "--model.attn_mask_type=block_causal"],
     '--model.attn_mask_type = "block_causal": contradicts --training.document_masking on the same command line'),
    (["--debug.seed", "7", "--training.seed", "8"], "contradicts --debug.seed on the same command line, which sets "
                                                    "training.seed to 7"),
    (["--model.converters", "quantize.linear.float8", "--float8.enable", "false"],
     "contradicts --model.converters on the same command line, which sets float8.enable to true"),
])
def test_two_flags_for_one_key_that_disagree_are_refused(flags: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_job_config(flags)
    assert problem in str(err.value) and "fix: pass one of the two flags" in str(err.value), err.value


def test_a_flag_wins_over_a_mapped_key_and_agreeing_keys_are_one(tmp_path: Path) -> None:
    cfg = load_job_config(["--config", write_toml(tmp_path, "[training]\nseed = 2\n[debug]\nseed = 2\n")])
    assert cfg.training.seed == 2
    cfg = load_job_config(["--config", write_toml(tmp_path, "[debug]\nseed = 2\n"), "--training.seed", "3"])
    assert cfg.training.seed == 3
    cfg = load_job_config(["--config", write_toml(tmp_path, '[model]\nattn_mask_type = "block_causal"\n'),
                           "--training.document_masking", "false"])
    assert cfg.training.document_masking is False
    # Two flags that agree, and one flag given twice (the last counts, as for any flag), are no clash.
    assert load_job_config(["--debug.seed", "4", "--training.seed", "4"]).training.seed == 4
    assert load_job_config(["--training.seed", "4", "--training.seed", "5"]).training.seed == 5


@pytest.mark.parametrize(("text", "warning"), [
    ("[parallelism]\ncontext_parallel_rotate_method = \"alltoall\"\n", 'context_parallel_rotate_method = "alltoall" '
     "(a torchtitan key) has no effect in torchmoe: torchmoe's context parallelism has its own"),
    ("[training]\ngc_debug = true\n", "training.gc_debug = true (a torchtitan key) has no effect in torchmoe: no debug "
     "mode for the garbage collector"),
    ("[training.dataloader]\nnum_workers = 4\nprefetch_factor = 8\n", "training.dataloader.num_workers = 4"),
    ("[validation.dataloader]\nnum_workers = 2\npin_memory = false\n", "validation.dataloader.num_workers = 2 (a "
     "torchtitan key) has no effect in torchmoe: torchmoe packs batches in the training process"),
    ("[job]\ncustom_config_module = \"my.ext\"\n", "has no plugin modules"),
])
def test_a_key_without_effect_warns_once(tmp_path: Path, text: str, warning: str) -> None:
    notes: list[str] = []
    load_job_config(["--config", write_toml(tmp_path, text)], notes=notes)
    assert len(notes) == 1 and warning in notes[0], notes  # keys that only tune a switched-off feature are quiet


def test_warnings_reach_the_console_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_toml(tmp_path, "[model]\nflavor = \"bench256\"\n[memory_estimation]\nenable = true\n")
    assert cli.main(["train", "--config", path, "--dry-run", "--world-size", "1", "--job.dump_folder",
                     str(tmp_path / "out"), "--comm.mode", "local_tensor"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 2, err
    assert "memory_estimation.enable = true (a torchtitan key) has no effect in torchmoe" in err
    assert 'comm.mode = "local_tensor" (a torchtitan key) has no effect in torchmoe: to plan a job without GPUs, ' \
           "run torchmoe train --dry-run" in err


def test_torchtitan_flags_on_the_command_line(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 7\n")
    cfg = load_job_config(["--job.config_file", path, "--debug.seed", "5", "--quantize.linear.float8.filter_fqns",
                           "output,router.gate", "--training.enable_cpu_offload", "--model.converters", "float8"])
    assert cfg.training.steps == 7 and cfg.training.seed == 5  # --job.config_file is --config
    assert cfg.float8.filter_fqns == ["output", "router.gate"] and cfg.float8.enable
    assert cfg.parallelism.fsdp_cpu_offload
    assert load_job_config(["--compile.enable", "true", "--compile.components", "model", "loss"]
                           ).compile.components == ["model", "loss"]


def test_float8_routed_experts_and_emulation_map_to_float8() -> None:
    """torchtitan's grouped-GEMM converter converts the MoE modules its fqns name: float8.routed_experts
    and float8.moe_fqns. fqns without the converter converts nothing (torchtitan's own debug
    model file lists fqns with converters = []). quantize.linear.float8.emulate is float8.emulate."""
    both = load_job_config(["--model.converters", "quantize.linear.float8", "quantize.grouped_mm.float8",
                            "--quantize.grouped_mm.float8.fqns", "experts", "--quantize.linear.float8.emulate"])
    assert both.float8.enable and both.float8.routed_experts and both.float8.emulate
    assert both.float8.moe_fqns == ["experts"]
    experts_only = load_job_config(["--model.converters", "quantize.grouped_mm.float8"])
    assert not experts_only.float8.enable and experts_only.float8.routed_experts
    debug = load_job_config(["--config", str(ASSETS / "debug_model.toml")])
    assert debug.float8.moe_fqns == ["experts"] and not debug.float8.routed_experts


@pytest.mark.parametrize(("text", "key", "problem", "fix"), [
    ('[model]\nconverters = ["quantize.linear.mx"]\n', "model.converters", "MX (microscaling) formats are not "
     "supported", '"quantize.linear.float8"'),
    ('[model]\nconverters = ["int4"]\n', "model.converters", 'unknown converter "int4"', "quantize.linear.float8"),
    ("[debug]\nsed = 1\n", "debug.sed", "unknown key in [debug]", "did you mean debug.seed?"),
    ("[quantize.linear.float8]\nrecipe = \"rowwise\"\n", "quantize.linear.float8.recipe", "unknown key",
     "did you mean quantize.linear.float8.recipe_name?"),
    ("[validation]\nfreq = \"10\"\n", "validation.freq", "expected an integer", "freq = 10"),
    ("[parallelism]\nexpert_tensor_parallel_degree = 2\ntensor_parallel_degree = 2\nexpert_parallel_degree = 2\n",
     "parallelism.expert_tensor_parallel_degree", "(2-D) are not supported", "expert_tensor_parallel_degree = 1"),
    ('[checkpoint]\nexclude_from_loading = ["train_state"]\n', "checkpoint.exclude_from_loading",
     "the step count always continues", "initial_load_path"),
])
def test_what_torchmoe_cannot_honour_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                  key: str, problem: str, fix: str) -> None:
    path = write_toml(tmp_path, text)
    assert cli.main(["train", "--config", path, "--dry-run", "--world-size", "4", "--job.dump_folder",
                     str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{key} = " in err and problem in err and fix in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("text", "key", "problem", "fix"), [
    ("[optimizer]\nearly_step_in_backward = true\n", "optimizer.early_step_in_backward",
     "without clipping by the global gradient norm", "set it to false"),
    ("[checkpoint]\ninitial_load_model_only = false\n", "checkpoint.initial_load_model_only",
     "restores the whole training state", "copy its step-N folder into <job.dump_folder>/<checkpoint.folder>/"),
    ("[checkpoint]\ninitial_load_in_hf_quantized = true\n", "checkpoint.initial_load_in_hf_quantized",
     "dequantizes quantized Hugging Face weights", "initial_load_in_hf_quantized = false"),
    ("[parallelism]\npipeline_parallel_first_stage_less_layers = 2\n",
     "parallelism.pipeline_parallel_first_stage_less_layers", "gives the first pipeline stage blocks for that many "
     "layers fewer", "module_fqns_per_model_part"),
    ("[parallelism]\npipeline_parallel_last_stage_less_layers = 0\n",
     "parallelism.pipeline_parallel_last_stage_less_layers", "gives the last pipeline stage", "leave this key at 1"),
    ('[parallelism]\npipeline_parallel_schedule_csv = "zb.csv"\n', "parallelism.pipeline_parallel_schedule_csv",
     "runs the schedule that file lists", "parallelism.pipeline_parallel_schedule"),
])
def test_what_changes_the_numbers_or_memory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       text: str, key: str, problem: str, fix: str) -> None:
    """torchtitan keys whose other values change what is trained and that torchmoe does not
    implement: one error, in the file or on the command line."""
    assert cli.main(["train", "--config", write_toml(tmp_path, text), "--dry-run", "--job.dump_folder",
                     str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{key} = " in err and problem in err and fix in err, err
    assert "(a torchtitan key torchmoe does not implement)" in err and "Traceback" not in err
    leaf, _, value = text.splitlines()[1].partition(" = ")
    assert cli.main(["train", f"--{key}", value.strip('"'), "--dry-run", "--job.dump_folder",
                     str(tmp_path / "out")]) == 2
    assert f"{key} = " in capsys.readouterr().err


def test_per_op_sac_names_must_name_a_block_linear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--activation_checkpoint.mode", "selective", "--dry-run", "--job.dump_folder",
                     str(tmp_path), "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
                     "router.gates"]) == 2
    err = capsys.readouterr().err
    assert '"router.gates" is in the name of no nn.Linear of a transformer block' in err
    assert "moe.router.gate" in err  # the fix lists the block's linears


@pytest.mark.parametrize("family", ["llama3", "flux"])
def test_another_model_family_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    # torchtitan files of those families hold the same sections; only the family is not trained here.
    text = f'[model]\nname = "{family}"\nflavor = "debugmodel"\nhf_assets_path = "./tests/assets/tokenizer"\n' \
           '[training]\ndataset = "c4_test"\n[debug]\nseed = 1\n'
    assert cli.main(["train", "--config", write_toml(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f'model.name = "{family}"' in err, err
    assert 'torchmoe trains the mixture-of-experts families "llama4", "qwen3", "deepseek_v3", "gpt_oss"' in err


def test_print_config_prints_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--job.print_config", "--dry-run", "--world-size", "1", "--debug.seed", "9",
                     "--job.dump_folder", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    text = out.split("# the resolved job config\n")[1].split("\n\n[validation]")[0]
    assert "[training]" in text and "seed = 9" in text and "print_config = true" in text


def test_compile_components_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from tests.helpers import empty_tiny_model
    from torchmoe.config.job_config import Compile
    from torchmoe.distributed.compile import apply_compile

    seen = []
    monkeypatch.setattr(torch, "compile", lambda block, **kwargs: seen.append(kwargs) or block)
    apply_compile(empty_tiny_model(), Compile(enable=True, components=["loss"]), fullgraph=True)
    assert seen == []  # no "model": the blocks stay eager
    model = empty_tiny_model()
    apply_compile(model, Compile(enable=True, backend="aot_eager"), fullgraph=True)
    assert [k["backend"] for k in seen] == ["aot_eager"] * len(model.layers)
