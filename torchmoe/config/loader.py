"""Build a `JobConfig` from a TOML file plus `--section.key VALUE` overrides (the file alone, and
writing one back: `config.job_file`).

    python -c "from torchmoe.config import load_job_config; print(load_job_config(['--training.steps=5']))"

Precedence is flag > TOML > dataclass default (DESIGN §3): the TOML file is turned into a
`JobConfig` first and handed to tyro as its default, so `--help` shows every option with its
docstring and the value this job would actually use. Every mistake a user can make here raises
`ConfigError`; tyro only ever sees arguments that were already checked, so its own error boxes
never appear.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from torchmoe.config.datasets import default_document_masking
from torchmoe.config.dependent_keys import check_dependent_keys
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.nesting import toml_loads
from torchmoe.config.files.paths import READ_KEYS, nonempty_path
from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_file import (
    HELP_HINT,
    PATHS_INSIDE,
    add_note,
    closest_key,
    config_fields,
    job_config_from_dict,
    parse_bool,
    parse_scalar,
    read_toml,
    refuse_invisible,
)
from torchmoe.config.numbers import INT64_MAX, INT64_MIN, shown_text
from torchmoe.config.torchtitan import TORCHTITAN_KEYS, translate
from torchmoe.config.unset import UNSET_WORD, is_optional, optional_keys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


_HELP_FLAGS = ("-h", "--help")
# torchtitan names its job file with a flag of its [job] section; both spellings mean --config.
CONFIG_FLAGS = ("--config", "--job.config_file", "--job.config-file")


# ---- command-line overrides ------------------------------------------------------------------


# What each path the run reads means when it is not set.
_UNSET = {"model.hf_assets_path": "no Hugging Face folder", "model.tokenizer_path": "the byte tokenizer",
          "checkpoint.initial_load_path": "random initial weights", "training.dataset_path": "no dataset files",
          "validation.dataset_path": "no dataset files"}


# tyro's stock bool parser only takes "True"/"False"; DESIGN §3 promises true/false, any case.
# Nested lists are shown as one comma-separated value per inner list, as `_check_override` reads them.
_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _nested_list_rule(type_info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    if type_info.type != list[list[str]]:
        return None
    return PrimitiveConstructorSpec(
        nargs="*",
        metavar="A,B ...",
        instance_from_str=lambda args: [a.split(",") for a in args],
        is_instance=lambda x: isinstance(x, list),
        str_from_instance=lambda x: [",".join(v) for v in x],
    )


@_REGISTRY.primitive_rule
def _bool_rule(type_info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    if type_info.type is not bool:
        return None
    return PrimitiveConstructorSpec(
        nargs=1,
        metavar="{true,false}",
        instance_from_str=lambda args: parse_bool(args[0]),
        is_instance=lambda x: isinstance(x, bool),
        str_from_instance=lambda x: ["true" if x else "false"],
    )


def _check_override(flag: str, values: list[str]) -> tuple[dict[str, Any], str | None]:
    """Check one ``--section.key`` override: the ``{"section.key": typed value}`` it sets (several
    for a torchtitan key mapped onto torchmoe's, none for one without effect) and a warning line.

    Raises:
        ConfigError: unknown flag (with the closest valid one), wrong number of values, or a value
            that does not parse as the field's type.
    """
    name = flag[2:].replace("-", "_")
    section, _, leaf = name.partition(".")
    typ = config_fields().get(section, {}).get(leaf)
    torchtitan = typ is None and name in TORCHTITAN_KEYS
    if torchtitan:
        typ = TORCHTITAN_KEYS[name].typ
    if typ is None:
        match = closest_key(name)
        fix = f"did you mean --{match}?" if match else HELP_HINT
        raise ConfigError(flag, " ".join(values), "unknown option", fix)
    value = _parse_override(flag, name, typ, values)
    if name in PATHS_INSIDE:
        refuse_invisible(flag, value, value if isinstance(value, list) else [value])
    return translate(name, value) if torchtitan else ({name: value}, None)


# A list flag also takes the value as the job's TOML writes it (``["attention", "experts"]``):
# what a user copies from a config file, and which a comma split would take for a list of
# bracketed, quoted names.
_LIST_TYPES = {list[str]: ("strings", '["a", "b"]'), list[float]: ("numbers", "[3.4445, -4.775, 2.0315]"),
               list[list[str]]: ("arrays of strings", '[["a", "b"], ["c"]]')}


def _toml_array(flag: str, name: str, typ: Any, value: str) -> list:
    """`value`, a TOML array, as the list flag `flag`'s `typ` value."""
    what, example = _LIST_TYPES[typ]
    fix = f"pass a TOML array, e.g. --{name} '{example}', or the values comma-separated"
    try:
        items = toml_loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(flag, value, f"not a TOML array ({err})", fix) from None
    if not isinstance(items, list) or not all(_is_item(typ, i) for i in items):
        raise ConfigError(flag, value, f"expected an array of {what}", fix)
    return [float(i) for i in items] if typ == list[float] else items


def _is_item(typ: Any, item: Any) -> bool:
    """Whether `item` of a TOML array is one of list type `typ`'s elements."""
    if typ == list[str]:
        return isinstance(item, str)
    if typ == list[float]:
        return isinstance(item, (int, float)) and not isinstance(item, bool)
    return isinstance(item, list) and all(isinstance(s, str) for s in item)


def _parse_override(flag: str, name: str, typ: Any, values: list[str]) -> Any:
    """The command-line `values` of `flag` as a `typ` value."""
    if typ in _LIST_TYPES and len(values) == 1 and values[0].lstrip().startswith("["):
        return _toml_array(flag, name, typ, values[0])
    if typ == list[str]:  # several values, or one comma-separated (torchtitan's form)
        return [item.strip() for v in values for item in v.split(",") if item.strip()]
    if typ == list[list[str]]:  # one value per inner list, its items comma-separated
        return [[item.strip() for item in v.split(",") if item.strip()] for v in values]
    if typ == list[float]:  # several values, or one comma-separated
        items = [item.strip() for v in values for item in v.split(",") if item.strip()]
        try:
            return [float(item) for item in items]
        except ValueError:
            raise ConfigError(flag, " ".join(values), "expected numbers",
                              f"pass numbers, e.g. --{name} 3.4445 -4.775 2.0315") from None
    if typ is bool and not values:  # a bare boolean flag means true
        return True
    if len(values) != 1:
        got = "no value" if not values else f"{len(values)} values ({' '.join(values)})"
        raise ConfigError(flag, " ".join(values), f"expects exactly one value, got {got}",
                          f"pass one value: --{name} VALUE (or --{name}=VALUE)")
    try:
        return parse_scalar(values[0], typ)
    except ValueError:
        expected = {bool: "true or false", int: "an integer", float: "a number"}[typ]
        section, _, leaf = name.partition(".")
        default = getattr(getattr(JobConfig(), section), leaf) if name not in TORCHTITAN_KEYS else None
        example = show_value(default if default is not None else typ(1))
        # Digits past Python's digit limit (4,300) fail int() too: that integer is only too long.
        problem = f"does not fit in 64 bits (allowed: {INT64_MIN} .. {INT64_MAX})" \
            if typ is int and values[0].lstrip("+-").isdecimal() else f"expected {expected}"
        raise ConfigError(flag, shown_text(values[0]), problem, f"pass {expected}, e.g. --{name} {example}") from None


def _split_args(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, list[str]]], bool]:
    """Split argv into (config path, [(flag, values)], help requested).

    A flag is any token starting with ``--``; the tokens after it up to the next flag are its
    values (so negative numbers such as ``-1`` stay values). ``--flag=value`` is one value.
    """
    config_path: str | None = None
    overrides: list[tuple[str, list[str]]] = []
    wants_help = False
    for token in argv:
        if token in _HELP_FLAGS:
            wants_help = True
        elif token.startswith("--"):
            flag, eq, value = token.partition("=")
            overrides.append((flag, [value] if eq else []))
        elif overrides:
            overrides[-1][1].append(token)
        else:
            fix = f"pass it as --config {token}" if token.endswith(".toml") else \
                f"options look like --section.key VALUE; {HELP_HINT}"
            raise ConfigError("argument", token, "unexpected positional argument", fix)
    remaining = []
    for flag, values in overrides:
        if flag not in CONFIG_FLAGS:
            remaining.append((flag, values))
        elif config_path is not None:
            raise ConfigError("--config", " ".join(values), "given more than once", "pass a single --config FILE")
        elif len(values) != 1:
            raise ConfigError("--config", " ".join(values), "expects exactly one file",
                              "pass --config FILE, e.g. --config configs/debug_model.toml")
        else:
            config_path = nonempty_path("--config", values[0], "pass --config FILE, e.g. --config "
                                        "configs/debug_model.toml", means="the current directory (not a file)")
    return config_path, remaining, wants_help


