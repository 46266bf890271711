"""The README's config reference is exactly what the generator prints from the docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current():
    gen = _generator()
    readme = (REPO / "README.md").read_text()
    current = readme.split(gen._START)[1].split(gen._END)[0].strip()
    assert current == gen.reference().strip(), "run: python scripts/gen_config_reference.py --write-readme"
