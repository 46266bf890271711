"""Llama 4 text model: arguments and flavors, the transformer, MoE, and the HF mapping."""

from torchmoe.arch.llama4 import FLAVORS, ModelArgs, build_model_args
from torchmoe.models.llama4.model import Transformer
from torchmoe.models.llama4.moe import MoE, update_expert_bias

__all__ = ["FLAVORS", "ModelArgs", "MoE", "Transformer", "build_model_args", "update_expert_bias"]
