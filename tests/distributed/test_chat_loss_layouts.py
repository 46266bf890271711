"""Chat SFT through the whole trainer, in every layout, on the single process's curve: full
fine-tuning (the masked loss, with the expert bias, the balance loss and the z-loss on) and
LoRA with adapters on every target Qwen3-MoE has (attention, the dense MLP, the routed experts,
the router), three steps each, loss and gradient norm within 1e-5 in fp32; and full
fine-tuning's routing statistics, which leave the windows' padding out: every step's per-expert
loads exactly, and the expert biases after the three steps, those of a brute-force count over
the data tokens of the single process's routers (`tests.chat_jobs.RouterTaps`).

    python -m pytest -q tests/distributed/test_chat_loss_layouts.py

Each row of the global batch holds a different count of supervised tokens (some none), so every
layout must divide by the global batch's count, not its own share's:
- FSDP 2 and HSDP 2 x 2: each rank's rows;
- TP 2 with sequence parallel and MoE TP, and EP 2 over the TP ranks: every rank the whole batch,
  the loss over a sharded vocabulary;
- EP 2 x FSDP 2: each rank's rows, its experts' tokens from both;
- CP 2: each rank's head-tail pieces of every row, the count over whole rows;
- PP 2: the schedule's loss over the same count, each row a pipeline micro-batch.
The padding (a window's rest after its last conversation, 0-52% of a row here) falls unevenly
on the ranks of every layout that splits rows (CP's pieces, the TP ranks EP borrows, PP's
micro-batches): the data mask must travel with the tokens, and the z-loss take the step's count
of data tokens, for the statistics and the curve to be the single process's.

Chat data masks documents by default, so every layout runs each packed conversation alone. gpt-oss
(sinks in every layer, a sliding window of 4 keys: a halo on CP's pieces of 12 tokens) fine-tunes
under CP 2, TP 2 with sequence parallel and PP 2, on the same curve as its single process.

One forked world per size (2 and 4 ranks) runs every layout of that size, both jobs each, one
after the other in the same process group; the references run in the test process. LoRA's first
step is the base's (B starts at zero), so its curve is three steps long: the second and third
see the adapters the layout trained.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.any_checkpoint import save_checkpoint
from tests.chat_fixtures import HARMONY, HARMONY_SPECIALS, chatml, tokenizer_folder
from tests.chat_jobs import RouterTaps, chat_job, data_mask, write_chat_file
from tests.helpers import BALANCE, run_rank_script, write_rank_record

pytestmark = pytest.mark.distributed
RTOL = 1e-5
NO_FSDP = ["--parallelism.data_parallel_shard_degree", "1"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# name: (world, flags)
LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_sp": (2, [*TP2, *NO_FSDP]),
    "ep2_fsdp2": (2, [*EP2, "--parallelism.data_parallel_shard_degree", "2"]),
    "ep2_over_tp2": (2, [*TP2, *EP2, *NO_FSDP]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", *NO_FSDP]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", *NO_FSDP]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2"]),
}
# gpt-oss's full fine-tuning (harmony's template: the loss on each conversation's last turn), in
# the layouts that cut its attention: CP's pieces, TP's heads (and sinks), PP's stages.
GPT_OSS = ["--training.steps", "3", "--training.loss_on", "last"]
GPT_OSS_LAYOUTS = ("cp2", "tp2_sp", "pp2")
JOBS = {
    "full": ["--training.steps", "3", *BALANCE],
    "lora": ["--training.steps", "3", "--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8",
             "--lora.targets", json.dumps(["attention", "mlp", "experts", "router"]), "--optimizer.lr", "0.01"],
}


def _run(root: Path, dump: Path, *flags: str, taps: list | None = None, family: str = "qwen3") -> dict:
    """Three steps of the chat job of `family` with `flags`: {"curve": [(loss, grad norm)] a step, "loads":
    [(n_moe_layers, n_experts) token counts] a step, "biases": this rank's MoE blocks' expert
    biases after them}. `taps`: append the steps' `RouterTaps` and each step's micro-batches."""
    from torchmoe.training.loop import Trainer

    tokenizer = "harmony" if family == "gpt_oss" else "chatml"
    trainer = Trainer(chat_job(root / family, root / tokenizer, root / "chat.jsonl", dump, *flags))
    try:
        trainer.load_initial_state()
        batches = [trainer.dataloader.next_batch() for _ in range(3)]
        tapped = RouterTaps(trainer.model)
        with tapped if taps is not None else contextlib.nullcontext():
            results = [trainer.train_step(batch) for batch in batches]
        if taps is not None:
            taps += [tapped, batches]
        return {"curve": [(r.loss, r.grad_norm) for r in results],
                "loads": [r.tokens_per_expert.tolist() for r in results],
                "biases": {name: block.moe.expert_bias.tolist() for name, block in trainer.model.layers.items()
                           if block.moe_enabled}}
    finally:
        trainer.release()  # the process group stays for the next job and `write_rank_record`


def _worker(out_dir: Path) -> None:
    root, world = out_dir.parent / "inputs", int(out_dir.name.removeprefix("world"))
    record = {f"{layout}/{job}": _run(root, out_dir / layout / job, *flags, *job_flags)
              for layout, (size, flags) in LAYOUTS.items() if size == world for job, job_flags in JOBS.items()}
    record.update({f"{layout}/gpt_oss": _run(root, out_dir / layout / "gpt_oss", *LAYOUTS[layout][1], *GPT_OSS,
                                             family="gpt_oss")
                   for layout in GPT_OSS_LAYOUTS if LAYOUTS[layout][0] == world})
    write_rank_record(out_dir, record)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat_layouts") / "inputs"
    save_checkpoint("qwen3", root / "qwen3")
    save_checkpoint("gpt_oss", root / "gpt_oss")
    chatml(root / "chatml", marked=False)
    tokenizer_folder(root / "harmony", HARMONY, HARMONY_SPECIALS, eos="<|return|>")
    write_chat_file(root / "chat.jsonl")
    return root


@pytest.fixture(scope="module")
def taps(root: Path) -> list:
    return []


@pytest.fixture(scope="module")
def single(root: Path, taps: list) -> dict[str, dict]:
    return {**{job: _run(root, root.parent / "single" / job, *flags, taps=taps if job == "full" else None)
               for job, flags in JOBS.items()},
            "gpt_oss": _run(root, root.parent / "single" / "gpt_oss", *GPT_OSS, family="gpt_oss")}


@pytest.fixture(scope="module")
def worlds(root: Path) -> dict[int, dict[int, dict]]:
    """world size -> rank -> that rank's curves, "<layout>/<job>" -> [(loss, grad norm)]."""
    sizes = sorted({size for size, _ in LAYOUTS.values()})
    return {size: run_rank_script(__file__, root.parent / f"world{size}", world=size, timeout=600)
            for size in sizes}


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chat_sft_is_the_single_process_s_in_every_layout(single, worlds, layout: str, job: str) -> None:
    want = single[job]["curve"]
    assert len({norm for _, norm in want}) == 3 and all(norm > 0 for _, norm in want)  # three real steps
    if job == "lora":  # B starts at zero: LoRA's first step is the base's forward, on the same batch
        assert want[0][0] == pytest.approx(single["full"]["curve"][0][0], rel=1e-6)
    ranks = worlds[LAYOUTS[layout][0]]
    for rank, record in ranks.items():
        got = record[f"{layout}/{job}"]["curve"]
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=RTOL) and norm == pytest.approx(want_norm, rel=RTOL), \
                (rank, got, want)


