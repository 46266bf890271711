"""Llama 4 text models: the flavors, the shared decoder they build (`models.decoder`), and the HF mapping
(`hf.py`)."""

from torchmoe.arch.llama4 import FLAVORS
from torchmoe.arch.model_args import ModelArgs
from torchmoe.models.decoder.model import Transformer
from torchmoe.models.decoder.moe import MoE, update_expert_bias

__all__ = ["FLAVORS", "ModelArgs", "MoE", "Transformer", "update_expert_bias"]
