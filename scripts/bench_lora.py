"""LoRA fine-tuning of a Qwen3-MoE checkpoint on CPU, side by side: torchmoe's LoRA, torchmoe's full
fine-tuning, and TRL's `SFTTrainer` with a PEFT LoRA of the same rank, alpha and targets.

    python scripts/bench_lora.py --out outputs/bench_lora.json
    python scripts/bench_lora.py --seq 128 --batch 2 --steps 3 --warmup 1 --out /tmp/lora.json

All three train the same random Qwen3-MoE Hugging Face folder (written by transformers, sized by
`--hidden`, `--layers`, `--experts`, ...) on the same multi-turn chat rows (system, user and
assistant turns rendered by a ChatML template with generation markers), with the loss on the
assistant turns only (torchmoe's `training.loss_on = "assistant"`, TRL's `assistant_only_loss`),
fp32, no activation checkpointing, AdamW (betas 0.9/0.999, no weight decay, fused), the same LR
schedule (no warmup, linear decay: step s at lr * (1 - (s - 1) / steps)), gradient clipping at 1.0,
no router auxiliary loss, global batch `--batch` in one micro-batch, `--steps` optimizer steps.

- ``torchmoe_lora``: `Trainer` with ``[lora]`` on attention and the routed experts (one adapter
  pair per expert and projection, run by grouped GEMMs), driven step by step in process.
- ``torchmoe_full``: the same job without ``[lora]``: every parameter trains.
- ``trl_peft_lora``: TRL's `SFTTrainer` with a `peft.LoraConfig`: ``target_modules`` the attention
  projections, ``target_parameters`` the fused expert weights (``mlp.experts.gate_up_proj``,
  ``mlp.experts.down_proj``), which is how PEFT 0.21 adapts the experts of a transformers 5 MoE
  model: the same adapters as torchmoe's, shape for shape (``trainable_params`` shows it).

Every conversation renders to exactly `--seq` + 1 tokens, so a torchmoe row (seq + 1 tokens: seq
inputs and their next-token labels) holds one whole conversation and TRL's batch, padded to its
longest, holds no padding: neither side packs or pads, and step s of both trains the same
conversations (TRL reads the rows in torchmoe's order, sequentially). Each run counts what it
really processed per step (input tokens, targets); the first loss of every row is the base
model's on the same first batch.

Each configuration runs in its own subprocess with `--threads` torch threads; a row reports
tokens/s (input tokens, and targets, per second over the steps after `--warmup`, timed from one
step's end to the next's, data included), the step times, the first and final loss, the trainable
and total parameter counts, and memory: ``peak_rss_mb``, the process's peak RSS (what its
``ru_maxrss`` says: imports, weight loading and training), and apart the training steps' own:
``rss_at_train_start_mb`` (model, optimizer and data built) and ``train_peak_rss_mb`` (the peak
from then on; Linux resets the peak through /proc/self/clear_refs), whose difference
``train_rss_growth_mb`` is what the steps added (activations, gradients, optimizer state). On CPU
torch keeps no allocator statistics, so RSS is the measure; the process peak includes each
library's imports (TRL's child imports more). `--repeats` runs the configurations in turn that
many times and reports each one's fastest run (every run's tokens/s in ``tokens_per_sec_runs``).
Without `trl` the torchmoe rows still run and the JSON says so. Writes JSON and prints it; on a
shared CPU the times are noisy (``load_average_*`` records the machine's load before and after).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/: the tiny-checkpoint, tokenizer and chat-job helpers
from tests.any_checkpoint import CONFIGS  # noqa: E402
from tests.chat_fixtures import chatml  # noqa: E402
from tests.chat_jobs import chat_job, write_chat_file  # noqa: E402

ROWS = ("torchmoe_lora", "torchmoe_full", "trl_peft_lora")
# PEFT's names for the adapted weights of transformers' Qwen3-MoE: torchmoe's "attention" and
# "experts" targets (`models.peft_targets`; torchmoe's own adapter export writes the same names).
PEFT_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Content letters: none of them merges with another in the fixture tokenizer's BPE (its merges
# start with "a", "t", "o" or a newline), so each adds one token and a row can be sized exactly.
LETTERS = "bcdefghijklmnpqrsuvwxyz"


def write_checkpoint(folder: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3-MoE folder (config.json + model.safetensors) made by transformers: the test
    fixture's config (`tests.any_checkpoint`) resized by the command line; every layer MoE."""
    import transformers

    config = {**CONFIGS["qwen3"], "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
              "num_experts": args.experts, "num_experts_per_tok": args.top_k,
              "moe_intermediate_size": args.moe_hidden, "mlp_only_layers": []}
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(folder)
    return folder


