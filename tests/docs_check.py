"""What the docs check (`tests/unit/test_docs.py`) reads in README.md and docs/*.md, and how it
decides that a command shown there is covered. The rules are stated in docs/testing.md, "The docs
check"; in short:

1. the check runs it: `torchmoe ... --help`, `torchmoe train ... --dry-run`, and a command shown
   with its `error:` output (`run_for` gives what to run);
2. a training command is planned: `torchmoe train` without `--dry-run` (bare, under torchrun, or
   passed on by `sbatch scripts/multinode.slurm`) runs as `--dry-run --world-size N`;
3. a test runs it: `<!-- runs in: tests/x.py::test_name, .ci/run -->` right before its block, and
   every word of the command a reader would type occurs in that test's source (`source_of`).

A command no rule covers is a problem (`coverage_problems`), and so is an annotation naming a test
that does not exist.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
ANNOTATION = re.compile(r"^<!--\s*runs in:\s*(.+?)\s*-->$")
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
RUNNERS = {"bash", "sh", "python", "python3", "sbatch"}
# sbatch's default ranks per node in scripts/multinode.slurm (NPROC_PER_NODE, else the node's GPUs, else 8).
SLURM_RANKS_PER_NODE = 8


def pages() -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    """A fenced block: its language, first content line (1-based), lines, and the `runs in` targets
    of the HTML comment right before it."""

    page: str
    language: str
    line: int
    lines: list[str]
    targets: list[str]


@dataclass
class Command:
    """One simple command of a block (a `&&` chain is several), with the output shown after it."""

    page: str
    line: int
    text: str
    words: list[str]
    targets: list[str]
    output: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def blocks(page: str, text: str) -> list[Block]:
    """Every fenced block of a Markdown text."""
    found, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, language = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        annotation = ANNOTATION.match(before)
        targets = [t.strip() for t in annotation.group(1).split(",")] if annotation else []
        content = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        found.append(Block(page, language.lower(), i + 2, content, targets))
        i = end + 1
    return found


def _logical_lines(block: Block) -> list[tuple[int, str, list[str]]]:
    """(line, command text, output lines) of a shell block: `\\` continuations joined; in a
    console block only `$ ` lines are commands, the lines up to the next one its output."""
    console = block.language == "console"
    result: list[tuple[int, str, list[str]]] = []
    pending, start = "", 0
    for offset, raw in enumerate(block.lines):
        line_no = block.line + offset
        if pending:
            pending += " " + raw.strip()
        elif console and raw.startswith("$ "):
            pending, start = raw[2:].strip(), line_no
        elif console:
            if result:
                result[-1][2].append(raw.rstrip())
            continue
        elif raw.strip() and not raw.lstrip().startswith("#"):
            pending, start = raw.strip(), line_no
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
        else:
            result.append((start, pending, []))
            pending = ""
    return result


def commands(page: str, text: str) -> tuple[list[Command], list[str]]:
    """The commands of a page's shell blocks, and problems found while reading them (a `text`
    block hiding a `$ ` command)."""
    found, problems = [], []
    for block in blocks(page, text):
        if block.language not in SHELL_LANGUAGES:
            problems += [f"{page}:{block.line + i}: a {block.language!r} block holds a command: {line}"
                         for i, line in enumerate(block.lines) if line.startswith("$ ")]
            continue
        for line, text_, output in _logical_lines(block):
            words = shlex.split(text_, comments=True)
            chain: list[list[str]] = [[]]
            for word in words:
                if word == "&&":
                    chain.append([])
                else:
                    chain[-1].append(word)
            for simple in chain:
                found.append(Command(page, line, shlex.join(simple), simple, block.targets, output))
    return found, problems


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words


def _option_value(words: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of `names` in `words` (`--name V` or `--name=V`)."""
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            return value if eq else (words[i + 1] if i + 1 < len(words) else None)
    return None


@dataclass(frozen=True)
class Launch:
    """A command that runs `torchmoe`: its arguments, the ranks it launches, and whether it is
    passed on by a script (which a test must run: rule 3)."""

    args: list[str]
    world_size: int
    by_script: bool


