"""A job file (TOML) and a `JobConfig`, both ways: every ``section.key`` with its type, a file's
values checked into a `JobConfig`, and a run's resolved config.toml written back.

    cfg = load_toml_config("configs/debug_model.toml")   # no overrides, no validation
    write_config_toml(cfg, "outputs/run/config.toml")     # every key; reloads to an equal JobConfig

torchtitan v0.2.2's keys are read through `torchmoe.config.torchtitan`. The command line's
``--section.key`` overrides on top of a file are `config.loader.load_job_config`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import tomllib
import typing
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from torchmoe.config.errors import ConfigError, show_value
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.files.nesting import toml_loads
from torchmoe.config.files.paths import PATH_KEYS, path_faults
from torchmoe.config.files.text import NotUTF8, utf8_text
from torchmoe.config.job_config import JobConfig
from torchmoe.config.torchtitan import SECTIONS as TORCHTITAN_SECTIONS
from torchmoe.config.torchtitan import TORCHTITAN_KEYS, translate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


logger = logging.getLogger(__name__)

HELP_HINT = "run `torchmoe train --help` to list every option"

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
def config_fields() -> dict[str, dict[str, Any]]:
    """``{section: {key: type}}`` for every field of `JobConfig`, in declaration order."""
    sections: dict[str, dict[str, Any]] = {}
    for section in dataclasses.fields(JobConfig):
        section_cls = typing.get_type_hints(JobConfig)[section.name]
        hints = typing.get_type_hints(section_cls)
        sections[section.name] = {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}
    return sections


def _all_keys() -> list[str]:
    """Every key a job file may hold: torchmoe's, then torchtitan's that torchmoe lacks."""
    return [*(f"{s}.{k}" for s, keys in config_fields().items() for k in keys), *TORCHTITAN_KEYS]


def closest_key(name: str) -> str | None:
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
                fix += f", e.g. {leaf} = {show_value(parse_scalar(value, typ))}"
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
    if key in PATHS_INSIDE:
        refuse_invisible(key, value, texts)
    return float(value) if typ is float else [float(v) for v in value] if typ == list[float] else value


# The keys whose values are or hold paths (a mixture's entries end in one).
PATHS_INSIDE = (*PATH_KEYS, "training.dataset_mix")


def refuse_invisible(key: str, value: Any, texts: list[str]) -> None:
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


def add_note(notes: list[str] | None, note: str | None) -> None:
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
    fields = config_fields()
    own: dict[str, Any] = {}
    mapped: dict[str, Any] = {}
    sources: dict[str, tuple[str, Any]] = {}  # a mapped key -> the torchtitan key and value that set it
    for section, table in data.items():
        if section not in fields and section not in TORCHTITAN_SECTIONS:
            if not isinstance(table, Mapping):
                match = closest_key(section)
                if match:
                    home, _, leaf = match.partition(".")
                    fix = f"move it under its section: [{home}] {leaf} = ..."
                else:
                    fix = f"every key belongs to a [section]; {HELP_HINT}"
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
                add_note(notes, note)
            else:
                match = closest_key(dotted)
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
            permission...), is not UTF-8 (a byte order mark names its encoding: `config.files.text`),
            is not valid TOML (the message carries the parser's line and column), or holds an
            unknown key or a wrong type.
    """
    return job_config_from_dict(read_toml(path, key)[0], notes=notes, set_keys=set_keys)


def read_toml(path: str | Path, key: str) -> tuple[dict[str, Any], bool]:
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
    return [f"{section}.{key}" for section in config_fields() for key in config_fields()[section]
            if getattr(getattr(a, section), key) != getattr(getattr(b, section), key)]


def config_toml(cfg: JobConfig) -> str:
    """`cfg` as TOML text, every key written out (the schema's: a section's subclass, such as a
    model built from a Hugging Face folder, writes the keys that rebuild it)."""
    return tomli_w.dumps({section: {key: getattr(getattr(cfg, section), key) for key in keys}
                          for section, keys in config_fields().items()})


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return lowered == "true"


def parse_scalar(text: str, typ: Any) -> Any:
    """Parse one command-line string as `typ` (the same rules tyro then applies)."""
    if typ is bool:
        return parse_bool(text)
    if typ in (int, float):
        return typ(text)
    return text