def test_the_single_process_routing_statistics_are_a_count_over_the_data_tokens(root, single, taps) -> None:
    """The reference the layouts are held to: each step's loads are the single process's routers'
    top-k counted over the data tokens (each row's trailing EOS run is padding), and its biases
    the updates from those counts; counted over every token, the loads differ."""
    from torchmoe.data.tokenizer import build_tokenizer

    tapped, batches = taps
    eos, bias = build_tokenizer(str(root / "chatml")).eos_id, {}
    coeff = float(BALANCE[BALANCE.index("--model.load_balance_coeff") + 1])
    for step, (batch, loads) in enumerate(zip(batches, single["full"]["loads"], strict=True)):
        stats = tapped.statistics([data_mask(inputs, eos) for inputs, _ in batch], top_k=2, step=step)
        assert loads == [layer["counts"].tolist() for layer in stats.values()], step
        assert loads != [layer["all_counts"].tolist() for layer in stats.values()], step
        for name, layer in stats.items():
            delta = coeff * torch.sign(layer["counts"].mean() - layer["counts"])
            bias[name] = bias.get(name, torch.zeros_like(delta)) + (delta - delta.mean())  # update_expert_bias's
    assert single["full"]["biases"] == {name: b.tolist() for name, b in bias.items()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_routing_statistics_leave_padding_out_in_every_layout(single, worlds, layout: str) -> None:
    """Every rank's per-expert loads of each step (summed over the ranks that route other tokens,
    gathered over the pipeline's stages) are the single process's exactly, and each rank's
    blocks hold its biases: padding counted on any rank would move both."""
    want = single["full"]
    for rank, record in worlds[LAYOUTS[layout][0]].items():
        got = record[f"{layout}/full"]
        assert got["loads"] == want["loads"], (layout, rank)
        assert got["biases"] and got["biases"] == {name: want["biases"][name] for name in got["biases"]}, (layout, rank)


@pytest.mark.parametrize("layout", GPT_OSS_LAYOUTS)
def test_gpt_oss_chat_sft_with_document_masking_is_the_single_process_s(single, worlds, layout: str) -> None:
    """gpt-oss's chat fine-tuning, each conversation attended alone (sinks and window within it):
    three steps' loss and gradient norm within 1e-5 of the single process's, on every rank."""
    want = single["gpt_oss"]["curve"]
    assert len({norm for _, norm in want}) == 3 and all(norm > 0 for _, norm in want)
    for rank, record in worlds[LAYOUTS[layout][0]].items():
        got = record[f"{layout}/gpt_oss"]["curve"]
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=RTOL) and norm == pytest.approx(want_norm, rel=RTOL), \
                (rank, got, want)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
