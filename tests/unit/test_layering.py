"""The package's layering (docs/architecture.md), as import-linter checks it from
pyproject.toml's contracts: no module imports a layer above its own, lazily or not, and the
planning code imports no torch.

    lint-imports        # the same check, from the command line (.ci/run runs it too)
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_imports_keep_the_layers():
    proc = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.argv = ['lint-imports', '--no-cache']; lint_imports_command()"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]
