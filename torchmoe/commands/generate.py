"""`torchmoe generate`: sample text from trained weights, one process, with a key/value cache.

    torchmoe generate --job.dump_folder outputs/debug-40 --prompt "def main(" --max-new-tokens 64

The weights (`--checkpoint`, else the newest checkpoint of the job's run: `weight_sources.trained_weights`)
give the model (family, architecture, adapters, tokenizer) where they tell it: a run's config.toml
and the Hugging Face folder it started from (a LoRA run's checkpoint is its adapters over the
run's base), a Hugging Face config.json, a PEFT adapter folder over its base (`--base FOLDER`, else
the one its adapter_config.json names); the job (the job file, or without one that run's
config.toml) the rest (device, compute dtype). The prompt is encoded as training encodes a
document (BOS first with `training.add_bos`), or with `--chat` as a user message rendered through
the tokenizer's chat template with the generation prompt after it (the template's tokens only:
`data.chat.chat_template`), as chat SFT trained; the model prefills it once, then decodes one token at
a time over its cached keys and values (`nn.kv_cache`), so each step costs one position, and the
logits are those of the full forward.

Sampling: `--temperature 0` (the default) is greedy; above 0 the logits are divided by it and
`--top-p` keeps the smallest set of tokens whose probability reaches p (nucleus sampling; the
most likely token always stays), drawn from a generator seeded by `--seed`: the same seed, prompt
and weights give the same text. Generation stops at the tokenizer's end-of-text id or after
`--max-new-tokens`. Logits that are NaN or inf (a computation that overflowed its dtype) stop it
with an error: no token is chosen from them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from torchmoe.arch.registry import model_args_from_config
from torchmoe.commands.exits import rank_specific_errors
from torchmoe.commands.job import checkpoint_job
from torchmoe.config import ConfigError, JobConfig
from torchmoe.config.flags import Integer, Number, split_flags
from torchmoe.config.numbers import INT64_MAX, shown_text
from torchmoe.data.chat.chat_template import ChatTemplate, TemplateRefused
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.hf_files.peft_adapter import load_peft_adapter
from torchmoe.models.decoder.lora import apply_lora
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.kv_cache import KVCache
from torchmoe.plan.memory import compute_dtype
from torchmoe.preflight import train_device
from torchmoe.training.adapter_checkpoint import adapted_model
from torchmoe.training.adapters import base_weights
from torchmoe.training.cpu_threads import cpu_threads
from torchmoe.weight_sources.initial_load import load_initial_weights
from torchmoe.weight_sources.trained_weights import STEP, TrainedWeights

__all__ = ["NonFiniteLogits", "Sampling", "chat_prompt", "generate_ids", "generate_main", "load_trained_model", "next_token"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen (`next_token`)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the most likely tokens until their probability reaches top_p
    seed: int = 0


class NonFiniteLogits(ValueError):
    """The model's logits for generated token `index` (0-based) hold NaN or inf."""

    def __init__(self, index: int) -> None:
        super().__init__(f"the logits of generated token {index + 1} hold NaN or inf")
        self.index = index


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits: (B, V) of the last position, finite -> the chosen ids (B,) int64."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted to a maximum of 0 before the division (softmax does not change): a temperature near
    # 0 then sends the others to -inf, never the largest to inf (inf - inf is NaN in softmax).
    logits = logits.float()
    probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the tokens more likely than it hold less than top_p; the most likely
        # one always stays (a top_p that float32 rounds to 0 would otherwise drop every token).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # multinomial draws on the probabilities' device; the generator lives there too.
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model: Transformer, prompt: list[int], sampling: Sampling, *, eos_id: int,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
    """The ids generated after `prompt` (not included), ending at `eos_id` (included) or after
    `sampling.max_new_tokens`; `on_token` sees each as it comes.

    The prompt is one prefill forward (1, len(prompt)); each later id is a forward of one
    position over the cache.

    Raises:
        NonFiniteLogits: the model's logits hold NaN or inf (argmax would read NaN as the largest
            and print token 0, multinomial would fail).
    """
    device = model.output.weight.device
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed)
    cache = KVCache()
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, P)
    out: list[int] = []
    while len(out) < sampling.max_new_tokens:
        logits = model(tokens, cache=cache)[:, -1]  # (1, V)
        finite = torch.isfinite(logits).all()
        chosen = next_token(torch.where(finite, logits, 0.0), sampling, generator)  # (1,)
        # One host read per token (the loop needs the id to stop), whether the logits were finite with it.
        token, ok = torch.stack((chosen[0], finite.long())).tolist()
        if not ok:
            raise NonFiniteLogits(len(out))
        out.append(token)
        if on_token is not None:
            on_token(out[-1])
        if out[-1] == eos_id:
            break
        tokens = chosen.view(1, 1)
    return out


def load_trained_model(cfg: JobConfig, weights: TrainedWeights) -> Transformer:
    """The job's model on its training device in eval mode, holding `weights`
    (`weight_sources.trained_weights`: a Hugging Face or DCP folder; a PEFT adapter folder over its
    base; a LoRA run's checkpoint over the run's base, `adapter_checkpoint.adapted_model`),
    computing in training's compute dtype."""
    device = train_device(cfg.training.device)
    if device.type == "cpu":
        cpu_threads()  # the CPUs this process has to itself, as training chooses them
    if weights.lora_step:
        model = adapted_model(dataclasses.replace(weights.run, model=cfg.model), weights.folder).to(device)
    else:
        adapter = weights.form == "adapter"
        path, key = (weights.base, "--base") if adapter else (weights.folder, "--checkpoint")
        # Reading, not training: nothing is exported, so no expert bias is refused for an export.
        ckpt = dataclasses.replace(cfg.checkpoint, initial_load_path=str(path),
                                   initial_load_in_hf=weights.in_hf or adapter, last_save_in_hf=False)
        args = model_args_from_config(cfg.model, lora=adapter)  # an adapter's base keeps its expert biases
        with torch.device("meta"):
            model = Transformer(args)
        if adapter:
            apply_lora(model, cfg.lora)
        model.to_empty(device=device)
        model.init_weights(seed=cfg.training.seed, buffer_device=device)  # the buffers; weights come next
        with warnings.catch_warnings():
            # DCP says it assumes one process when no process group exists: here that is the intent.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load_initial_weights(ckpt, cfg.model.flavor, args, model, key=key, keep=base_weights(cfg.lora))
        if adapter:
            load_peft_adapter(model, weights.folder, cfg.lora)
    dtype = torch_dtype(compute_dtype(cfg.training))
    model.autocast_dtype = None if dtype == torch.float32 else dtype
    logger.info("generating from %s", weights.folder)
    return model.eval()


# A temperature divides float32 logits: below float32's smallest normal number (a subnormal that
# hardware may flush to 0, or 1e-320, which is 0 in float32) it would divide by zero.
_TEMPERATURE = (float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max))

_FLAGS = {"--checkpoint": str, "--base": str, "--step": STEP, "--prompt": str,
          "--max-new-tokens": Integer(1, INT64_MAX, "64"),
          "--temperature": Number(0.0, _TEMPERATURE[1], "0.8"), "--top-p": Number(0.0, 1.0, "0.9", above_low=True),
          "--seed": Integer(0, 2**64 - 1, "0")}  # torch.Generator's seeds: 64 bits, unsigned

GENERATE_DESCRIPTION = (
    "Sample text from trained weights: those of --checkpoint (a step-N folder, a DCP folder, a Hugging Face folder, "
    "or a PEFT adapter folder over --base FOLDER or the base its adapter_config.json names), or else the newest "
    "checkpoint of the run in --job.dump_folder (--step N picks one). The model, adapters and tokenizer are the "
    "weights' own (the run's config.toml and the folder it started from, the folder's config.json), else the job "
    "file's (--config, optional with a run's weights). Own flags: --prompt TEXT (required), --chat (the prompt is a "
    "user message, rendered through the tokenizer's chat template with the generation prompt), --max-new-tokens N "
    "(128), --temperature T (0: greedy), --top-p P (1.0), --seed S (0). Every other flag overrides the job as in "
    "`torchmoe train`.")


def _sampling(found: dict[str, object]) -> Sampling:
    """The `Sampling` the flags ask for (each in its range: `_FLAGS`)."""
    sampling = Sampling(**{k[2:].replace("-", "_"): v for k, v in found.items()
                           if k in ("--max-new-tokens", "--temperature", "--top-p", "--seed")})
    if 0 < sampling.temperature < _TEMPERATURE[0]:
        raise ConfigError("--temperature", sampling.temperature, f"is below {_TEMPERATURE[0]:.3g}, float32's "
                          "smallest normal number, which the logits (float32) cannot be divided by",
                          "pass 0 for greedy decoding (what a temperature near 0 means), or e.g. 0.8")
    return sampling