def _words(rng: random.Random, low: int, high: int) -> str:
    """`low` to `high` random words of 2 to 6 `LETTERS`."""
    return " ".join("".join(rng.choices(LETTERS, k=rng.randint(2, 6))) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, length: int, count: Callable[[list[dict[str, str]]], int],
                 ) -> list[dict[str, str]]:
    """A system prompt and user/assistant turns whose rendering (`count(messages)` tokens) is
    exactly `length` tokens: exchanges are added while a last one still fits, and the last
    answer is filled to the length."""
    messages = [{"role": "system", "content": _words(rng, 2, 5)}]
    reserve = 64 + length // 8  # room for the last question (up to ~50 tokens) and an answer
    while True:
        more = [{"role": "user", "content": _words(rng, 2, 6)}, {"role": "assistant", "content": _words(rng, 3, 10)}]
        if count(messages + more) > length - reserve:
            break
        messages += more
    messages += [{"role": "user", "content": _words(rng, 2, 4)}, {"role": "assistant", "content": ""}]
    missing = length - count(messages)
    if missing < 1:
        raise ValueError(f"--seq {length - 1} is too short for a conversation; use 96 or more")
    messages[-1]["content"] = "".join(rng.choices(LETTERS + " ", k=missing - 1)) + rng.choice(LETTERS)
    assert count(messages) == length, (count(messages), length)
    return messages


def write_inputs(root: Path, args: argparse.Namespace) -> dict:
    """The checkpoint, the tokenizer folder and the chat file every run reads; the chat file holds
    `steps` x `batch` conversations of seq + 1 tokens in torchmoe's order."""
    from transformers import AutoTokenizer

    hf = write_checkpoint(root / "qwen3_moe", args)
    tokenizer_folder = chatml(root / "chatml", marked=True)  # {% generation %}: TRL's assistant_only_loss needs it
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)

    def count(messages: list[dict[str, str]]) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    rng = random.Random(0)
    rows = [{"messages": conversation(rng, args.seq + 1, count)} for _ in range(args.steps * args.batch)]
    data = write_chat_file(root / "chat.jsonl", rows)
    return {"hf": str(hf), "tokenizer": str(tokenizer_folder), "data": str(data), "seq": args.seq,
            "batch": args.batch, "steps": args.steps, "lr": args.lr, "rank": args.rank, "alpha": args.alpha,
            "threads": args.threads, "dump": str(root / "dump")}


def step_order(steps: int, batch: int) -> list[int]:
    """The rows of the chat file in the order torchmoe's steps read them: batch row j of G reads
    conversations [j*N/G, (j+1)*N/G) of the N, so step s holds conversation j*steps + s of each
    row j (`data/chat/chat.py`, one conversation per row)."""
    return [j * steps + s for s in range(steps) for j in range(batch)]


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (`VmRSS`) or at its peak (`VmHWM`), in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) / 1024


class Memory:
    """The process's peak RSS, and apart the training steps' own: `train_starts` notes the RSS
    then (model, optimizer and data built) and resets the kernel's peak (/proc/self/clear_refs),
    so the peak read at the end is the steps' (activations, gradients, optimizer state), not the
    imports' or the weight loading's."""

    def train_starts(self) -> None:
        self.setup_peak, self.at_start = rss_mb("VmHWM"), rss_mb()
        Path("/proc/self/clear_refs").write_text("5")

    def report(self) -> dict[str, float]:
        train_peak = rss_mb("VmHWM")
        return {"peak_rss_mb": max(self.setup_peak, train_peak), "rss_at_train_start_mb": self.at_start,
                "train_peak_rss_mb": train_peak, "train_rss_growth_mb": train_peak - self.at_start}


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """The parameters that train, and all of them (the frozen base and the adapters)."""
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total_params": sum(p.numel() for p in model.parameters())}


