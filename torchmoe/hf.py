"""Public Hugging Face API: load a Llama 4 checkpoint into torchmoe, save torchmoe as one.

    from torchmoe.hf import load_model, save_model
    model = load_model("path/to/Llama-4-Scout-17B-16E-Instruct", dtype=torch.bfloat16)
    logits = model(tokens)                       # (batch, seq, vocab), equal to transformers'
    save_model(model, "out/hf")                  # transformers loads it with identical logits

Loading streams tensor by tensor: it never holds more than the model plus one checkpoint
tensor. Saving converts and writes one shard at a time, from the model's full state (which a
sharded model gathers first).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torchmoe.models.llama4.hf import (
    HFConversionError,
    args_from_hf_config,
    hf_config_from_args,
    hf_to_torchmoe,
    torchmoe_to_hf,
)
from torchmoe.models.llama4.args import ModelArgs
from torchmoe.models.llama4.model import Transformer

__all__ = ["HFConversionError", "iter_hf_state", "load_hf_state_dict", "load_model", "save_model",
           "save_state_dict_as_hf"]

_DEFAULT_SHARD_BYTES = 5 * 1024**3


def _safetensors_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [hf_dir / n for n in names]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    return files


def iter_hf_state(hf_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every text-model tensor of a Hugging Face Llama 4 folder, read one
    checkpoint tensor at a time (vision tensors skipped, fused experts split)."""
    for path in _safetensors_files(Path(hf_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield from hf_to_torchmoe(key, f.get_tensor(key))


def load_hf_state_dict(hf_dir: str | os.PathLike, model: Transformer) -> None:
    """Copy the weights of a Hugging Face Llama 4 folder into `model`'s parameters in place,
    casting to each parameter's dtype. Every parameter must be covered; unknown text-model
    tensors are an error."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in iter_hf_state(hf_dir):
            if name == "output.weight" and model.output is None:
                continue  # tied: HF may store the head although it is the embedding
            if name not in params:
                raise HFConversionError(f"the checkpoint's {name!r} has no place in this model")
            if params[name].shape != tensor.shape:
                raise HFConversionError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise HFConversionError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Transformer:
    """A torchmoe `Transformer` (CPU, eval mode, parameters in `dtype`) from a Hugging Face Llama 4
    text or multimodal checkpoint folder (config.json + *.safetensors)."""
    hf_dir = Path(hf_dir)
    args = args_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    with torch.device("meta"):
        model = Transformer(args)
    for p in model.parameters():  # parameters in `dtype`; buffers keep their own (fp32, complex)
        p.data = p.data.to(dtype)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_hf_state_dict(hf_dir, model)
    return model.eval()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save_model(model: Transformer, out_dir: str | os.PathLike, *, max_shard_bytes: int = _DEFAULT_SHARD_BYTES) -> None:
    """Write `model` as a Hugging Face ``Llama4ForCausalLM`` folder: config.json plus safetensors
    shards of at most `max_shard_bytes` (with model.safetensors.index.json when more than one).

    The aux-loss-free expert bias has no Hugging Face counterpart: a non-zero bias is dropped with
    a warning, since HF routing then selects experts without it.
    """
    state = {k: _full(v) for k, v in model.state_dict().items()}
    save_state_dict_as_hf(state, model.args, out_dir, max_shard_bytes=max_shard_bytes)


def save_state_dict_as_hf(state: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike, *,
                          max_shard_bytes: int = _DEFAULT_SHARD_BYTES) -> None:
    """`save_model` for a full (unsharded) torchmoe state dict, e.g. gathered from a sharded
    model by the trainer."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bias_max = max((state[k].abs().max().item() for k in state if k.endswith("expert_bias")), default=0.0)
    if bias_max > 0:
        warnings.warn(f"expert_bias (max |bias| {bias_max:.3g}) is not representable in Hugging Face Llama 4 "
                      "and is dropped: expert selection there ignores it", stacklevel=3)
    dtype = state["tok_embeddings.weight"].dtype
    config = hf_config_from_args(args, dtype)

    # Shards are written as they fill (bounding memory) under temporary names, then renamed once
    # their count is known, as HF's "model-0000i-of-0000n" names require.
    part: dict[str, torch.Tensor] = {}
    part_bytes, n_parts, shard_of = 0, 0, {}
    total = 0

    def flush() -> None:
        nonlocal part, part_bytes, n_parts
        save_file(part, str(out_dir / f".part-{n_parts}.safetensors"), metadata={"format": "pt"})
        n_parts += 1
        part, part_bytes = {}, 0

    for name, tensor in torchmoe_to_hf(state):
        size = tensor.numel() * tensor.element_size()
        if part and part_bytes + size > max_shard_bytes:
            flush()
        part[name] = tensor.detach().to("cpu").contiguous()
        shard_of[name] = n_parts
        part_bytes += size
        total += size
    flush()

    names = ["model.safetensors"] if n_parts == 1 else [
        f"model-{i + 1:05d}-of-{n_parts:05d}.safetensors" for i in range(n_parts)]
    for i, final in enumerate(names):
        os.replace(out_dir / f".part-{i}.safetensors", out_dir / final)
    if n_parts > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in shard_of.items()}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
