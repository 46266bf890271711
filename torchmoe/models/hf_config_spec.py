"""Checking a Hugging Face config.json's values before a model is built from them: the shared part.

    check_fields(FIELDS, cfg, prefix)     # raises HFConfigValueError naming the first bad field

Each family's mapping (``models/<family>/hf_config_check.py``) lists the fields it reads with
what each may hold (`Spec`): its JSON type (an integer where an integer is meant: not "512",
512.0, true or null) and its range (sizes at least 1, and at most a bound far beyond any
released model, so that a typo such as 10**12 layers is refused before a model of that size is
built). Hugging Face's own config classes check little of this, so a bad file otherwise fails
deep in the model with a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DECODER_FIELDS", "IGNORED_FIELDS", "ROPE_FIELDS", "HFConfigValueError", "HFConversionError", "POSITIVE",
           "Spec", "check_config", "check_fields", "check_heads", "check_layer_list", "check_top_k", "decoder_config",
           "require_round_trip", "refuse_unknown_fields", "rope_or_yarn", "show_json", "with_reference_defaults"]

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
class Spec:
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


POSITIVE = Spec("number", low=0, low_open=True)

# The fields every family's config.json spells alike (a decoder's shape), with what each may hold;
# each family adds its own.
DECODER_FIELDS: dict[str, Spec] = {
    "num_hidden_layers": Spec("int", high=MAX_LAYERS),
    "hidden_size": Spec("int", high=MAX_SIZE),
    "num_attention_heads": Spec("int", high=MAX_HEADS),
    "num_key_value_heads": Spec("int", high=MAX_HEADS, null=True),  # null: one per query head
    "head_dim": Spec("int", low=2, high=MAX_SIZE, null=True),  # null: hidden_size / heads
    "vocab_size": Spec("int", high=MAX_VOCAB),
    "rms_norm_eps": POSITIVE,
    "max_position_embeddings": Spec("int", high=MAX_INT32),
    "rope_theta": POSITIVE,
    "rope_parameters": Spec("object", null=True),
    "rope_scaling": Spec("object", null=True),
    "intermediate_size": Spec("int", high=MAX_SIZE),
    "num_experts_per_tok": Spec("int", high=MAX_EXPERTS),
    "tie_word_embeddings": Spec("bool"),
    "attention_bias": Spec("bool"),
    "model_type": Spec("str"),
    "hidden_act": Spec("str"),
}


# Fields no family's forward pass reads (token ids, generation, dropout, output switches, loader
# metadata); each family's mapping adds its own.
IGNORED_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "output_router_logits", "initializer_range", "attention_dropout", "name_or_path",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "use_bfloat16", "torchscript",
    "chunk_size_feed_forward",
})
# A `rope_parameters` (or `rope_scaling`) object: plain RoPE or YaRN.
ROPE_FIELDS: dict[str, Spec] = {
    "rope_type": Spec("str"), "type": Spec("str"), "rope_theta": POSITIVE, "factor": POSITIVE,
    "original_max_position_embeddings": Spec("int", high=MAX_INT32), "beta_fast": POSITIVE, "beta_slow": POSITIVE,
    "mscale": Spec("number", low=None, null=True), "mscale_all_dim": Spec("number", low=None, null=True),
    "attention_factor": Spec("number", low=0, low_open=True, null=True), "truncate": Spec("bool"),
}


def rope_or_yarn(cfg: dict, title: str, default_theta: float, released: str,
                 default: dict | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a config: plain RoPE (None), or YaRN with the fields
    `_yarn_frequencies` reads; `released` names the released values for a missing field's fix;
    `default` is the RoPE object transformers' config class sets when the file has none (gpt-oss's
    YaRN; None: plain RoPE), `default_theta` its theta when neither says one.
    Raises `HFConversionError` for another rope_type, `HFConfigValueError` for a missing field."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or default or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise HFConversionError(f"rope_type {rope_type!r} is not supported for {title} ('default' or 'yarn')")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in params:
            raise HFConfigValueError(f"rope_parameters.{name}", None, "is missing: YaRN needs it",
                                     f"the released value ({released})")
    scaling = {"rope_type": "yarn", "factor": float(params["factor"]),
               "original_max_position_embeddings": params["original_max_position_embeddings"],
               "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0)}
    scaling.update({k: params[k] for k in ("mscale", "mscale_all_dim", "attention_factor", "truncate")
                    if params.get(k) is not None})
    return theta, scaling


def with_reference_defaults(cfg: dict, defaults: dict[str, Any], check: Callable[[dict], None],
                            prefix: str = "") -> dict:
    """`cfg` with each field of `defaults` that it lacks set to `defaults`' value, the one
    transformers' config class gives a missing field (a field that holds null keeps it:
    transformers then derives a value, as the family's reading does), checked by `check`. A fault
    of a field the file lacks says that the value is that default (`prefix`: where `cfg` is in
    the file, as the fields' names spell it)."""
    full = {**defaults, **cfg}
    try:
        check(full)
    except HFConfigValueError as err:
        name = err.field.removeprefix(prefix)
        if name in defaults and name not in cfg:
            raise HFConfigValueError(err.field, err.value, f"{err.problem} (transformers' default: the file does not "
                                     "set it)", err.expected) from None
        raise
    return full


def check_config(cfg: dict, fields: dict[str, Spec], rope_fields: dict[str, Spec]) -> None:
    """`check_fields` of a config's top level and of its RoPE object (`rope_parameters`, or the
    older `rope_scaling`)."""
    check_fields(fields, cfg, "")
    for rope in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(rope), dict):
            check_fields(rope_fields, cfg[rope], f"{rope}.")


