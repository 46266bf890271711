"""The GPU benchmark script, smoke-run on CPU: the stack it builds and the numbers it reports."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch

from tests.helpers import REPO
from torchmoe.arch.registry import FLAVORS
from torchmoe.config.job_config import Optimizer as OptimizerConfig
from torchmoe.plan.layout import param_specs
from torchmoe.plan.muon import optimizer_state_elements
from torchmoe.plan.parallel_dims import ParallelDims


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scout_stack_is_scouts_layers_with_one_nope_layer_last() -> None:
    args = _script("bench_scout_stack").stack_args("scout", 2, 32768)
    assert args.rope_layers == [True, False] and all(args.is_moe_layer(i) for i in range(2))
    assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.num_experts) == (5120, 40, 8, 128, 16)
    assert args.param_counts()["total"] == 4_739_752_960


def test_scout_stack_bench_reports_its_flops() -> None:
    bench = _script("bench_scout_stack")
    args = bench.stack_args("tiny", 2, 512)
    result = bench.bench(args, device=torch.device("cpu"), dtype="bfloat16", compiled=False, batch=1, seq=64,
                         steps=2, warmup=1)
    assert result["params"] == args.param_counts()["total"]
    assert result["tflops"] == pytest.approx(args.flops_per_token(64) * result["tokens_per_sec"] / 1e12)
    assert result["tflops_causal"] < result["tflops"] and result["mfu_pct"] is None  # no known CPU peak


def test_scout_stack_compares_bf16_with_emulated_float8_linears(tmp_path, monkeypatch) -> None:
    """--precisions runs the stack once per entry from the same weights and reports tokens/s
    against bf16; float8 linears (emulated here) start from bf16's loss at step 1."""
    pytest.importorskip("torchao.float8")
    import json
    import sys

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_scout_stack.py", "--device", "cpu", "--flavor", "tiny", "--layers", "2",
                                      "--vocab", "512", "--seq", "64", "--steps", "2", "--warmup", "1",
                                      "--no-compile", "--precisions", "bf16", "float8-linears", "--emulate",
                                      "--out", str(out)])
    _script("bench_scout_stack").main()
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["bf16", "float8-linears"]
    assert result["tokens_per_sec_vs_bf16"]["bf16"] == 1.0
    assert result["tokens_per_sec_vs_bf16"]["float8-linears"] == pytest.approx(
        result["runs"]["float8-linears"]["tokens_per_sec"] / result["runs"]["bf16"]["tokens_per_sec"])
    losses = [run["final_loss"] for run in result["runs"].values()]
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=2e-2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_bench_times_both_paths_on_the_same_state(tmp_path) -> None:
    result = _script("bench_checkpoint").bench("tiny", 1, tmp_path)
    assert result["checkpoint_mb"] == 29.9  # 2.4 M parameters x (weights + 2 AdamW moments) in fp32
    assert all(result[f"{k}_s"] > 0 for k in ("save_torch", "save_checksums", "load_torch", "load_checked"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checked-1", "checked0", "plain-1", "plain0"]


def test_data_bench_reports_prepare_reader_and_memory(tmp_path, monkeypatch) -> None:
    """Tiny settings: prepare-data and the `tokenizers` library count the same tokens, and each
    number the JSON promises is there."""
    pytest.importorskip("tokenizers")
    import json
    import sys

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_data.py", "--text-mb", "0.2", "--vocab", "300", "--workers", "1",
                                      "--small-mb", "0.1", "--big-mb", "0.5", "--steps", "20", "--train-steps", "0", "--jsonl-documents", "2000",
                                      "--index-mb", "0.5",
                                      "--tmp", str(tmp_path), "--out", str(out)])
    _script("bench_data").main()
    result = json.loads(out.read_text())
    assert result["prepare"]["tokens"] > 0 and result["prepare"]["per_core_ratio"] > 0
    assert result["loader"]["loader_tokens_per_sec"] > 0 and result["loader"]["rows"] == 8
    assert result["jsonl_resume"]["resume_s"] > 0 and result["jsonl_resume"]["resume_at_row_document"] > 20
    assert result["memory"]["small"]["tokens"] == 50_000 and result["memory"]["big"]["tokens"] == 250_000
    first = result["first_open"]
    assert [len(first[f"{mode}_{n}_ranks"]) for n in (1, 4) for mode in ("shared", "every_rank")] == [1, 1, 4, 4]
    # Each rank reads a quarter of the corpus (2 of its 8 files) for all; each rank of the other mode reads it whole.
    corpus = first["corpus_mb"]
    assert all(0.2 * corpus <= r["read_mb"] <= 0.3 * corpus for r in first["shared_4_ranks"]), first
    assert all(r["read_mb"] >= corpus * 0.9 for r in first["every_rank_4_ranks"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # the corpora are deleted


def test_compile_bench_alternates_eager_and_compiled_on_the_same_batch(tmp_path, monkeypatch) -> None:
    """Both variants measured the asked number of steps, with and without masking, the speed-up
    their medians' ratio, 0 graph breaks (fullgraph would have raised), JSON written (aot_eager:
    inductor's codegen would take the tier's time)."""
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_compile.py", "--flavors", "tiny", "--seq", "128", "--batch", "2",
                                      "--steps", "2", "--warmup", "1", "--backend", "aot_eager", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        _script("bench_compile").main()
    finally:
        torch.set_num_threads(threads)
    results = json.loads(out.read_text())["results"]
    assert [r["document_masking"] for r in results] == [False, True]
    for r in results:
        assert len(r["steps"]["eager"]) == len(r["steps"]["compiled"]) == 2 and r["graph_breaks"] == 0
        assert r["compiled_over_eager"] == pytest.approx(r["eager_s"] / r["compiled_s"])


def test_sink_attention_bench_reports_every_variant() -> None:
    """Each variant's time and saved bytes; the masked math keeps its score matrix, the window
    layer only q, k, v, the output and the log-sum-exp (a fraction of it at this length)."""
    result = _script("bench_sink_attention").bench(256, heads=2, kv_heads=1, head_dim=16, window=32, steps=1,
                                                   math_max_seq=256)
    assert set(result) == {"causal", "sinks", "sinks_window", "math_window"}
    assert all(r["ms"] > 0 for r in result.values())
    assert result["sinks_window"]["saved_mib"] < result["math_window"]["saved_mib"] / 2


def test_muon_bench_reports_exact_state_bytes(tmp_path, monkeypatch) -> None:
    """The optimizer-step part on a tiny flavor: Muon's state is the momentum buffers of its
    matrices and AdamW's two moments for the rest, below AdamW's two states everywhere."""
    out = tmp_path / "muon.json"
    monkeypatch.setattr(sys, "argv", ["bench_muon.py", "--parts", "step", "--families", "deepseek_v3",
                                      "--flavor", "tiny", "--steps", "1", "--out", str(out)])
    _script("bench_muon").main()
    adamw, muon = json.loads(out.read_text())["step"]
    assert (adamw["optimizer"], muon["optimizer"]) == ("AdamW", "Muon")
    assert adamw["state_bytes"] == 2 * 4 * adamw["params"]
    one = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, world_size=1)
    specs = param_specs(FLAVORS["deepseek_v3"]["tiny"])
    assert muon["state_bytes"] == 4 * optimizer_state_elements(specs, one, OptimizerConfig(name="Muon"))
    assert muon["step_s"] > 0 and adamw["step_s"] > 0


def test_lora_bench_runs_torchmoe_without_trl(tmp_path, monkeypatch) -> None:
    """A tiny torchmoe LoRA row in its subprocess: finite positive throughput and memory, one
    whole conversation per row, the JSON saying TRL is missing (as where it is not installed).
    TRL reads the rows in torchmoe's step order: step s holds conversation j*steps + s of row j."""
    bench = _script("bench_lora")
    assert bench.step_order(3, 2) == [0, 3, 1, 4, 2, 5]
    monkeypatch.setattr(bench, "trl_missing", lambda: "not installed (pip install trl)")
    out = tmp_path / "lora.json"
    monkeypatch.setattr(sys, "argv", ["bench_lora.py", "--rows", "torchmoe_lora", "trl_peft_lora", "--seq", "96",
                                      "--batch", "2", "--steps", "2", "--warmup", "1", "--hidden", "32",
                                      "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                                      "--experts", "4", "--top-k", "2", "--moe-hidden", "16", "--threads", "1",
                                      "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    assert result["trl"] == "not installed (pip install trl)" and list(result["rows"]) == ["torchmoe_lora"]
    row = result["rows"]["torchmoe_lora"]
    numbers = [row[k] for k in ("tokens_per_sec", "supervised_tokens_per_sec", "peak_rss_mb", "final_loss")]
    assert all(math.isfinite(x) and x > 0 for x in numbers), row
    assert row["tokens_per_step"] == [2 * 96] * 2 and row["steps"] == 2 and row["timed_steps"] == 1
    assert 0 < row["trainable_params"] < row["total_params"]
    assert row["chat_stats"]["data"]["packed"] == 4 and row["chat_stats"]["data"]["truncated"] == 0


def test_padding_load_bench_counts_padding_both_ways() -> None:
    """Rows packed as chat data packs them, one forward with the data's mask and one counting
    every token: the padding (all of it on the same experts, as EOS under document masking) makes
    the busiest expert busier and turns some experts' bias update."""
    result = _script("bench_padding_load").measure(experts=16, top_k=4, layers=1, rows=3, seq=256, median=100.0,
                                                   sigma=0.8, seed=0)
    assert 0 < result["padding_pct"] < 100
    assert result["max_over_mean_padding_counted"][0] > result["max_over_mean_data"][0]
    assert result["bias_update_turns"][0] > 0
