"""Public Hugging Face API: load a checkpoint of a family torchmoe trains (Llama 4, Qwen3-MoE,
DeepSeek-V3, gpt-oss) into torchmoe, save torchmoe as one.

    from torchmoe.hf import load_model, save_model
    model = load_model("path/to/Llama-4-Scout-17B-16E-Instruct", dtype=torch.bfloat16)
    model = load_model("path/to/Qwen3-30B-A3B")  # the family is config.json's model_type
    logits = model(tokens)                       # (batch, seq, vocab), equal to transformers'
    save_model(model, "out/hf")                  # transformers loads it with identical logits

Both go through DCP's Hugging Face storage (`hf_files/hf_storage.py`): loading reads each
tensor straight into the model's parameters; saving writes the model's (possibly sharded)
parameters as they are. A sharded model saves collectively, each rank writing its shards.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from torchmoe.hf_files.hf_storage import (
    DEFAULT_SHARD_BYTES,
    ExpertBiasDrop,
    load_hf_weights,
    read_hf_args,
    save_hf_weights,
)
from torchmoe.models.decoder.model import Transformer
from torchmoe.models.hf_config_spec import HFConversionError
from torchmoe.models.registry import family_titles

__all__ = ["HFConversionError", "load_model", "save_model"]

_FIX = ("pass a complete Hugging Face checkpoint folder of a family torchmoe trains (config.json + *.safetensors): "
        f"{family_titles()}")


def load_model(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Transformer:
    """A torchmoe `Transformer` (CPU, eval mode, parameters in `dtype`) from a Hugging Face
    checkpoint folder (config.json + *.safetensors) of a family torchmoe trains, detected from
    config.json's ``model_type`` (`models.registry`).

    Raises:
        ConfigError: (naming ``hf_dir``) a file of the folder is missing, unreadable or damaged,
            or it is not a checkpoint this model can represent.
    """
    hf_dir = Path(hf_dir)
    args = read_hf_args(hf_dir, key="hf_dir", fix=_FIX)
    with torch.device("meta"):
        model = Transformer(args)
    for p in model.parameters():  # parameters in `dtype`; buffers keep their own (fp32, complex)
        p.data = p.data.to(dtype)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_hf_weights(model.state_dict(), hf_dir, args, key="hf_dir", fix=_FIX)
    return model.eval()


def save_model(model: Transformer, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               drop_expert_bias: bool = False) -> None:
    """Write `model` as a Hugging Face folder of its family (``Llama4ForCausalLM``,
    ``Qwen3MoeForCausalLM``, ...): config.json plus safetensors files of at most `max_shard_bytes`
    with model.safetensors.index.json, which transformers loads as the same model.

    Raises:
        ConfigError: (naming ``drop_expert_bias``, before anything is written) the model holds a
            non-zero aux-loss-free expert bias, which the Hugging Face models of Llama 4, Qwen3-MoE
            and gpt-oss have no place for: the folder would select other experts. With
            `drop_expert_bias` the model is written without it (a warning says so).
    """
    save_hf_weights(model.state_dict(), model.args, out_dir, max_shard_bytes=max_shard_bytes,
                    bias_drop=ExpertBiasDrop(allowed=drop_expert_bias))
