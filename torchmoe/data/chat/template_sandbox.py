"""The sandbox chat templates render in: transformers' own, bounded in work and size.

    sandbox = TemplateSandbox(transformers_sandbox())
    text, spans = sandbox.render(template_text, {"messages": messages, ...}, messages=len(messages))

A chat template is code from a file. transformers renders it in jinja2's immutable sandbox, which
keeps it from reaching Python but not from running for ever or filling memory: two nested
``range(100000)`` loops are 10^10 steps, ``{{ "x" * 10**9 }}`` writes a gigabyte. This is the same
sandbox (its options, globals, filters and the ``{% generation %}`` tracker are taken from the one
transformers builds, so what renders here renders exactly as there), with three rules added:

- **Work.** Every loop iteration and every call is a step; a rendering of a conversation of n
  messages and tools may take ``STEPS + STEPS_PER_MESSAGE * n`` (`Bounds.for_messages`), so a
  template's work may grow with the conversation (a loop over the messages inside one over them
  is n^2 steps), but not without it.
- **Size.** No string, list or output it builds holds more than `Bounds.chars` characters (or
  items), and no integer more than `INT_BITS` bits: checked before the operations that build one
  at once (``*``, ``**``, ``%``, ``str.format``, a width, count or join given to a filter or a
  str method) and after the others (``+``, ``~``, any call's or filter's result, the output).
- **Text.** A value written into the text (``{{ value }}`` or ``~``) that is a list, tuple, dict
  or set would be written as its Python repr, which no other renderer writes alike (a serving
  stack's minijinja writes JSON): `ContainerWritten`, which the caller names by its place in the
  conversation. Templates that take a message's content as parts iterate them
  (``{% for part in message.content %}``) and render as in transformers.

Each broken rule is a `RenderBound` (or `ContainerWritten`) raised out of the rendering.
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["Bounds", "ContainerWritten", "RenderBound", "TemplateSandbox", "transformers_sandbox"]

STEPS = 1_000_000
"""Loop iterations and calls any rendering may take."""
STEPS_PER_MESSAGE = 10_000
"""Loop iterations and calls a rendering may take besides, per message or tool of the conversation."""
CHARS = 1 << 25
"""The most characters (or items) of any string, list or output a rendering builds: 32 Mi, about
8 M tokens, more than any row of a batch holds."""
INT_BITS = 1 << 16
"""The most bits of an integer a rendering computes (Python writes at most 4,300 digits, 14 k bits)."""

_CONTAINERS = (list, tuple, dict, set, frozenset)
# str methods whose integer arguments are widths of what they build.
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
# A printf-style conversion's width and precision (a number, or "*": an argument's).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_NUMBER = re.compile(r"\d+")


class RenderBound(Exception):
    """A rendering broke one of the sandbox's bounds: `problem` says which, with its value."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class ContainerWritten(Exception):
    """The template wrote `value` (a list, tuple, dict or set) into the text, as its Python repr."""

    def __init__(self, value: Any) -> None:
        super().__init__(f"it writes a {type(value).__name__} into the text, as its Python repr")
        self.value = value


@dataclass(frozen=True)
class Bounds:
    """What one rendering may do (module docstring)."""

    steps: int
    chars: int = CHARS

    @classmethod
    def for_messages(cls, messages: int) -> Bounds:
        """The bounds of rendering a conversation of `messages` messages and tools."""
        return cls(STEPS + STEPS_PER_MESSAGE * messages, CHARS)