def generate_main(argv: list[str]) -> int:
    """`torchmoe generate`: print the prompt and what the model writes after it, as it comes;
    returns the exit status.

    The job file and its overrides are parsed as `train` parses them, and the weights found
    (`--checkpoint`, `--step`: `job.checkpoint_job`). It runs in one process: its message is the
    message (`RankSpecificError`)."""
    with rank_specific_errors():
        return _generate(argv)


def _generate(argv: list[str]) -> int:
    chat = "--chat" in argv  # a switch, without a value
    found, rest = split_flags([token for token in argv if token != "--chat"], _FLAGS)
    loaded = checkpoint_job(rest, "torchmoe generate", GENERATE_DESCRIPTION,
                            checkpoint=str(found.get("--checkpoint", "")), step=found.get("--step"),
                            base=str(found.get("--base", "")))
    if isinstance(loaded, int):
        return loaded
    cfg, weights = loaded
    if "--prompt" not in found:
        raise ConfigError("--prompt", "(not given)", "is required",
                          'pass the text to continue, e.g. --prompt "def main("')
    sampling = _sampling(found)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path, key="model.tokenizer_path")
    text = str(found["--prompt"])
    if chat:
        prompt, text = chat_prompt(Path(cfg.model.tokenizer_path), text)
    else:
        prompt = ([tokenizer.bos_id] if cfg.training.add_bos and tokenizer.bos_id is not None else []) \
            + tokenizer.encode(text)
    if not prompt:
        raise ConfigError("--prompt", "", "encodes to no tokens", 'pass text to continue, e.g. --prompt "The"')
    model = load_trained_model(cfg, weights)
    limit = model.args.max_seq_len
    if len(prompt) >= limit:  # no --max-new-tokens fits: the prompt is what to change
        raise ConfigError("--prompt", shown_text(str(found["--prompt"])),
                          f"encodes to {len(prompt)} tokens, which leave no room for one more in the model's "
                          f"{limit} positions (model.max_seq_len)", f"shorten it to at most {limit - 1} tokens")
    if len(prompt) + sampling.max_new_tokens > limit:
        raise ConfigError("--max-new-tokens", sampling.max_new_tokens,
                          f"with the prompt's {len(prompt)} tokens it passes the model's {limit} positions "
                          "(model.max_seq_len)", f"pass at most {limit - len(prompt)}, or a shorter prompt")
    sys.stdout.write(text)
    sys.stdout.flush()
    shown, ids = "", []

    def show(token: int) -> None:
        # Decode everything so far and print what is new: a character split over several
        # tokens (UTF-8 bytes, BPE pieces) appears once whole.
        nonlocal shown
        ids.append(token)
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd") and text.startswith(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    try:
        generate_ids(model, prompt, sampling, eos_id=tokenizer.eos_id, on_token=show)
    except NonFiniteLogits as err:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise _overflowed(err, cfg, found) from None
    text = tokenizer.decode(ids)
    sys.stdout.write(text[len(shown):] + "\n" if text.startswith(shown) else "\n")
    return 0


def chat_prompt(folder: Path, message: str) -> tuple[list[int], str]:
    """`message` as a user turn rendered through the chat template of the tokenizer in `folder`,
    the generation prompt after it (what the assistant's answer follows): (its token ids, its text).

    Raises:
        ConfigError: the folder has no chat template, or the template refuses the message.
    """
    template = ChatTemplate.load(folder)
    try:
        messages = [{"role": "user", "content": message}]
        return (template.tokens(messages, add_generation_prompt=True),
                template.text(messages, add_generation_prompt=True))
    except TemplateRefused as err:
        raise ConfigError("--prompt", shown_text(message), f"the chat template of {folder} refuses it as a user "
                          f"message ({err})", "leave out --chat to continue the text as it is") from None


def _overflowed(err: NonFiniteLogits, cfg: JobConfig, found: dict[str, object]) -> ConfigError:
    """What to do about weights (finite when loaded: `weights.finite`) whose logits are not."""
    dtype = compute_dtype(cfg.training)
    fix = ("generate in float32 (--training.mixed_precision_param float32), whose range holds more"
           if dtype != "float32" else "use weights of a run that had not diverged (an earlier --step)")
    return ConfigError("--checkpoint", str(found.get("--checkpoint", "(the run's newest checkpoint)")),
                       f"{err}, computing in {dtype}: the weights overflow it, and no token can be chosen", fix)