def run_torchmoe(spec: dict, lora: bool, memory: Memory) -> dict:
    """torchmoe's `Trainer` on the spec's job, step by step (what `fit` does each step, without its
    metrics records and garbage-collection schedule); each step's end time, input tokens,
    targets and loss."""
    from torchmoe.training.loop import Trainer

    flags = ["--training.seq_len", str(spec["seq"]), "--training.local_batch_size", str(spec["batch"]),
             "--training.global_batch_size", str(spec["batch"]), "--training.steps", str(spec["steps"]),
             "--training.max_norm", "1.0", "--optimizer.lr", str(spec["lr"]), "--optimizer.beta2", "0.999",
             "--optimizer.weight_decay", "0", "--model.aux_loss_coeff", "0", "--activation_checkpoint.mode", "none"]
    if lora:
        flags += ["--lora.enable", "true", "--lora.targets", "attention", "experts",
                  "--lora.rank", str(spec["rank"]), "--lora.alpha", str(spec["alpha"])]
    job = chat_job(Path(spec["hf"]), Path(spec["tokenizer"]), Path(spec["data"]), Path(spec["dump"]), *flags)
    trainer = Trainer(job)
    try:
        trainer.load_initial_state()
        memory.train_starts()
        ends, tokens, targets, losses = [time.perf_counter()], [], [], []
        for _ in range(spec["steps"]):
            batch = trainer.dataloader.next_batch()
            result = trainer.train_step(batch)
            trainer.step += 1
            ends.append(time.perf_counter())
            tokens.append(sum(mb[0].numel() for mb in batch))
            targets.append(sum(mb.supervised for mb in batch))
            losses.append(result.loss)
        # chat_stats: every conversation packed whole (none truncated or dropped), one per row.
        return {**parameter_counts(trainer.model), "ends": ends, "tokens": tokens, "targets": targets,
                "losses": losses, "extra": {"chat_stats": trainer.dataloader.chat_stats()}}
    finally:
        trainer.release()


def run_trl(spec: dict, memory: Memory) -> dict:
    """TRL's `SFTTrainer` with a PEFT LoRA on the spec's data, in torchmoe's row order; each step's
    end time (a callback), the input tokens and targets of each batch (counted as the collator
    builds it) and the logged losses."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Clock(TrainerCallback):
        """The training's start and each optimizer step's end, and the loss logged for it."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs) -> None:
            memory.train_starts()
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    class Counted:
        """The trainer's collator, counting each batch's input tokens, non-padding tokens and
        targets (labels other than -100 after the shift: what the loss divides by)."""

        def __init__(self, collate) -> None:
            self.collate, self.batches = collate, []

        def __call__(self, examples):
            batch = self.collate(examples)
            self.batches.append((batch["input_ids"].numel(), int(batch["attention_mask"].sum()),
                                 int((batch["labels"][:, 1:] != -100).sum())))
            return batch

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    dataset = Dataset.from_list([rows[i] for i in step_order(spec["steps"], spec["batch"])])
    model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32)
    peft_config = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, bias="none",
                             target_modules=PEFT_ATTENTION, target_parameters=PEFT_EXPERTS, task_type="CAUSAL_LM")
    # Set against TRL's defaults, which differ from torchmoe's job: gradient checkpointing and bf16
    # on, the router's auxiliary loss from the model config, the rows in random order.
    config = SFTConfig(
        output_dir=str(Path(spec["dump"]) / "trl"), max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, learning_rate=spec["lr"], lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, optim="adamw_torch_fused", max_grad_norm=1.0,
        max_length=spec["seq"] + 1, packing=False, padding_free=False, assistant_only_loss=True,
        router_aux_loss_coef=0.0, gradient_checkpointing=False, bf16=False, use_cpu=True,
        train_sampling_strategy="sequential", shuffle_dataset=False, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    clock = Clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=AutoTokenizer.from_pretrained(spec["tokenizer"]), peft_config=peft_config,
                         callbacks=[clock])
    counted = trainer.data_collator = Counted(trainer.data_collator)
    trainer.train()
    batches = counted.batches[:spec["steps"]]  # the loader may have collated one batch ahead
    return {**parameter_counts(trainer.model), "ends": clock.ends, "tokens": [b[0] for b in batches],
            "targets": [b[2] for b in batches], "losses": clock.losses,
            "extra": {"non_padding_tokens_per_step": [b[1] for b in batches]}}


def child(row: str, spec_path: Path, out: Path) -> None:
    """Run one configuration in this process and write its raw record to `out`."""
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    spec["dump"] = str(Path(spec["dump"]) / row)
    memory = Memory()
    if row == "trl_peft_lora":
        record = run_trl(spec, memory)
    else:
        record = run_torchmoe(spec, row == "torchmoe_lora", memory)
    record.update(threads=torch.get_num_threads(), **memory.report())
    out.write_text(json.dumps(record))


