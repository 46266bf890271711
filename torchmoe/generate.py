"""`torchmoe generate`: sample text from trained weights, one process, with a key/value cache.

    torchmoe generate --job.dump_folder outputs/debug-40 --prompt "def main(" --max-new-tokens 64

The weights (`--checkpoint`, else the newest checkpoint of the job's run: `components.trained_weights`)
give the model (family, flavor, tokenizer) where they tell it, a run's config.toml or a Hugging
Face config.json; the job (the job file, or without one that run's config.toml) the rest (device,
compute dtype). The
prompt is encoded as training encodes a document (BOS first with `training.add_bos`); the
model prefills it once, then decodes one token at a time over its cached keys and values
(`nn.kv_cache`), so each step costs one position, and the logits are those of the full forward.

Sampling: `--temperature 0` (the default) is greedy; above 0 the logits are divided by it and
`--top-p` keeps the smallest set of tokens whose probability reaches p (nucleus sampling), drawn
from a generator seeded by `--seed`: the same seed, prompt and weights give the same text.
Generation stops at the tokenizer's end-of-text id or after `--max-new-tokens`.
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
from torchmoe.components.initial_load import load_initial_weights
from torchmoe.config import ConfigError, JobConfig
from torchmoe.config.flags import split_flags
from torchmoe.data.tokenizer import build_tokenizer
from torchmoe.models.llama4 import Transformer
from torchmoe.nn.dtypes import torch_dtype
from torchmoe.nn.kv_cache import KVCache
from torchmoe.plan.memory import compute_dtype
from torchmoe.preflight import train_device

__all__ = ["Sampling", "generate_ids", "generate_main", "load_trained_model", "next_token"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen (`next_token`)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the most likely tokens until their probability reaches top_p
    seed: int = 0


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits: (B, V) of the last position -> the chosen ids (B,) int64."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the tokens more likely than it hold less than top_p: the most
        # likely one always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
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
    position over the cache."""
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
        chosen = next_token(logits, sampling, generator)  # (1,)
        out.append(int(chosen[0]))  # a host read per token: the loop needs the id to stop
        if on_token is not None:
            on_token(out[-1])
        if out[-1] == eos_id:
            break
        tokens = chosen.view(1, 1)
    return out


def load_trained_model(cfg: JobConfig, folder: Path, *, in_hf: bool) -> Transformer:
    """The job's model on its training device in eval mode, holding the weights in `folder` (a
    Hugging Face folder when `in_hf`, else a DCP one: `components.trained_weights`), computing in
    training's compute dtype."""
    args = model_args_from_config(cfg.model)
    device = train_device(cfg.training.device)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed, buffer_device=device)  # the buffers; weights come next
    ckpt = dataclasses.replace(cfg.checkpoint, initial_load_path=str(folder), initial_load_in_hf=in_hf)
    with warnings.catch_warnings():
        # DCP says it assumes one process when no process group exists: here that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_initial_weights(ckpt, cfg.model.flavor, args, model, key="--checkpoint")
    dtype = torch_dtype(compute_dtype(cfg.training))
    model.autocast_dtype = None if dtype == torch.float32 else dtype
    logger.info("generating from %s", folder)
    return model.eval()


_FLAGS = {"--checkpoint": str, "--step": int, "--prompt": str, "--max-new-tokens": int, "--temperature": float,
          "--top-p": float, "--seed": int}

GENERATE_DESCRIPTION = (
    "Sample text from trained weights: those of --checkpoint (a step-N folder, a DCP folder or a Hugging Face "
    "folder), or else the newest checkpoint of the run in --job.dump_folder (--step N picks one). The model and "
    "tokenizer are the weights' own (the run's config.toml, the folder's config.json), else the job file's "
    "(--config, optional with a run's weights). Own flags: --prompt TEXT (required), --max-new-tokens N (128), "
    "--temperature T (0: greedy), --top-p P (1.0), --seed S (0). Every other flag overrides the job as in "
    "`torchmoe train`.")


def _sampling(found: dict[str, object]) -> Sampling:
    """The `Sampling` the flags ask for, each value checked."""
    sampling = Sampling(**{k[2:].replace("-", "_"): v for k, v in found.items()
                           if k in ("--max-new-tokens", "--temperature", "--top-p", "--seed")})
    if sampling.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", sampling.max_new_tokens, "must be at least 1", "pass e.g. 64")
    if not sampling.temperature >= 0 or sampling.temperature == float("inf"):
        raise ConfigError("--temperature", sampling.temperature, "must be a finite number >= 0",
                          "pass 0 for greedy decoding, or e.g. 0.8")
    if not 0 < sampling.top_p <= 1:
        raise ConfigError("--top-p", sampling.top_p, "must be in (0, 1]",
                          "pass e.g. 0.9, or 1 to sample from all tokens")
    return sampling


def generate_main(argv: list[str], load_config: Callable[..., tuple[JobConfig, Path, bool] | int]) -> int:
    """`torchmoe generate`: print the prompt and what the model writes after it, as it comes.

    `load_config(argv, prog, description, checkpoint=..., step=...)` parses the job file and its
    overrides as `train` does and finds the weights (`--checkpoint`, `--step`): (the job with the
    weights' model, their folder, whether it is a Hugging Face one), or an int when --help was
    printed (the exit status)."""
    found, rest = split_flags(argv, _FLAGS)
    loaded = load_config(rest, "torchmoe generate", GENERATE_DESCRIPTION, checkpoint=str(found.get("--checkpoint", "")),
                         step=found.get("--step"))
    if isinstance(loaded, int):
        return loaded
    cfg, folder, in_hf = loaded
    if "--prompt" not in found:
        raise ConfigError("--prompt", "(not given)", "is required",
                          'pass the text to continue, e.g. --prompt "def main("')
    sampling = _sampling(found)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path, key="model.tokenizer_path")
    prompt = ([tokenizer.bos_id] if cfg.training.add_bos and tokenizer.bos_id is not None else []) \
        + tokenizer.encode(str(found["--prompt"]))
    if not prompt:
        raise ConfigError("--prompt", "", "encodes to no tokens", 'pass text to continue, e.g. --prompt "The"')
    model = load_trained_model(cfg, folder, in_hf=in_hf)
    limit = model.args.max_seq_len
    if len(prompt) + sampling.max_new_tokens > limit:
        raise ConfigError("--max-new-tokens", sampling.max_new_tokens,
                          f"with the prompt's {len(prompt)} tokens it passes the model's {limit} positions "
                          "(model.max_seq_len)", f"pass at most {max(limit - len(prompt), 0)}, or a shorter prompt")
    sys.stdout.write(str(found["--prompt"]))
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

    generate_ids(model, prompt, sampling, eos_id=tokenizer.eos_id, on_token=show)
    text = tokenizer.decode(ids)
    sys.stdout.write(text[len(shown):] + "\n" if text.startswith(shown) else "\n")
    return 0