def _torchrun(words: list[str]) -> Launch | None:
    """`torchrun [OPTIONS] -m torchmoe ARGS` (`words` after the program): ARGS on nnodes x nproc ranks."""
    if "-m" not in words or words[words.index("-m") + 1:words.index("-m") + 2] != ["torchmoe"]:
        return None
    options, args = words[:words.index("-m")], words[words.index("-m") + 2:]
    nproc = _option_value(options, ("--nproc_per_node", "--nproc-per-node")) or "1"
    nnodes = (_option_value(options, ("--nnodes",)) or "1").split(":")[-1]  # MIN:MAX: the most it runs
    return Launch(args, int(nproc) * int(nnodes), False)


def _sbatch(words: list[str]) -> Launch | None:
    """`sbatch [OPTIONS] scripts/multinode.slurm CONFIG OVERRIDES` (`words` after the program): the
    `torchmoe train` the script starts, on --nodes x its default ranks per node."""
    script = next((i for i, w in enumerate(words) if w.endswith("multinode.slurm")), None)
    if script is None or script + 1 >= len(words):
        return None
    nodes = int(_option_value(words[:script], ("--nodes", "-N")) or "1")
    config, overrides = words[script + 1], words[script + 2:]
    return Launch(["train", "--config", config, "--checkpoint.enable", "true", *overrides],
                  nodes * SLURM_RANKS_PER_NODE, True)


def launch(command: Command) -> Launch | None:
    """How `command` runs torchmoe, or None when it does not."""
    _, words = _split_env(command.words)
    program, rest = (words[0], words[1:]) if words else ("", [])
    if program == "torchmoe":
        return Launch(rest, 1, False)
    if program in ("python", "python3") and rest[:2] == ["-m", "torchmoe"]:
        return Launch(rest[2:], 1, False)
    if program in ("python", "python3") and rest[:2] == ["-m", "torch.distributed.run"]:
        return _torchrun(rest[2:])
    if program == "torchrun":
        return _torchrun(rest)
    if program == "sbatch":
        return _sbatch(rest)
    return None


@dataclass(frozen=True)
class Run:
    """What the check runs for a command (rule 1 or 2): argv for `torchmoe.commands.cli.main` (the dump
    folder is added by the runner), the exit status expected, and whether a test must run the
    command too (a one-process training run or a script's: rule 3)."""

    argv: list[str]
    status: int
    needs_test: bool


def run_for(command: Command) -> Run | None:
    """Rule 1 or 2 for `command`, or None when neither applies (rule 3 must cover it)."""
    found = launch(command)
    if found is None or not found.args:
        return None
    args = found.args
    if "--help" in args or "-h" in args:
        return Run(args, 0, found.by_script)
    if args[0] != "train":
        return None
    shows_error = bool(command.output) and command.output[0].startswith("error:")
    if "--dry-run" in args or shows_error:
        if "--world-size" not in args and found.world_size > 1:
            args = [*args, "--world-size", str(found.world_size)]
        return Run(args, 2 if shows_error else 0, found.by_script)
    return Run([*args, "--dry-run", "--world-size", str(found.world_size)], 0,
               found.by_script or found.world_size == 1)


def required_words(command: Command) -> list[str]:
    """The words of `command` a test that runs it must hold (rule 3): environment variables set, the
    program or script (a path by its file name), options (without values) and positional arguments;
    not the runner (`bash`, `python`, `sbatch`, `torchmoe` and their options) nor option values."""
    env, words = _split_env(command.words)
    required = list(env)
    if words and words[0] in RUNNERS | {"torchmoe", "torchrun"}:
        i = 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-m":
            i += 1 if "=" in words[i] or i + 1 >= len(words) or words[i + 1].startswith("-") else 2
        words = words[i:]
        if words[:1] == ["-m"]:
            words = words[1:]
        if words[:1] == ["torchmoe"]:
            words = words[1:]
    skip_value = False
    for word in words:
        if skip_value and not word.startswith("-"):
            skip_value = False
            continue
        skip_value = False
        if word.startswith("-"):
            name, eq, _ = word.partition("=")
            required.append(name)
            skip_value = not eq
        else:
            required.append(Path(word).name if "/" in word else word)
    return required