def run_row(row: str, spec_path: Path, threads: int) -> dict:
    """`row` in a subprocess of its own (this script with --child), with `threads` OpenMP threads."""
    out = spec_path.with_name(f"{row}.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", row, "--spec", str(spec_path), "--child-out", str(out)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{row} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def summarize(record: dict, warmup: int) -> dict:
    """Throughput over the steps after `warmup`, memory, and what the row trained."""
    step_s = [b - a for a, b in zip(record["ends"], record["ends"][1:])]
    seconds = sum(step_s[warmup:])
    memory = ("peak_rss_mb", "rss_at_train_start_mb", "train_peak_rss_mb", "train_rss_growth_mb")
    return {
        "tokens_per_sec": sum(record["tokens"][warmup:]) / seconds,
        "supervised_tokens_per_sec": sum(record["targets"][warmup:]) / seconds,
        "steps": len(step_s), "timed_steps": len(step_s) - warmup, "step_s": [round(s, 3) for s in step_s],
        "tokens_per_step": record["tokens"], "supervised_tokens_per_step": record["targets"],
        "first_loss": record["losses"][0], "final_loss": record["losses"][-1],
        "trainable_params": record["trainable_params"], "total_params": record["total_params"],
        "threads": record["threads"], **{key: round(record[key], 1) for key in memory}, **record["extra"],
    }


def trl_missing() -> str | None:
    """Why the TRL row cannot run here, or None."""
    for name in ("trl", "peft"):
        if importlib.util.find_spec(name) is None:
            return f"not installed (pip install {name})"
    return None


def versions(with_trl: bool) -> dict[str, str]:
    """The installed versions of what the rows run on."""
    names = ["torch", "transformers"] + (["trl", "peft"] if with_trl else [])
    return {name: importlib.metadata.version(name) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256, help="tokens per row; each conversation is seq + 1 tokens")
    parser.add_argument("--batch", type=int, default=8, help="global batch (conversations per step), one micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every configuration this many times, in turn; each row reports its fastest run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (a multiple of 8 suits the grouped GEMMs)")
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-hidden", type=int, default=128, help="each routed expert's hidden size")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each configuration")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--out", default="outputs/bench_lora.json")
    parser.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.spec, opts.child_out)
        return
    if opts.steps <= opts.warmup:
        parser.error("--steps must be larger than --warmup")

    missing = trl_missing() if "trl_peft_lora" in opts.rows else None
    rows = [row for row in opts.rows if not (row == "trl_peft_lora" and missing)]
    result: dict = {"versions": versions("trl_peft_lora" in rows), "cpu_count": os.cpu_count(),
                    "threads": opts.threads, "load_average_before": os.getloadavg()}
    if missing:
        result["trl"] = missing
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_inputs(Path(tmp), opts)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        result["setup"] = {**{k: spec[k] for k in ("seq", "batch", "steps", "lr", "rank", "alpha")},
                           "warmup": opts.warmup, "repeats": opts.repeats, "conversation_tokens": opts.seq + 1,
                           "dtype": "float32", "lora_targets": {
                               "torchmoe": ["attention", "experts"],
                               "peft": {"target_modules": PEFT_ATTENTION, "target_parameters": PEFT_EXPERTS}},
                           "model": json.loads((Path(spec["hf"]) / "config.json").read_text())}
        for _ in range(opts.repeats):  # in turn, so that a slow minute of a shared machine hits every row
            for row in rows:
                runs[row].append(summarize(run_row(row, spec_path, opts.threads), opts.warmup))
    result["load_average_after"] = os.getloadavg()
    result["rows"] = {}
    for row, measured in runs.items():
        # The fastest run: other work on a shared machine only ever slows one down.
        result["rows"][row] = {**max(measured, key=lambda run: run["tokens_per_sec"]),
                               "tokens_per_sec_runs": [run["tokens_per_sec"] for run in measured]}
    if {"torchmoe_lora", "trl_peft_lora"} <= result["rows"].keys():
        lora, peft_row = result["rows"]["torchmoe_lora"], result["rows"]["trl_peft_lora"]
        result["torchmoe_lora_vs_trl_peft"] = {
            **{key: lora[key] / peft_row[key]
               for key in ("tokens_per_sec", "supervised_tokens_per_sec", "peak_rss_mb", "train_rss_growth_mb")},
            # PEFT holds every target as torchmoe does (no closest stand-in was needed): equal counts.
            "same_trainable_params": lora["trainable_params"] == peft_row["trainable_params"],
            "same_targets_per_step": lora["supervised_tokens_per_step"] == peft_row["supervised_tokens_per_step"]}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