def check_top_k(top_k: int, experts: int, experts_field: str) -> None:
    """Raise `HFConfigValueError` unless num_experts_per_tok (`top_k`) fits the `experts` that
    `experts_field` counts."""
    if top_k > experts:
        raise HFConfigValueError("num_experts_per_tok", top_k, f"more than the {experts} experts ({experts_field})",
                                 f"an integer from 1 to {experts}")


def refuse_unknown_fields(cfg: dict, known: set[str] | frozenset[str], config_class: str) -> None:
    """Raise `HFConversionError` naming the fields of `cfg` outside `known` (and not private, "_x"):
    a field torchmoe does not read may change what the model computes."""
    unknown = sorted(k for k in cfg if k not in known and not k.startswith("_"))
    if unknown:
        raise HFConversionError(f"unsupported {config_class} fields: {', '.join(unknown)}")


def decoder_config(args: Any, dtype: Any) -> dict:
    """The `DECODER_FIELDS` part of a config.json for `args` (a `ModelArgs`) in `dtype` (a torch
    dtype): what every family writes alike."""
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
    }


def require_round_trip(args: Any, config: dict, read: Callable[[dict], Any], title: str) -> dict:
    """`config`, the config.json written for `args` (a `ModelArgs`), if reading it back (`read`:
    the family's ``args_from_hf_config``) gives a model that computes what `args` computes;
    else `HFConversionError` naming the fields Hugging Face's `title` model cannot express."""
    differ = read(config).architecture_differences(args)
    if differ:
        raise HFConversionError(f"Hugging Face {title} cannot express these settings: {', '.join(differ)}")
    return config


def check_fields(fields: dict[str, Spec], cfg: dict, prefix: str) -> None:
    for name, spec in fields.items():
        if name in cfg and (problem := spec.fault(cfg[name])) is not None:
            raise HFConfigValueError(prefix + name, cfg[name], problem, spec.expected() + _unquoted(spec, cfg[name]))


def _unquoted(spec: Spec, value: Any) -> str:
    """", e.g. 512" for a number written in quotes ("512") that would be valid without them."""
    if type(value) is not str or spec.kind not in ("int", "number"):
        return ""
    try:
        number = int(value) if spec.kind == "int" else float(value)
    except ValueError:
        return ""
    return f", e.g. {json.dumps(number)} (without quotes)" if spec.fault(number) is None else ""


def check_layer_list(cfg: dict, name: str, prefix: str, each: str, expected: str, valid: Callable[[int], bool]) -> None:
    """A per-layer list field: each entry `valid` (`each` says which are; `expected` the list)."""
    value = cfg.get(name) or []  # null or empty: Hugging Face derives it
    bad = next((v for v in value if not valid(v)), None)
    if bad is not None:
        raise HFConfigValueError(prefix + name, value, f"holds {bad}, not {each}", expected)




def check_heads(cfg: dict, prefix: str, *, default_heads: int, default_hidden: int) -> None:
    """The attention heads agree: query heads a multiple of key/value heads, and an even head size
    (RoPE rotates pairs), whether ``head_dim`` is set or derived (hidden_size / heads)."""
    heads = cfg.get("num_attention_heads", default_heads)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise HFConfigValueError(prefix + "num_key_value_heads", kv_heads, f"the {heads} query heads "
                                 "(num_attention_heads) are not a multiple of it",
                                 f"a divisor of {heads}: {', '.join(map(str, divisors))}")
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", default_hidden) // heads
    if head_dim % 2 or head_dim < 2:
        problem = f"gives heads of {head_dim} dimensions: RoPE needs an even number"
        if cfg.get("head_dim"):
            raise HFConfigValueError(prefix + "head_dim", head_dim, problem, "an even integer")
        raise HFConfigValueError(prefix + "hidden_size", cfg.get("hidden_size", default_hidden), problem +
                                 " (hidden_size / num_attention_heads)", f"a multiple of {2 * heads} (2 x "
                                 "num_attention_heads), or set head_dim to an even integer")