# ---- the source of a named test ----------------------------------------------------------------


def _module_path(module: str) -> Path | None:
    """The file of a dotted module name of the repository, or None."""
    path = REPO / Path(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if path.is_dir() else None


class _Module:
    """A parsed Python file of the repository: its top-level definitions and its `tests` imports."""

    def __init__(self, path: Path) -> None:
        self.definitions: dict[str, ast.AST] = {}
        self.imports: dict[str, tuple[Path, str | None]] = {}  # name -> (module file, name there or None)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.definitions[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.definitions[name.id] = node
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                for alias in node.names:
                    submodule = _module_path(f"{node.module}.{alias.name}")
                    source = _module_path(node.module)
                    if submodule is not None and submodule.name != "__init__.py":
                        self.imports[alias.asname or alias.name] = (submodule, None)
                    elif source is not None:
                        self.imports[alias.asname or alias.name] = (source, alias.name)


def _without_docstrings(node: ast.AST) -> str:
    """The node's code as ast.unparse gives it (no comments), its docstrings left out."""
    tree = ast.parse(ast.unparse(node))
    for inner in ast.walk(tree):
        body = getattr(inner, "body", None)
        if (isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            inner.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _used_names(node: ast.AST) -> set[tuple[str, ...]]:
    """Names a node uses: plain names and `module.name` pairs, its parameters (fixtures) too."""
    used: set[tuple[str, ...]] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name):
            used.add((inner.id,))
        elif isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name):
            used.add((inner.value.id, inner.attr))
        elif isinstance(inner, ast.arg):
            used.add((inner.arg,))
    return used