def load_job_config(argv: Sequence[str], *, prog: str = "torchmoe train", description: str | None = None,
                    notes: list[str] | None = None, set_keys: set[str] | None = None,
                    runs_with: Mapping[str, Any] | None = None) -> JobConfig:
    """Parse ``[--config FILE] [--section.key VALUE | --section.key=VALUE ...]`` into a `JobConfig`.

    Values come from the flag, else the TOML file, else the dataclass default. List fields take
    any number of values (``--float8.filter_fqns output router``); booleans take true/false (a
    bare boolean flag means true). The result is not validated: call `torchmoe.preflight.validate_job_config`.

    With ``-h``/``--help`` in argv, prints the help (every option, its docstring and the
    effective default under this TOML file) and raises ``SystemExit(0)`` like argparse.

    ``--section.key none`` unsets an optional key (`optional_keys`): the file's value is dropped,
    and the key counts as not set.

    A key that does nothing in this job (`dependent_keys`: ``--lora.rank`` without
    ``--lora.enable true``) is a `ConfigError` as a flag, and a warning line in the job file
    (none for a run's own config.toml).

    torchtitan's keys and its ``--job.config_file`` are accepted too (`torchmoe.config.torchtitan`);
    their warning lines go to `notes` (logged when None). `model.hf_assets_path` then fills
    `model.tokenizer_path` and, with `checkpoint.initial_load_in_hf`, `checkpoint.initial_load_path`
    where those are empty, so the resolved config says what is read. A key whose default depends
    on another (`training.document_masking` on the dataset: `config.datasets`) takes it here,
    when neither the file nor a flag sets it.

    Args:
        argv: the arguments after the subcommand.
        prog: program name shown in the help.
        description: text shown at the top of the help.
        notes: collects the warnings about torchtitan keys without effect here.
        set_keys: collects the ``section.key`` names the file or a flag sets (torchtitan keys as
            the torchmoe keys they set): what `torchmoe plan` keeps fixed.
        runs_with: settings the command applies whatever the job says, for the check of keys
            without effect (``torchmoe eval`` reads [validation] with validation.enable false).

    Raises:
        ConfigError: any user error in the file or the flags.
    """
    config_path, overrides, wants_help = _split_args(argv)
    in_file: dict[str, str] = {}  # section.key -> its name in the file
    resolved = False  # the file is a run's own config.toml
    base = JobConfig()
    if config_path is not None:
        data, resolved = read_toml(config_path, "--config")
        base = job_config_from_dict(data, notes=notes, names=in_file)
    if wants_help:
        # tyro renders the help from the dataclasses, their docstrings and the TOML's values.
        tyro.cli(JobConfig, prog=prog, description=description, args=["--help"],
                 default=_with_dependent_defaults(base, in_file),
                 use_underscores=True, config=(tyro.conf.FlagConversionOff,), registry=_REGISTRY)
    # Overrides are applied here rather than by tyro's argparse, which would take a value that
    # starts with "-" (a path, a description) for a flag and fail outside our one-message errors.
    updates: dict[str, dict[str, Any]] = {}
    by_flag: dict[str, tuple[str, Any]] = {}  # key -> the flag that set it, and to what
    unset: set[str] = set()  # keys a flag unset (`UNSET_WORD`)
    for flag, values in overrides:
        name = flag[2:].replace("-", "_")
        if values == [UNSET_WORD] and is_optional(name):
            values_set, note = {name: UNSET_WORD}, None
        else:
            values_set, note = _check_override(flag, values)
        add_note(notes, note)
        for dotted, value in values_set.items():
            # Two flags for one key (torchtitan's name and torchmoe's: --model.attn_mask_type
            # block_causal --training.document_masking false): the later one won silently.
            other, said = by_flag.get(dotted, (flag, value))
            if other != flag and said != value:
                raise ConfigError(flag, " ".join(values), f"contradicts {other} on the same command line, which sets "
                                  f"{dotted} to {show_value(said)} (this flag sets it to {show_value(value)})",
                                  "pass one of the two flags")
            by_flag[dotted] = (flag, value)
            unset.discard(dotted)
            if value == UNSET_WORD and is_optional(name):
                unset.add(dotted)
                value = optional_keys()[dotted]
            elif dotted in READ_KEYS:
                # "" (a TOML's "not set") from a flag is what an unset shell variable gives, so a
                # flag unsets the key with a word instead: `none` (a folder of that name is ./none).
                nonempty_path(flag, value, f"pass the path, or `{flag} {UNSET_WORD}` to unset it "
                              f"(what \"\" means in a TOML file)", means=f"{dotted} not set ({_UNSET[dotted]})")
            section, _, leaf = dotted.partition(".")
            updates.setdefault(section, {})[leaf] = value
    cfg = dataclasses.replace(base, **{s: dataclasses.replace(getattr(base, s), **kv) for s, kv in updates.items()})
    cfg = _with_hf_assets(cfg)
    flags = {key: flag for key, (flag, _) in by_flag.items() if key not in unset}
    in_file = {key: name for key, name in in_file.items() if key not in unset}
    if set_keys is not None:
        set_keys.update(in_file, flags)
    cfg = _with_dependent_defaults(cfg, {*in_file, *flags})
    for line in check_dependent_keys(cfg, flags=flags, file={} if resolved else in_file, runs_with=runs_with):
        add_note(notes, line)
    return cfg


def _with_dependent_defaults(cfg: JobConfig, explicit: Collection[str]) -> JobConfig:
    """`cfg` with the defaults that depend on another key, where the keys are not in `explicit`:
    `training.document_masking` on for data of separate examples (`config.datasets`)."""
    if "training.document_masking" in explicit:
        return cfg
    training = dataclasses.replace(cfg.training, document_masking=default_document_masking(cfg.training))
    return dataclasses.replace(cfg, training=training)


def _with_hf_assets(cfg: JobConfig) -> JobConfig:
    """`model.hf_assets_path` (torchtitan's one folder of tokenizer, config and weights) filling
    the tokenizer and the Hugging Face weights to load where they are not given."""
    assets = cfg.model.hf_assets_path
    if not assets:
        return cfg
    model = cfg.model if cfg.model.tokenizer_path else dataclasses.replace(cfg.model, tokenizer_path=assets)
    ckpt = cfg.checkpoint
    if ckpt.initial_load_in_hf and not ckpt.initial_load_path:
        ckpt = dataclasses.replace(ckpt, initial_load_path=assets)
    return dataclasses.replace(cfg, model=model, checkpoint=ckpt)
