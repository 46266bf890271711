"""Which tokens of a rendered conversation are trained on (`training.loss_on`), exactly.

    rendered = render(template, conversation, "assistant", where="chat.jsonl:12", limit=4097)
    rendered.ids    # the template's rendering, tokenized (nothing added), cut to `limit` tokens
    rendered.mask   # 1 for each of those tokens the loss is taken on (a target), else 0
    rendered.length # the rendering's tokens before the cut

- "all": every token.
- "assistant" (the default): the tokens of the assistant's turns (of a prompt/completion row, the
  completion's assistant turns);
- "last": those of the last assistant turn only.

Where the template marks the assistant's text with {% generation %} blocks, the mask is
transformers' own (`return_assistant_tokens_mask`: every token that overlaps a block). Elsewhere
a turn's text is found from prefixes: the conversation before turn k rendered with the generation
prompt (P) and the conversation through turn k (F) must both begin the whole conversation's
rendering; the turn is then its text between them, everything the template writes for it after
the generation prompt, its end-of-turn tokens included, and its tokens are those that overlap that
text, as transformers marks a {% generation %} block's (so a template without markers gives the
mask the same template with markers around each turn gives). A template that renders a prefix
otherwise (Qwen3's and gpt-oss's drop the reasoning of earlier turns) leaves a turn's tokens
unknown: that is refused (naming the row and the turn), never trained on every token instead.

Each turn costs two renderings of the conversation up to it, so a conversation of n messages
costs n^2 / 2 messages rendered. Only the turns that begin within the row's `limit` tokens are
found (the rest is cut off), and one conversation's renderings may hold at most
`PREFIX_MESSAGES` messages in all: a longer one is refused, naming the fixes (`loss_on = "last"`,
one prefix a conversation, or a template with markers, none).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torchmoe.data.chat.chat_template import ChatTemplate, TemplateRefused, overlapping
from torchmoe.data.errors import DataConfigError

__all__ = ["PREFIX_MESSAGES", "Conversation", "Rendered", "render"]

PREFIX_MESSAGES = 100_000
"""The most messages the prefix renderings of one conversation may render in all: a conversation
of some 450 messages whose turns all lie in the row (a few seconds of a template's work)."""

_MARKERS = "a chat template that marks the assistant's text with {% generation %} ... {% endgeneration %} " \
    "(chat_template.jinja beside tokenizer.json)"


@dataclass(frozen=True)
class Conversation:
    """One row as the template takes it."""

    messages: list[dict[str, Any]]
    """Its messages: each a dict with a role, passed to the template as they are (tool_calls...)."""
    tools: list[Any] | None = None
    """The row's tool schemas, for templates that render them."""
    first_target: int = 0
    """The first message whose assistant turns may be targets: 0, or the prompt's length of a
    prompt/completion row."""


@dataclass(frozen=True)
class Rendered:
    """A conversation's token ids and, per token, 1 where it is a target; `length` the tokens of
    the whole rendering, of which `ids` may be the first `limit`."""

    ids: list[int]
    mask: list[int]
    length: int

    @classmethod
    def cut(cls, ids: list[int], mask: list[int], limit: int | None) -> Rendered:
        return cls(ids[:limit], mask[:limit], len(ids))


def render(template: ChatTemplate, conversation: Conversation, loss_on: str, *, where: str,
           source: tuple[str, str], limit: int | None = None) -> Rendered:
    """The tokens of `conversation` through `template` and its mask for `loss_on`, the first
    `limit` of them (None: all); `where` names the row (``file:line``) and `source` the dataset
    setting and its value, for messages.

    Raises:
        DataConfigError: the template refuses the row or breaks a bound of its sandbox, a turn
            to train on cannot be found (the template is not prefix-stable there), or finding
            them would render more than `PREFIX_MESSAGES` messages.
    """
    messages, tools = conversation.messages, conversation.tools
    turns = [k for k, message in enumerate(messages)
             if k >= conversation.first_target and message.get("role") == "assistant"]
    if loss_on == "last":
        turns = turns[-1:]
    with _refusals(template, conversation, where, source):
        if loss_on == "all" or not turns:
            ids, _ = template.encode(template.text(messages, tools))
            return Rendered.cut(ids, [int(loss_on == "all")] * len(ids), limit)
        if template.has_markers(tools):
            text, spans = template.render(messages, tools, track=True)
            ids, offsets = template.encode(text)
            if len(turns) < sum(1 for message in messages if message.get("role") == "assistant"):
                start = _prefix(template, conversation, turns[0], text, loss_on, where)
                spans = [(max(a, start), b) for a, b in spans if b > start]
            return Rendered.cut(ids, overlapping(offsets, spans), limit)
        given = template.given(messages)  # once: its prefixes are the prefixes' own
        text, _ = template.render(given, tools, given=True)
        ids, offsets = template.encode(text)
        starts = [a for a, _ in offsets]
        spans, rendered = [], 0
        for k in turns:
            rendered += 2 * k + 1
            if rendered > PREFIX_MESSAGES:
                raise _too_long(template, conversation, len(turns), loss_on, where)
            start = _prefix(template, conversation, k, text, loss_on, where, given)
            if limit is not None and bisect.bisect_left(starts, start) >= limit:
                break  # this turn and the later ones are cut off
            through = template.text(given[:k + 1], tools, given=True)
            if not text.startswith(through) or len(through) < start:
                raise _unstable(template, k, loss_on, where)
            spans.append((start, len(through)))
        return Rendered.cut(ids, overlapping(offsets, spans), limit)


def _prefix(template: ChatTemplate, conversation: Conversation, k: int, text: str, loss_on: str,
            where: str, given: list[dict[str, Any]] | None = None) -> int:
    """Where turn `k` begins in `text`, the whole conversation's rendering: the length of the
    rendering of the messages before it with the generation prompt, which `text` must begin with
    (`given`: the messages as the template is given them, made once)."""
    if k == 0:
        raise DataConfigError("training.loss_on", loss_on, f"{where}, turn 0 (messages[0], the assistant's): it "
                              "begins the conversation, so no prompt comes before it and where its turn begins cannot "
                              "be told",
                              "start the conversation with the message the assistant answers (system or user)")
    messages = conversation.messages if given is None else given
    before = template.text(messages[:k], conversation.tools, add_generation_prompt=True, given=given is not None)
    if not text.startswith(before):
        raise _unstable(template, k, loss_on, where)
    return len(before)


def _too_long(template: ChatTemplate, conversation: Conversation, turns: int, loss_on: str,
              where: str) -> DataConfigError:
    return DataConfigError(
        "training.loss_on", loss_on,
        f"{where}: finding the tokens of its {turns} assistant turns renders the conversation up to each turn, "
        f"more than {PREFIX_MESSAGES:,} messages in all for its {len(conversation.messages)} (the bound): the chat "
        f"template of {template.folder} has no {{% generation %}} markers",
        'set training.loss_on = "last" (the last assistant turn of each conversation: one rendering of its prefix), '
        f"use {_MARKERS} (no prefix rendered), or split the conversation into shorter ones",
    )  # fmt: skip


def _unstable(template: ChatTemplate, k: int, loss_on: str, where: str) -> DataConfigError:
    marked = "" if template.has_markers() else ", and it has no {% generation %} markers"
    fix = ('set training.loss_on = "last" (only the last assistant turn of each conversation, whose prefix such '
           f"templates render alike), or use {_MARKERS}") if loss_on == "assistant" else \
        f'use {_MARKERS}, or set training.loss_on = "all" to train on every token'
    return DataConfigError(
        "training.loss_on", loss_on,
        f"{where}, turn {k} (messages[{k}], the assistant's): the chat template of {template.folder} renders the "
        "conversation before that turn (with the generation prompt) or through it as text that the whole "
        "conversation's rendering does not begin with (it is not prefix-stable there: e.g. it drops the reasoning of "
        f"earlier turns){marked}, so which tokens are that turn's cannot be known", fix,
    )  # fmt: skip


@contextmanager
def _refusals(template: ChatTemplate, conversation: Conversation, where: str, source: tuple[str, str]) -> Iterator[None]:
    """The template's refusal of a row (`TemplateRefused`) as one error: a bound of its sandbox
    broken is the template's (its setting named), a container written as text the row's field
    that holds it, anything else the row's."""
    try:
        yield
    except TemplateRefused as err:
        if err.bound:
            raise DataConfigError(template.key, str(template.folder), f"{where}: its chat template stopped: "
                                  f"{err.problem}", "fix the chat template (chat_template.jinja, or tokenizer_config."
                                  "json's chat_template): these bounds hold for any template that renders each "
                                  "conversation once over") from None
        if err.written is not None:
            field = _place(err.written, {"messages": conversation.messages, "tools": conversation.tools})
            if field is None:
                raise DataConfigError(template.key, str(template.folder), f"{where}: its chat template {err.problem} "
                                      "(a value of its own)", "fix the chat template: write text, or a value "
                                      "through a filter such as tojson") from None
            raise DataConfigError(*source, f"{where}: the chat template of {template.folder} writes its {field} (a "
                                  f"{type(err.written).__name__}) into the text as its Python repr",
                                  f"write {field} as a string; or, for content parts ([{{\"type\": \"text\", "
                                  '"text": ...}]), use a chat template that iterates them, as multimodal templates '
                                  "do") from None
        raise DataConfigError(*source, f"{where}: the chat template refuses this conversation ({err.problem})",
                              "fix the row (its roles, their order and fields) or remove it") from None


def _place(value: Any, data: Any, path: str = "") -> str | None:
    """The path (``messages[2].content``) of the first item of `data` equal to `value` (a
    container: the template got a plain copy), or None."""
    if type(data) is type(value) and data == value and path:
        return path
    items: Sequence[tuple[str, Any]] = ()
    if isinstance(data, dict):
        items = [(f"{path}.{key}" if path else str(key), item) for key, item in data.items()]
    elif isinstance(data, (list, tuple)):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(data)]
    return next((found for key, item in items if (found := _place(value, item, key)) is not None), None)