def source_of(target: str, depth: int = 2) -> str:
    """The source a `runs in` target stands for: a file's text without comment lines, or a test
    function (`path::name` or `path::Class::name`) with the definitions of the names it uses, in its
    module, its folder's conftest.py or the `tests` modules it imports, `depth` levels deep.
    Raises LookupError when the file or the function does not exist."""
    path_text, _, qualname = target.partition("::")
    path = REPO / path_text
    if not path.is_file():
        raise LookupError(f"{path_text} does not exist")
    if not qualname:
        return "\n".join(line for line in path.read_text().split("\n") if not line.lstrip().startswith("#"))
    modules: dict[Path, _Module] = {}

    def module(p: Path) -> _Module:
        if p not in modules:
            modules[p] = _Module(p)
        return modules[p]

    node: ast.AST | None = None
    scope = module(path).definitions
    for part in qualname.split("::"):
        node = scope.get(part)
        if node is None:
            raise LookupError(f"{path_text} has no {qualname}")
        scope = {n.name: n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    conftest = path.parent / "conftest.py"
    pieces, seen = [], set()
    frontier = [(path, node)]
    for level in range(depth + 1):
        next_frontier = []
        for file, current in frontier:
            if (file, id(current)) in seen:
                continue
            seen.add((file, id(current)))
            pieces.append(_without_docstrings(current))
            if level == depth:
                continue
            mod = module(file)
            for used in _used_names(current):
                head = used[0]
                if head in mod.definitions:
                    next_frontier.append((file, mod.definitions[head]))
                elif head in mod.imports:
                    source, name = mod.imports[head]
                    wanted = name or (used[1] if len(used) > 1 else None)
                    if wanted and wanted in module(source).definitions:
                        next_frontier.append((source, module(source).definitions[wanted]))
                elif conftest.is_file() and head in module(conftest).definitions:
                    next_frontier.append((conftest, module(conftest).definitions[head]))
        frontier = next_frontier
    return "\n".join(pieces)


def coverage_problems(found: list[Command]) -> list[str]:
    """One line per command no rule covers, and per `runs in` target that does not exist."""
    problems, sources = [], {}
    for command in found:
        run = run_for(command)
        if run is not None and not run.needs_test:
            continue
        words = required_words(command)
        covered = False
        for target in command.targets:
            if target not in sources:
                try:
                    sources[target] = source_of(target)
                except LookupError as err:
                    sources[target] = None
                    problems.append(f"{command.page}:{command.line}: runs in {target}: {err}")
            source = sources[target]
            if source is not None and all(word in source for word in words):
                covered = True
        if not covered:
            why = ("no `runs in` test holds all of " + ", ".join(words) if command.targets
                   else "no rule covers it: not run or planned by the check, and no `runs in` test named")
            problems.append(f"{command.where}: {why}")
    return problems


# ---- links and measured numbers ----------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page (GitHub numbers repeated ones -1, -2, ...)."""
    found: dict[str, int] = {}
    result = set()
    in_fence = False
    for line in text.split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        match = None if in_fence else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = found.get(base, 0)
            result.add(base if n == 0 else f"{base}-{n}")
            found[base] = n + 1
    return result


def link_problems(page: Path, text: str) -> list[str]:
    """Links to a page or heading of the repository that does not exist."""
    problems = []
    for number, line in enumerate(text.split("\n"), 1):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # a link inside code is an example
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                problems.append(f"{page.name}:{number}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                problems.append(f"{page.name}:{number}: {target}: no such heading")
    return problems


MEASURED = re.compile(r"\bmeasured\b", re.IGNORECASE)
RATE = re.compile(r"\d[\d,.]*\s*(?:tokens/s|tok/s|TFLOP/s|GB/s|s/step|s per step|ms)\b")
NUMBER = re.compile(r"(?<![\w.])\d")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\b(?:CPU|GPU|machine)\b")


def text_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, list item, table and fenced block; headings split them."""
    result: list[tuple[int, list[str]]] = []
    kind, in_fence = None, False
    for number, line in enumerate(text.split("\n"), 1):
        fence = FENCE.match(line)
        if in_fence:
            result[-1][1].append(line)
            in_fence = not fence
            continue
        if fence:
            result.append((number, [line]))
            in_fence, kind = True, None
            continue
        if not line.strip() or HEADING.match(line):
            kind = None
            continue
        line_kind = "table" if line.startswith("|") else "item" if re.match(r"^(\s*[-*]|\d+\.)\s", line) else "text"
        starts_new = kind is None or line_kind == "item" or (line_kind == "table") != (kind == "table")
        if starts_new:
            result.append((number, [line]))
            kind = line_kind
        else:
            result[-1][1].append(line)
    return [(number, "\n".join(lines)) for number, lines in result]


def _dated(found_blocks: list[tuple[int, str]], i: int) -> bool:
    """Block i, or its caption (the block right above; above a table or fenced block, the one
    above that too), holds a date (YYYY-MM-DD) and names the machine."""
    context = [found_blocks[i][1]]
    for j in (i - 1, i - 2):
        if j < 0:
            break
        context.append(found_blocks[j][1])
        if not found_blocks[j][1].startswith(("|", "```", "~~~")):
            break
    text = "\n".join(context)
    return bool(DATE.search(text) and MACHINE.search(text))


def measurements(text: str) -> list[tuple[int, str, bool]]:
    """(line, first words, dated) for every block that gives a measured number: one that says
    *measured* and holds a number, or gives a rate or time (tokens/s, TFLOP/s, GB/s, s/step, ms)."""
    found_blocks = text_blocks(text)
    return [(number, " ".join(block.split())[:70], _dated(found_blocks, i))
            for i, (number, block) in enumerate(found_blocks)
            if (MEASURED.search(block) and NUMBER.search(block)) or RATE.search(block)]


def tables(text: str) -> list[tuple[int, str, bool]]:
    """(line, first words, dated) for every table."""
    found_blocks = text_blocks(text)
    return [(number, " ".join(block.split())[:70], _dated(found_blocks, i))
            for i, (number, block) in enumerate(found_blocks) if block.startswith("|")]
