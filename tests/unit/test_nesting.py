"""`config.files.nesting`: the one JSON and TOML parser of every reader refuses what no reader can use,
as the parser's own error for malformed input (which each reader turns into its one message)."""

from __future__ import annotations

import json
import math

import pytest

from torchmoe.config.files.nesting import json_loads, toml_loads, tomllib


@pytest.mark.parametrize(("text", "problem", "column"), [
    ('{"a": ' + "1" * 5001 + "}", "a number of more than 4,300 digits, which no setting holds", 7),  # digit limit
    ("[1, NaN]", "NaN is no finite number (JSON numbers are finite, and within a float's range)", 5),
    ('{"x": -Infinity}', "-Infinity is no finite number", 7),
    ('{"x": Infinity}', "Infinity is no finite number", 7),
    ("[1e400]", "1e400 is no finite number", 2),  # beyond a float: Python read it as inf
    ("[-2.5e308]", "-2.5e308 is no finite number", 2),
])
def test_json_numbers_that_no_reader_can_use_are_malformed(text: str, problem: str, column: int) -> None:
    with pytest.raises(json.JSONDecodeError) as err:
        json_loads(text)
    assert err.value.msg.startswith(problem) and err.value.colno == column, err.value


def test_json_numbers_a_reader_checks_by_field_may_be_nan_but_not_too_long() -> None:
    """finite=False (config.json, hardware profiles: every number checked by the field reading it)."""
    value = json_loads('{"a": NaN, "b": -Infinity, "c": 1e400, "d": 1.5, "e": ' + "9" * 4300 + "}", finite=False)
    assert math.isnan(value["a"]) and value["b"] == -math.inf and value["c"] == math.inf and value["d"] == 1.5
    assert value["e"] == int("9" * 4300)
    with pytest.raises(json.JSONDecodeError, match="more than 4,300 digits"):
        json_loads("[" + "9" * 4301 + "]", finite=False)


@pytest.mark.parametrize(("text", "line"), [
    ("a = 1\nb = " + "7" * 4301 + "\n", 2),
    ("a = 0x" + "f" * 3600 + "\n", 1),  # 14,400 bits: parsed, but no message could show it in decimal
    ("a = [1, {b = 0b" + "1" * 15000 + "}]\n", 1),
    ("[t]\n\nc = 0o" + "7" * 5000 + "\n", 3),
])
def test_toml_integers_longer_than_any_message_shows_are_malformed(text: str, line: int) -> None:
    with pytest.raises(tomllib.TOMLDecodeError) as err:
        toml_loads(text)
    assert str(err.value) == f"a number of more than 4,300 digits, which no setting holds (at line {line})"


def test_toml_keeps_its_own_inf_and_nan_for_each_setting_to_check() -> None:
    table = toml_loads("a = inf\nb = nan\nc = 0x" + "f" * 3000 + "\n")
    assert table["a"] == math.inf and math.isnan(table["b"]) and table["c"] == 16**3000 - 1