class _Budget:
    """What is left of one rendering's bounds."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.steps = bounds.steps


class _Steps:
    """An iterable that takes a step of the sandbox's budget per item, as a loop over it does; its
    length is the iterable's (a loop's `loop.length` asks)."""

    def __init__(self, iterable: Iterable[Any], sandbox: BoundedSandbox) -> None:
        self.iterable, self.sandbox = iterable, sandbox

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            self.sandbox.step()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with every loop's iterable counted (`BoundedSandbox.counted`) and
    every ``~`` joined by `BoundedSandbox.concat`."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        counted = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(nodes.For(node.target, counted, node.body, node.else_, node.test, node.recursive,
                                    lineno=node.lineno), frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox as `like` (transformers' sandbox) is configured, with the bounds
    of the module docstring, which hold inside `bounded` (a rendering, and the compiling of a
    template, which computes its constant expressions)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, like: ImmutableSandboxedEnvironment) -> None:
        super().__init__(trim_blocks=like.trim_blocks, lstrip_blocks=like.lstrip_blocks,
                         keep_trailing_newline=like.keep_trailing_newline, autoescape=like.autoescape,
                         extensions=[type(extension) for extension in like.extensions.values()],
                         finalize=_written)
        self.globals.update({name: value for name, value in like.globals.items() if name != "range"})
        self.filters.update(like.filters)
        self.filters.update({name: self._bounded_filter(name, f) for name, f in self.filters.items()})
        self._budget: _Budget | None = None

    @contextmanager
    def bounded(self, bounds: Bounds) -> Iterator[None]:
        """Count the steps and sizes of what runs inside against `bounds`."""
        self._budget = _Budget(bounds)
        try:
            yield
        finally:
            self._budget = None

    # ---- work ----------------------------------------------------------------------------------

    def step(self) -> None:
        """One loop iteration or call."""
        budget = self._budget
        if budget is not None:
            budget.steps -= 1
            if budget.steps < 0:
                raise RenderBound(f"it ran more than {budget.bounds.steps:,} steps (loop iterations and calls), the "
                                  f"bound for this conversation ({STEPS:,}, and {STEPS_PER_MESSAGE:,} more a message "
                                  "or tool): a loop that does not end with the conversation")

    def counted(self, iterable: Iterable[Any]) -> _Steps:
        """A loop's iterable, a step per item."""
        return _Steps(iterable, self)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's signature
        __self.step()
        owner = getattr(__obj, "__self__", None)
        if __self._budget is not None and isinstance(owner, str):
            __self._check(_str_method_size(owner, getattr(__obj, "__name__", ""), args, kwargs), "str")
        return __self.sized(super().call(__context, __obj, *args, **kwargs))

    # ---- size ----------------------------------------------------------------------------------

    def sized(self, value: Any) -> Any:
        """`value`, unless it is larger than the bound (a string's characters, a container's items,
        an integer's bits)."""
        if self._budget is not None:
            if isinstance(value, (str, *_CONTAINERS)):
                self._check(len(value), type(value).__name__)
            elif isinstance(value, int) and value.bit_length() > INT_BITS:
                raise _int_bound()
        return value

    def _check(self, size: int | None, what: str) -> None:
        """`size` (None: not known before) is within the bound."""
        if size is not None and self._budget is not None and size > self._budget.bounds.chars:
            raise RenderBound(f"it builds a {what} of {size:,} characters or items, more than the bound of "
                              f"{self._budget.bounds.chars:,}")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if self._budget is not None:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        self._check(len(seq) * max(times, 0), type(seq).__name__)
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * left.bit_length() > INT_BITS:
                    raise _int_bound()
            elif operator == "%" and isinstance(left, str):
                self._check(_percent_size(left, right), "str")
        return self.sized(super().call_binop(context, operator, left, right))

    def concat(self, values: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...``: each written as text (`_written`), joined, within the bound."""
        return self.sized("".join(str(_written(value)) for value in values))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None

        @wraps(formatter)
        def checked(*args: Any, **kwargs: Any) -> str:
            if self._budget is not None:
                self._check(_format_size(value.__self__, args, kwargs), "str")
            return self.sized(formatter(*args, **kwargs))

        return checked

    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        """Filter `name` (`f`): what it would build checked before (`_FILTER_SIZES`), its result after."""
        size = _FILTER_SIZES.get(name)
        signature = inspect.signature(f) if size is not None else None

        @wraps(f)  # keeps jinja2's pass_context / pass_environment marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            if signature is not None and self._budget is not None:
                try:
                    arguments = signature.bind(*args, **kwargs).arguments
                except TypeError:  # the filter's own error, raised by the call below
                    pass
                else:
                    self._check(size(arguments), "str or list")
            return self.sized(f(*args, **kwargs))

        return bounded


def _int_bound() -> RenderBound:
    return RenderBound(f"it computes an integer of more than {INT_BITS:,} bits, the bound")


def _width(value: Any) -> int | None:
    """`value` as a width or count: an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(digits: str) -> int:
    """A width written in a format string (a few digits; longer is past any bound anyway)."""
    return int(digits) if len(digits) <= 12 else 10**12


def _percent_size(text: str, args: Any) -> int:
    """At least how long ``text % args`` is: its longest conversion's width or precision (a
    number, or an argument's for "*")."""
    values = args if isinstance(args, tuple) else (args,)
    widths = [_number(w) for spec in _PERCENT_SPEC.findall(text) for w in spec if w and w != "*"]
    widths += [w for v in values if (w := _width(v)) is not None and "*" in text]
    return max(widths, default=0)


def _format_size(text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """At least how long ``text.format(*args, **kwargs)`` is: its largest width or precision,
    written or nested (``{:{w}}``)."""
    widths = []
    for _, _, spec, _ in string.Formatter().parse(text):
        if spec:
            widths += [_number(n) for n in _NUMBER.findall(spec)]
            if "{" in spec:
                widths += [w for v in (*args, *kwargs.values()) if (w := _width(v)) is not None]
    return max(widths, default=0)


def _str_method_size(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """How long the str `text`'s method `name` called with `args` would make its result (None
    for a method that builds nothing larger than its inputs)."""
    if name in _WIDTH_METHODS:
        width = next((w for v in (*args, *kwargs.values()) if (w := _width(v)) is not None), 0)
        return width * (text.count("\t") + 1 if name == "expandtabs" else 1)
    if name == "join" and args:
        return _joined_size(args[0], text)
    if name == "replace" and len(args) >= 2:
        return _replaced_size(text, *args[:3])
    return None


def _joined_size(items: Any, separator: Any) -> int | None:
    if not isinstance(items, (list, tuple)) or not isinstance(separator, str):
        return None
    return sum(len(item) for item in items if isinstance(item, str)) + len(separator) * max(len(items) - 1, 0)


def _replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> int | None:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return None
    found = len(text) + 1 if not old else text.count(old)
    if _width(count) is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


def _indented_size(arguments: dict[str, Any]) -> int | None:
    text, width = arguments.get("s"), arguments.get("width", 4)
    if not isinstance(text, str):
        return None
    step = len(width) if isinstance(width, str) else (_width(width) or 0)
    return len(text) + step * (text.count("\n") + 1)


def _json_size(arguments: dict[str, Any]) -> int | None:
    value, indent = arguments.get("value", arguments.get("x")), _width(arguments.get("indent"))
    return indent * (len(value) + 1) if indent and hasattr(value, "__len__") else None


# What a filter would build, from its bound arguments (by their names in jinja2's and
# transformers' signatures), checked before it runs: widths, counts, joins and replacements.
_FILTER_SIZES: dict[str, Callable[[dict[str, Any]], int | None]] = {
    "center": lambda a: _width(a.get("width", 80)),
    "indent": _indented_size,
    "batch": lambda a: _width(a.get("linecount")) if a.get("fill_with") is not None else None,
    "slice": lambda a: _width(a.get("slices")),
    "tojson": _json_size,
    "format": lambda a: _percent_size(a["value"], a.get("args", ())) if isinstance(a.get("value"), str) else None,
    "join": lambda a: None if a.get("attribute") is not None else _joined_size(a.get("value"), a.get("d", "")),
    "replace": lambda a: _replaced_size(a.get("s"), a.get("old"), a.get("new"), a.get("count")),
}


def _written(value: Any) -> Any:
    """What ``{{ value }}`` writes: `value`, unless it is a container (`ContainerWritten`)."""
    if isinstance(value, _CONTAINERS):
        raise ContainerWritten(value)
    return value


class TemplateSandbox:
    """Chat templates compiled in one `BoundedSandbox` and rendered within bounds.

    Args:
        like: the sandbox whose options, globals, filters and extensions it copies (transformers':
            `transformers_sandbox`).
    """

    def __init__(self, like: ImmutableSandboxedEnvironment) -> None:
        self.environment = BoundedSandbox(like)
        self._compiled: dict[str, Any] = {}

    def render(self, source: str, context: dict[str, Any], *, messages: int,
               track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The text of template `source` rendered with `context`, a conversation of `messages`
        messages (its bounds: `Bounds.for_messages`), and with `track` the character spans of its
        ``{% generation %}`` blocks (transformers' `AssistantTracker`, as `apply_chat_template`
        tracks them).

        Raises:
            RenderBound, ContainerWritten: a rule of the module docstring is broken.
            Exception: whatever the template raises (its `raise_exception`, a missing field).
        """
        bounds = Bounds.for_messages(messages)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with self.environment.bounded(bounds):
            template = self._compiled.get(source)
            if template is None:  # bounded too: compiling computes constant expressions (filters of literals)
                template = self._compiled[source] = self.environment.from_string(source)
            tracker = self.environment.activate_tracker(blocks, spans) if track else _untracked()
            with tracker:
                size = 0
                for block in template.generate(**context):
                    size += len(block)
                    if size > bounds.chars:
                        raise RenderBound(f"its output grows past {bounds.chars:,} characters, the bound")
                    blocks.append(block)
        return "".join(blocks), spans


@contextmanager
def _untracked() -> Iterator[None]:
    yield


def transformers_sandbox() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in, as it builds it (its private
    `_compile_jinja_template`, whose environment holds its globals, filters and tracker;
    tests/unit/test_chat_template.py compares renderings with `apply_chat_template`)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment
