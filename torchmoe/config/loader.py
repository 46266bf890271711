"""Build a `JobConfig` from a TOML file plus `--section.key VALUE` overrides, and write one back.

    python -c "from torchmoe.config import load_job_config; print(load_job_config(['--training.steps=5']))"

Precedence is flag > TOML > dataclass default (DESIGN §3): the TOML file is turned into a
`JobConfig` first and handed to tyro as its default, so `--help` shows every option with its
docstring and the value this job would actually use. Every mistake a user can make here raises
`ConfigError`; tyro only ever sees arguments that were already checked, so its own error boxes
never appear.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import tomllib
import typing
import unicodedata
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w
import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from torchmoe.config.datasets import default_document_masking
from torchmoe.config.dependent_keys import check_dependent_keys
from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.file_writes import write_file
from torchmoe.config.job_config import JobConfig
from torchmoe.config.nesting import toml_loads
from torchmoe.config.numbers import INT64_MAX, INT64_MIN, shown_text
from torchmoe.config.paths import PATH_KEYS, READ_KEYS, nonempty_path, path_faults
from torchmoe.config.text import NotUTF8, utf8_text
from torchmoe.config.torchtitan import SECTIONS as TORCHTITAN_SECTIONS
from torchmoe.config.torchtitan import TORCHTITAN_KEYS, translate
from torchmoe.config.unset import UNSET_WORD, is_optional, optional_keys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

_HELP_FLAGS = ("-h", "--help")
# torchtitan names its job file with a flag of its [job] section; both spellings mean --config.
CONFIG_FLAGS = ("--config", "--job.config_file", "--job.config-file")
_HELP_HINT = "run `torchmoe train --help` to list every option"

# What each supported field type looks like, for "expected ..." messages.
_EXPECTED_TOML = {
    bool: "a boolean (true or false, unquoted)",
    int: "an integer",
    float: "a number",
    str: "a string (in double quotes)",
    list[str]: 'a list of strings, e.g. ["output", "router"]',
    list[float]: "a list of numbers, e.g. [3.4445, -4.775, 2.0315]",
    list[list[str]]: 'a list of lists of strings, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]',
}


# ---- the schema: every "section.key" and its type --------------------------------------------


@functools.cache
def _config_fields() -> dict[str, dict[str, Any]]:
    """``{section: {key: type}}`` for every field of `JobConfig`, in declaration order."""
    sections: dict[str, dict[str, Any]] = {}
    for section in dataclasses.fields(JobConfig):
        section_cls = typing.get_type_hints(JobConfig)[section.name]
        hints = typing.get_type_hints(section_cls)
        sections[section.name] = {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}
    return sections


def _all_keys() -> list[str]:
    """Every key a job file may hold: torchmoe's, then torchtitan's that torchmoe lacks."""
    return [*(f"{s}.{k}" for s, keys in _config_fields().items() for k in keys), *TORCHTITAN_KEYS]


def _closest_key(name: str) -> str | None:
    """The valid ``section.key`` a misspelled ``name`` most likely meant, or None.

    Tries, in order: the same key under another section (``optimizer.steps`` -> ``training.steps``,
    not ``optimizer.ns_steps``; or a bare ``steps``); a close spelling within the same section; a
    close spelling anywhere.
    """
    keys = _all_keys()
    section, _, leaf = name.rpartition(".")
    for key in keys:
        if key.rpartition(".")[2] == leaf:
            return key
    in_section = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    match = difflib.get_close_matches(leaf, in_section, n=1, cutoff=0.6)
    if match:
        return f"{section}.{match[0]}"
    match = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    return match[0] if match else None


# ---- TOML -> JobConfig -----------------------------------------------------------------------


def _toml_value(key: str, value: Any, typ: Any) -> Any:
    """Check a TOML value against the field type; TOML ints are accepted for float fields."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list[str]: isinstance(value, list) and all(isinstance(v, str) for v in value),
        list[float]: isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     for v in value),
        list[list[str]]: isinstance(value, list) and all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in value),
    }[typ]
    if not ok:
        leaf = key.rpartition(".")[2]
        fix = f"write {leaf} as {_EXPECTED_TOML[typ]}"
        if isinstance(value, str) and typ in (bool, int, float):  # quoted by mistake: show it unquoted
            try:
                fix += f", e.g. {leaf} = {show_value(_parse_scalar(value, typ))}"
            except ValueError:
                pass  # not a valid value unquoted either: no example to offer
        elif isinstance(value, str) and typ == list[str]:
            fix += f", e.g. {leaf} = {show_value([value])}"
        raise ConfigError(key, value, f"expected {_EXPECTED_TOML[typ]}, got {type(value).__name__}", fix)
    texts = [value] if isinstance(value, str) else [x for v in value for x in (v if isinstance(v, list) else [v])] \
        if isinstance(value, list) else []
    if any(isinstance(text, str) and "\x00" in text for text in texts):  # the OS refuses it in any path, Python with a ValueError
        raise ConfigError(key, value, "holds a NUL byte (\\u0000), which no path, name or text setting can contain",
                          f"remove it from {key.rpartition('.')[2]}")
    if key in _PATHS_INSIDE:
        _refuse_invisible(key, value, texts)
    return float(value) if typ is float else [float(v) for v in value] if typ == list[float] else value


# The keys whose values are or hold paths (a mixture's entries end in one).
_PATHS_INSIDE = (*PATH_KEYS, "training.dataset_mix")


def _refuse_invisible(key: str, value: Any, texts: list[str]) -> None:
    """A path holding a character that prints as nothing (a zero-width space, a direction mark,
    a control character) names a folder that looks like another: ``runs/a\u200b`` is not
    ``runs/a``, and a run writing there seems to have lost its files."""
    for text in texts:
        at = next((i for i, ch in enumerate(text) if unicodedata.category(ch) in ("Cf", "Cc")), None)
        if at is not None:
            ch = text[at]
            name = unicodedata.name(ch, "a control character")
            raise ConfigError(key, value, f"holds an invisible character, U+{ord(ch):04X} ({name}), at position "
                              f"{at}: the path looks like one without it, and is another",
                              "type the path again without it (a copy from a web page or chat can carry one)")


def _flatten(prefix: str, table: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value in `table`, nested tables included
    (torchtitan's ``[quantize.linear.float8]`` and ``[training.dataloader]``)."""
    for key, value in table.items():
        if isinstance(value, Mapping):
            yield from _flatten(f"{prefix}.{key}", value)
        else:
            yield f"{prefix}.{key}", value


def _warn(notes: list[str] | None, note: str | None) -> None:
    if note is None:
        return
    if notes is None:
        logger.warning(note)
    else:
        notes.append(note)


def _build(values: dict[str, Any]) -> JobConfig:
    """A `JobConfig` from ``{"section.key": checked value}``; keys left out keep their defaults."""
    hints = typing.get_type_hints(JobConfig)
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, _, key = dotted.partition(".")
        sections.setdefault(section, {})[key] = value
    return JobConfig(**{section: hints[section](**kv) for section, kv in sections.items()})


def job_config_from_dict(data: Mapping[str, Any], *, notes: list[str] | None = None,
                         set_keys: set[str] | None = None, names: dict[str, str] | None = None) -> JobConfig:
    """Build a `JobConfig` from parsed TOML; fields left out keep their defaults.

    torchtitan v0.2.2's keys are read through `torchmoe.config.torchtitan`: a key mapped there
    sets its torchmoe keys (a torchmoe key given as well must agree with it); a key without effect adds a
    warning line to `notes` (logged when `notes` is None) if its value asks for something.
    `set_keys` collects the torchmoe keys the file sets, `names` maps each to the key the file
    wrote (torchtitan's, for a key it maps).

    Raises:
        ConfigError: an unknown section or key (with the closest valid name), a wrong type, or a
            torchmoe key contradicting the torchtitan key mapped onto it.
    """
    fields = _config_fields()
    own: dict[str, Any] = {}
    mapped: dict[str, Any] = {}
    sources: dict[str, tuple[str, Any]] = {}  # a mapped key -> the torchtitan key and value that set it
    for section, table in data.items():
        if section not in fields and section not in TORCHTITAN_SECTIONS:
            if not isinstance(table, Mapping):
                match = _closest_key(section)
                if match:
                    home, _, leaf = match.partition(".")
                    fix = f"move it under its section: [{home}] {leaf} = ..."
                else:
                    fix = f"every key belongs to a [section]; {_HELP_HINT}"
                raise ConfigError(section, table, "top-level key outside any [section]", fix)
            match = difflib.get_close_matches(section, list(fields), n=1, cutoff=0.6)
            fix = f"did you mean [{match[0]}]?" if match else f"valid sections: {', '.join(fields)}"
            raise ConfigError(f"[{section}]", dict(table), "unknown section", fix)
        if not isinstance(table, Mapping):
            raise ConfigError(section, table, "expected a [section] table",
                              f"write it as a table: [{section}] followed by key = value lines")
        for dotted, value in _flatten(section, table):
            leaf = dotted.partition(".")[2]
            if leaf in fields.get(section, {}):
                own[dotted] = _toml_value(dotted, value, fields[section][leaf])
            elif dotted in TORCHTITAN_KEYS:
                values, note = translate(dotted, _toml_value(dotted, value, TORCHTITAN_KEYS[dotted].typ))
                mapped.update(values)
                sources.update(dict.fromkeys(values, (dotted, value)))
                _warn(notes, note)
            else:
                match = _closest_key(dotted)
                valid = fields[section] if section in fields else [
                    k.partition(".")[2] for k in TORCHTITAN_KEYS if k.startswith(f"{section}.")]
                fix = f"did you mean {match}?" if match else f"valid keys in [{section}]: {', '.join(valid)}"
                raise ConfigError(dotted, value, f"unknown key in [{section}]", fix)
    # One file asking for two things (torchtitan's attn_mask_type = "block_causal" and
    # document_masking = false): which was meant cannot be known, and one was silently dropped.
    clash = next((k for k in own if k in mapped and mapped[k] != own[k]), None)
    if clash is not None:
        other, said = sources[clash]
        raise ConfigError(clash, own[clash], f"contradicts {other} = {show_value(said)} in the same file, which "
                          f"sets {clash} to {show_value(mapped[clash])}", "keep one of the two keys")
    if set_keys is not None:
        set_keys.update(mapped, own)
    if names is not None:
        names.update({**{key: sources[key][0] for key in mapped}, **{key: key for key in own}})
    return _build({**mapped, **own})


def load_toml_config(path: str | Path, *, notes: list[str] | None = None, key: str = "--config",
                     set_keys: set[str] | None = None) -> JobConfig:
    """Read a TOML job file into a `JobConfig` (no overrides, no validation); `notes` as in
    `job_config_from_dict`; `key` names the file in messages (`torchmoe report` reads a run's).

    Raises:
        ConfigError: the file cannot be read (the OS's reason: missing, a folder, no
            permission...), is not UTF-8 (a byte order mark names its encoding: `config.text`),
            is not valid TOML (the message carries the parser's line and column), or holds an
            unknown key or a wrong type.
    """
    return job_config_from_dict(_read_toml(path, key)[0], notes=notes, set_keys=set_keys)


def _read_toml(path: str | Path, key: str) -> tuple[dict[str, Any], bool]:
    """The TOML of job file `path` (`key` names it in messages), and whether it is a run's own
    config.toml (`RESOLVED_HEADER`). Raises `ConfigError` as `load_toml_config` says."""
    path = Path(path)
    shipped = "the shipped configs are configs/debug_model.toml, configs/llama4_16e.toml, configs/llama4_128e.toml"
    with path_faults(key, str(path), f"pass a TOML job file this user can read; {shipped}"):
        raw = path.read_bytes()
    try:
        text = utf8_text(raw, nul=False)
        return toml_loads(text), text.startswith(RESOLVED_HEADER)
    except NotUTF8 as err:
        raise ConfigError(key, str(path), err.problem, err.fix(path)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(key, str(path), f"malformed TOML: {err}",
                          "fix the TOML syntax at that line (strings need double quotes, tables [section])") from None


def write_config_toml(cfg: JobConfig, path: str | Path) -> Path:
    """Write the fully resolved `cfg` as TOML (a run writes `<job.dump_folder>/config.toml`).

    The file reloads to an equal `JobConfig` with ``load_job_config(["--config", path])``.
    Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, resolved_config_text(cfg, path))
    return path


# The first line of a run's own config.toml: every key written out, which a job file read back
# does not warn about (`dependent_keys`: the run warned when it started).
RESOLVED_HEADER = "# Resolved torchmoe job config."


def resolved_config_text(cfg: JobConfig, path: str | Path) -> str:
    """`write_config_toml`'s text for a file at `path`: a header saying how to rerun it, then the TOML."""
    return f"{RESOLVED_HEADER} Rerun it: python -m torchmoe train --config {path}\n\n" + config_toml(cfg)


def differing_keys(a: JobConfig, b: JobConfig) -> list[str]:
    """The ``section.key`` names whose values differ between `a` and `b`, in declaration order."""
    return [f"{section}.{key}" for section in _config_fields() for key in _config_fields()[section]
            if getattr(getattr(a, section), key) != getattr(getattr(b, section), key)]


def config_toml(cfg: JobConfig) -> str:
    """`cfg` as TOML text, every key written out (the schema's: a section's subclass, such as a
    model built from a Hugging Face folder, writes the keys that rebuild it)."""
    return tomli_w.dumps({section: {key: getattr(getattr(cfg, section), key) for key in keys}
                          for section, keys in _config_fields().items()})


# ---- command-line overrides ------------------------------------------------------------------


# What each path the run reads means when it is not set.
_UNSET = {"model.hf_assets_path": "no Hugging Face folder", "model.tokenizer_path": "the byte tokenizer",
          "checkpoint.initial_load_path": "random initial weights", "training.dataset_path": "no dataset files",
          "validation.dataset_path": "no dataset files"}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return lowered == "true"


def _parse_scalar(text: str, typ: Any) -> Any:
    """Parse one command-line string as `typ` (the same rules tyro then applies)."""
    if typ is bool:
        return _parse_bool(text)
    if typ in (int, float):
        return typ(text)
    return text


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
        instance_from_str=lambda args: _parse_bool(args[0]),
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
    typ = _config_fields().get(section, {}).get(leaf)
    torchtitan = typ is None and name in TORCHTITAN_KEYS
    if torchtitan:
        typ = TORCHTITAN_KEYS[name].typ
    if typ is None:
        match = _closest_key(name)
        fix = f"did you mean --{match}?" if match else _HELP_HINT
        raise ConfigError(flag, " ".join(values), "unknown option", fix)
    value = _parse_override(flag, name, typ, values)
    if name in _PATHS_INSIDE:
        _refuse_invisible(flag, value, value if isinstance(value, list) else [value])
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
        return _parse_scalar(values[0], typ)
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
                f"options look like --section.key VALUE; {_HELP_HINT}"
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
        data, resolved = _read_toml(config_path, "--config")
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
        _warn(notes, note)
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
        _warn(notes, line)
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
