"""The values of a Hugging Face Llama 4 config.json, checked before a model is built from them.

    check_hf_config(text_config(config))     # raises HFConfigValueError naming the field

Every field `args_from_hf_config` reads is checked here, in one place: its JSON type (an integer
where an integer is meant: not "512", 512.0, true or null), its range (sizes at least 1, and at
most a bound far beyond any released model, so that a typo such as 10**12 layers is refused
before a model of that size is built), and the fields that must agree (heads divisible by
key/value heads, an even head size, top-k within the experts, per-layer lists that cover the
layers). Hugging Face's own config class checks little of this, so a bad file otherwise fails
deep in the model with a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HFConfigValueError", "HFConversionError", "check_hf_config"]

# Upper bounds: 8x the deepest released LLM's layers (126), 64x the largest vocabulary (262k), and
# sizes no accelerator could hold a layer of. A value beyond them is a typo, refused before a model
# of its size is built (Transformer on the meta device takes ~3 s per 1024 layers).
MAX_LAYERS = 1024
MAX_SIZE = 2**20  # hidden and feed-forward sizes
MAX_VOCAB = 2**24
MAX_HEADS = 2**12
MAX_EXPERTS = 2**16
MAX_INT32 = 2**31 - 1  # positions, chunk and scale lengths: indices of int32 position tensors


class HFConversionError(ValueError):
    """A Hugging Face config or checkpoint this model cannot represent exactly."""


class HFConfigValueError(HFConversionError):
    """A config.json value of the wrong type or range: `field` (dotted under ``text_config`` or
    ``rope_parameters``), its `value`, what is wrong (`problem`) and what it must be (`expected`,
    a phrase for a fix: "an integer from 1 to 1024, e.g. 48")."""

    def __init__(self, field: str, value: Any, problem: str, expected: str) -> None:
        self.field, self.value, self.problem, self.expected = field, value, problem, expected
        super().__init__(f"{field} = {show_json(value)}: {problem}")


def show_json(value: Any, limit: int = 60) -> str:
    """`value` as config.json spells it, cut to `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class _Spec:
    """What one field may hold.

    Attributes:
        kind: "int", "number" (int or float), "bool", "flag" (a boolean or a non-negative
            integer, non-zero meaning true), "str", "object", "int_list" or "str_list".
        low, high: the range of an int or a number (low None: any finite number; high None:
            unbounded); `low_open` excludes `low` (a positive number).
        null: null is allowed (it means the default Hugging Face derives).
    """

    kind: str
    low: float | None = 1
    high: float | None = None
    low_open: bool = False
    null: bool = False

    def expected(self) -> str:
        if self.kind in ("int", "number"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.low is None:
                text = f"a finite {what[2:]}"
            elif self.low_open:
                text = f"{what} > {_num(self.low)}"
            elif self.high is None:
                text = f"{what} >= {_num(self.low)}"
            else:
                text = f"{what} from {_num(self.low)} to {_num(self.high)}"
        else:
            text = {"bool": "true or false", "flag": "true or false", "str": "a string", "object": "an object {...}",
                    "int_list": "a list of integers", "str_list": "a list of strings"}[self.kind]
        return text + (", or null" if self.null else "")

    def fault(self, value: Any) -> str | None:
        """Why `value` does not fit, or None."""
        if value is None:
            return None if self.null else "null is not allowed here"
        number = type(value) in (int, float)  # type(): true and false are no numbers here
        item = {"int_list": int, "str_list": str}.get(self.kind)
        ok_type = {"int": type(value) is int, "number": number, "bool": type(value) is bool,
                   "flag": type(value) is bool or (type(value) is int and value >= 0), "str": type(value) is str,
                   "object": type(value) is dict,
                   "int_list": type(value) is list and all(type(v) is item for v in value),
                   "str_list": type(value) is list and all(type(v) is item for v in value)}[self.kind]
        if not ok_type:
            got = _kind(value)
            if item is not None and type(value) is list:
                got = f"a list holding {_kind(next(v for v in value if type(v) is not item))}"
            return f"{got}, not {self.expected()}"
        if self.kind in ("int", "number"):
            if not math.isfinite(value):
                return "not a finite number"
            if self.low is not None and (value < self.low or (self.low_open and value == self.low) or (
                    self.high is not None and value > self.high)):
                return f"out of range: expected {self.expected()}"
        return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_POSITIVE = _Spec("number", low=0, low_open=True)

# Every field of Llama4TextConfig that args_from_hf_config reads, under its Hugging Face name.
_FIELDS: dict[str, _Spec] = {
    "num_hidden_layers": _Spec("int", high=MAX_LAYERS),
    "hidden_size": _Spec("int", high=MAX_SIZE),
    "num_attention_heads": _Spec("int", high=MAX_HEADS),
    "num_key_value_heads": _Spec("int", high=MAX_HEADS, null=True),  # null: one per query head
    "head_dim": _Spec("int", low=2, high=MAX_SIZE, null=True),  # null: hidden_size / heads
    "vocab_size": _Spec("int", high=MAX_VOCAB),
    "rms_norm_eps": _POSITIVE,
    "max_position_embeddings": _Spec("int", high=MAX_INT32),
    "rope_theta": _POSITIVE,
    "rope_parameters": _Spec("object", null=True),
    "rope_scaling": _Spec("object", null=True),
    "partial_rotary_factor": _POSITIVE,
    "no_rope_layers": _Spec("int_list", null=True),
    "no_rope_layer_interval": _Spec("int", high=MAX_INT32),
    "attention_chunk_size": _Spec("int", high=MAX_INT32, null=True),  # null: full attention
    "use_qk_norm": _Spec("bool"),
    # An integer in transformers' first Llama 4 release (4: on).
    "attn_temperature_tuning": _Spec("flag"),
    "floor_scale": _Spec("int", high=MAX_INT32),
    "attn_scale": _Spec("number", low=None),
    "intermediate_size_mlp": _Spec("int", high=MAX_SIZE),
    "intermediate_size": _Spec("int", high=MAX_SIZE),
    "interleave_moe_layer_step": _Spec("int", high=MAX_INT32),
    "moe_layers": _Spec("int_list", null=True),
    "num_local_experts": _Spec("int", high=MAX_EXPERTS),
    "num_experts_per_tok": _Spec("int", high=MAX_EXPERTS),
    "tie_word_embeddings": _Spec("bool"),
    "attention_bias": _Spec("bool"),
    "model_type": _Spec("str"),
    "hidden_act": _Spec("str"),
    "layer_types": _Spec("str_list", null=True),  # what they must say: args_from_hf_config
}
# The RoPE object's fields (rope_parameters, or the older rope_scaling).
_ROPE_FIELDS: dict[str, _Spec] = {
    "rope_type": _Spec("str"), "type": _Spec("str"), "rope_theta": _POSITIVE, "partial_rotary_factor": _POSITIVE,
    "factor": _POSITIVE, "low_freq_factor": _POSITIVE, "high_freq_factor": _POSITIVE,
    "original_max_position_embeddings": _Spec("int", high=MAX_INT32),
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check(fields: dict[str, _Spec], cfg: dict, prefix: str) -> None:
    for name, spec in fields.items():
        if name in cfg and (problem := spec.fault(cfg[name])) is not None:
            raise HFConfigValueError(prefix + name, cfg[name], problem, spec.expected() + _unquoted(spec, cfg[name]))


def _unquoted(spec: _Spec, value: Any) -> str:
    """", e.g. 512" for a number written in quotes ("512") that would be valid without them."""
    if type(value) is not str or spec.kind not in ("int", "number"):
        return ""
    try:
        number = int(value) if spec.kind == "int" else float(value)
    except ValueError:
        return ""
    return f", e.g. {json.dumps(number)} (without quotes)" if spec.fault(number) is None else ""


def _layer_list(cfg: dict, name: str, prefix: str, each: str, expected: str, valid: Callable[[int], bool]) -> None:
    """A per-layer list field: each entry `valid` (`each` says which are; `expected` the list)."""
    value = cfg.get(name) or []  # null or empty: Hugging Face derives it
    bad = next((v for v in value if not valid(v)), None)
    if bad is not None:
        raise HFConfigValueError(prefix + name, value, f"holds {bad}, not {each}", expected)


def check_hf_config(cfg: dict, prefix: str = "") -> None:
    """Check every field `args_from_hf_config` reads from the text config `cfg` (see the module
    docstring); `prefix` names where `cfg` is in the file (``text_config.`` in a multimodal one).

    Raises:
        HFConfigValueError: the first field of the wrong type or range, or that disagrees with another.
    """
    _check(_FIELDS, cfg, prefix)
    for rope in ("rope_parameters", "rope_scaling"):
        params = cfg.get(rope)
        if isinstance(params, dict):
            _check(_ROPE_FIELDS, params, f"{prefix}{rope}.")
            missing = [k for k in _LLAMA3_KEYS if k not in params]
            if params.get("rope_type", params.get("type")) == "llama3" and missing:
                raise HFConfigValueError(prefix + rope, params, f"llama3 RoPE scaling needs {', '.join(missing)}",
                                         f"an object with {', '.join(_LLAMA3_KEYS)} for rope_type \"llama3\"")
    n_layers = cfg.get("num_hidden_layers", 48)
    heads = cfg.get("num_attention_heads", 40)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise HFConfigValueError(prefix + "num_key_value_heads", kv_heads, f"the {heads} query heads "
                                 "(num_attention_heads) are not a multiple of it",
                                 f"a divisor of {heads}: {', '.join(map(str, divisors))}")
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 5120) // heads
    if head_dim % 2 or head_dim < 2:  # RoPE rotates pairs
        problem = f"gives heads of {head_dim} dimensions: RoPE needs an even number"
        if cfg.get("head_dim"):
            raise HFConfigValueError(prefix + "head_dim", head_dim, problem, "an even integer")
        raise HFConfigValueError(prefix + "hidden_size", cfg.get("hidden_size", 5120), problem + " (hidden_size / "
                                 "num_attention_heads)", f"a multiple of {2 * heads} (2 x num_attention_heads), or "
                                 "set head_dim to an even integer")
    experts, top_k = cfg.get("num_local_experts", 16), cfg.get("num_experts_per_tok", 1)
    if top_k > experts:
        raise HFConfigValueError(prefix + "num_experts_per_tok", top_k, f"more than the {experts} experts "
                                 "(num_local_experts)", f"an integer from 1 to {experts}")
    _layer_list(cfg, "no_rope_layers", prefix, "0 (NoPE) or 1 (RoPE)", f"a list of {n_layers} entries, 0 or 1",
                lambda v: v in (0, 1))
    no_rope = cfg.get("no_rope_layers")
    if no_rope and len(no_rope) < n_layers:
        raise HFConfigValueError(prefix + "no_rope_layers", no_rope, f"has {len(no_rope)} entries for {n_layers} "
                                 "layers (num_hidden_layers)", f"a list of {n_layers} entries, 0 or 1")
    _layer_list(cfg, "moe_layers", prefix, f"a layer index from 0 to {n_layers - 1}",
                f"a list of layer indices from 0 to {n_layers - 1}", lambda v: 0 <= v < n_layers)
    moe = cfg.get("moe_layers") or []
    if len(set(moe)) != len(moe):
        raise HFConfigValueError(prefix + "moe_layers", moe, "names a layer twice", "a list of distinct layer indices")
