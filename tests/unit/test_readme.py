"""The README stays a front page (the two Quick start commands CI installs by, under 200 lines), and
docs/config.md is exactly what the generator prints from the config docstrings."""

from __future__ import annotations

import importlib.util

from tests.docs_check import REPO, blocks

README = REPO / "README.md"
QUICK_START = [
    'pip install torch==2.13.0 && pip install -e ".[dev]" && torchmoe train --config configs/debug_model.toml',
    "python3 -m pytest -q tests",
]


def _generator():
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().split("\n")
    assert len(lines) <= 200, len(lines)
    section = "\n".join(lines[lines.index("## Quick start"):])
    assert blocks("README.md", section)[0].lines == QUICK_START


def test_config_reference_is_current() -> None:
    gen = _generator()
    assert gen.PAGE == REPO / "docs" / "config.md"
    assert gen.PAGE.read_text() == gen.page(), "run: PYTHONPATH=. python scripts/gen_config_reference.py --write-docs"
