"""The docs check: every command shown in README.md and docs/*.md runs as written, here or in the
test named beside it; links between pages resolve; measured numbers carry their date and machine.
The rules are docs/testing.md's "The docs check" (`tests/docs_check.py` reads the pages).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import docs_check
from tests.docs_check import Command, coverage_problems, run_for
from torchmoe.commands import cli

PAGES = docs_check.pages()
COMMANDS: list[Command] = [c for page in PAGES for c in docs_check.commands(page.name, page.read_text())[0]]
RUNS = [(command, run) for command in COMMANDS if (run := run_for(command)) is not None]
# Every page whose numbers people wrote; docs/config.md is generated from job_config.py's docstrings.
WRITTEN = [page for page in PAGES if page.name != "config.md"]


def test_every_command_is_covered() -> None:
    problems = [p for page in PAGES for p in docs_check.commands(page.name, page.read_text())[1]]
    assert problems + coverage_problems(COMMANDS) == []
    # What the pages show today: a rule that stopped finding them would pass vacuously.
    assert len(COMMANDS) >= 14 and len(RUNS) >= 10


@pytest.mark.parametrize(("command", "run"), RUNS, ids=[f"{c.page}:{c.line}" for c, _ in RUNS])
def test_command_runs_as_written(command: Command, run: docs_check.Run, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rules 1 and 2: the command (a training command as its dry run) in this process, at 100
    columns, its dump folder moved here; the output shown must be what it prints."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dump = [] if "--help" in run.argv else ["--job.dump_folder", str(tmp_path / "run")]
    status = cli.main([*run.argv, *dump])
    out, err = capsys.readouterr()
    assert status == run.status, f"{command.where}\n{err[-2000:]}"
    if run.status == 2:
        assert err.rstrip("\n").split("\n") == command.output, command.where
        return
    assert "expect OOM" not in out + err, command.where
    printed = iter(line.rstrip() for line in out.split("\n"))
    for shown in command.output:
        if shown.strip() != "...":
            assert any(line == shown for line in printed), f"{command.where}: not printed (in order): {shown!r}"


def test_no_training_command_shown_warms_up_past_its_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader who runs a training command as shown gets no warning about its own schedule (the
    README's 8-rank example ran 10 steps of debug_model.toml's 20-step warmup and warned)."""
    from torchmoe.config.loader import load_job_config

    monkeypatch.chdir(docs_check.REPO)
    trains = [(command, found.args) for command in COMMANDS if (found := docs_check.launch(command)) is not None
              and found.args[:1] == ["train"] and "--dry-run" not in found.args and not command.output]
    assert len(trains) >= 5  # not vacuous
    for command, args in trains:
        cfg = load_job_config(args[1:], notes=[])
        assert cfg.lr_scheduler.warmup_steps < cfg.training.steps, command.where


def test_links_name_pages_and_headings_that_exist() -> None:
    assert [p for page in PAGES for p in docs_check.link_problems(page, page.read_text())] == []


def test_measured_numbers_carry_date_and_machine() -> None:
    found = {page.name: docs_check.measurements(page.read_text()) for page in WRITTEN}
    undated = [f"{name}:{line}: {start}" for name, rows in found.items() for line, start, dated in rows if not dated]
    assert undated == []
    assert sum(map(len, found.values())) >= 25  # not vacuous: the pages hold this many measurements


def test_every_benchmark_table_is_dated() -> None:
    tables = docs_check.tables((docs_check.REPO / "docs" / "benchmarks.md").read_text())
    assert len(tables) == 11 and all(dated for _, _, dated in tables), tables


# ---- the check itself --------------------------------------------------------------------------

SNIPPET = """# A page

<!-- runs in: tests/integration/test_readme_in_order.py::test_the_readme_runs_in_order -->
```bash
torchmoe train --config configs/debug_model.toml --training.steps 40
torchmoe train --config configs/debug_model.toml --optimizer.lr 1e-3
```

```console
$ torchrun --nproc_per_node 4 -m torchmoe train --config configs/debug_model.toml \\
    --parallelism.tensor_parallel_degree 2
$ torchmoe convert hf-to-dcp hf_folder out
```

<!-- runs in: tests/unit/test_nothing.py::test_gone -->
```bash
bash scripts/gpu_check.sh
```

```text
$ rm -rf outputs
```

- an item:

  ```bash
  torchmoe report outputs/run
  ```
"""


def test_the_check_names_every_command_no_rule_covers() -> None:
    found, problems = docs_check.commands("snippet.md", SNIPPET)
    assert [c.text for c in found] == [
        "torchmoe train --config configs/debug_model.toml --training.steps 40",
        "torchmoe train --config configs/debug_model.toml --optimizer.lr 1e-3",
        "torchrun --nproc_per_node 4 -m torchmoe train --config configs/debug_model.toml "
        "--parallelism.tensor_parallel_degree 2",
        "torchmoe convert hf-to-dcp hf_folder out",
        "bash scripts/gpu_check.sh",
        "torchmoe report outputs/run"]
    assert problems == ["snippet.md:21: a 'text' block holds a command: $ rm -rf outputs"]
    # The test trains with --training.steps, not --optimizer.lr; torchrun on 4 ranks is planned
    # (rule 2); convert and report (in a list item's fence) have no rule; the named test file does
    # not exist.
    assert coverage_problems(found) == [
        "snippet.md:6: torchmoe train --config configs/debug_model.toml --optimizer.lr 1e-3: no `runs in` "
        "test holds all of train, --config, --optimizer.lr",
        "snippet.md:12: torchmoe convert hf-to-dcp hf_folder out: no rule covers it: not run or planned by the "
        "check, and no `runs in` test named",
        "snippet.md:17: runs in tests/unit/test_nothing.py::test_gone: tests/unit/test_nothing.py does not exist",
        "snippet.md:17: bash scripts/gpu_check.sh: no `runs in` test holds all of gpu_check.sh",
        "snippet.md:27: torchmoe report outputs/run: no rule covers it: not run or planned by the check, and no "
        "`runs in` test named"]
    assert run_for(found[2]) == docs_check.Run(
        ["train", "--config", "configs/debug_model.toml", "--parallelism.tensor_parallel_degree", "2", "--dry-run",
         "--world-size", "4"], 0, False)


def test_a_test_covers_a_command_only_with_its_own_words() -> None:
    """Docstrings do not count: test_layout_parity's two-node test names multinode.slurm in its
    docstring and runs it through fake_slurm.sbatch, one level down."""
    target = "tests/distributed/test_layout_parity.py::test_two_torchrun_nodes_train_what_one_world_of_four_trains"
    assert "multinode.slurm" in docs_check.source_of(target)
    assert "multinode.slurm" not in docs_check.source_of(target, depth=0)
    with pytest.raises(LookupError, match="has no test_gone"):
        docs_check.source_of("tests/unit/test_docs.py::test_gone")


def test_an_undated_measurement_is_found() -> None:
    text = ("Throughput:\n\n| run | tokens/s |\n|---|---|\n| tiny | 10,900 tokens/s |\n\n"
            "Measured 2026-11-30 on the CPU machine:\n\n| run | tokens/s |\n|---|---|\n| tiny | 9 tokens/s |\n\n"
            "Below the ideal: 8 ms lost.\n\n## Next\n\nMeasured on 2 ranks: 23 ms.\n")
    assert docs_check.measurements(text) == [(3, "| run | tokens/s | |---|---| | tiny | 10,900 tokens/s |", False),
                                             (7, "Measured 2026-11-30 on the CPU machine:", True),
                                             (9, "| run | tokens/s | |---|---| | tiny | 9 tokens/s |", True),
                                             (13, "Below the ideal: 8 ms lost.", True),
                                             (17, "Measured on 2 ranks: 23 ms.", False)]
    assert [dated for _, _, dated in docs_check.tables(text)] == [False, True]


def test_a_link_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text("# A\n\n## Two words\n\nsee [b](#two-words), [c](#three), [d](b.md)\n")
    assert docs_check.link_problems(page, page.read_text()) == ["a.md:5: #three: no such heading",
                                                               "a.md:5: b.md: no such file"]


# A test file (and test) a page, a docstring, a script or a config names to run: the file exists
# and, where a `::name` follows, so does that test (docs/testing.md's placeholder excepted).
_TEST_REFERENCE = re.compile(r"tests/[\w/]+\.py(?:::\w+)?")
_PLACEHOLDER = "tests/x.py::test_name"


def _test_references() -> set[tuple[str, str]]:
    """(where, reference) of every tests/... path in the package, docs, scripts, configs and README."""
    files = [*Path("torchmoe").rglob("*.py"), *Path("scripts").rglob("*.py"), *Path("configs").glob("*.toml"),
             *Path("docs").glob("*.md"), Path("README.md"), Path("pyproject.toml")]
    return {(str(f), m) for f in files for m in _TEST_REFERENCE.findall(f.read_text()) if m != _PLACEHOLDER}


def test_every_test_a_page_or_docstring_names_exists() -> None:
    references = _test_references()
    missing = []
    for where, ref in sorted(references):
        path, _, name = ref.partition("::")
        if not Path(path).is_file():
            missing.append(f"{where}: {ref} (no such file)")
        elif name and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", Path(path).read_text(), re.M):
            missing.append(f"{where}: {ref} (no such test)")
    assert missing == []
    assert len(references) >= 50  # not vacuous: this many references are checked
