"""Which tokens of a rendered conversation are trained on (`training.loss_on`), exactly.

    rendered = render(template, conversation, "assistant", where="chat.jsonl:12")
    rendered.ids    # the template's rendering, tokenized (nothing added)
    rendered.mask   # 1 for each token the loss is taken on (a target), else 0

- "all": every token.
- "assistant" (the default): the tokens of the assistant's turns (of a prompt/completion row, the
  completion's assistant turns);
- "last": those of the last assistant turn only.

Where the template marks the assistant's text with {% generation %} blocks, the mask is
transformers' own (`return_assistant_tokens_mask`). Elsewhere a turn's tokens are found from
prefixes: the conversation before turn k rendered with the generation prompt (P) and the
conversation through turn k (F) must both be token prefixes of the whole conversation's
rendering; the turn is then tokens [len(P), len(F)): everything the template writes for it after
the generation prompt, its end-of-turn tokens included. A template that renders a prefix otherwise
(Qwen3's and gpt-oss's drop the reasoning of earlier turns) leaves a turn's tokens unknown: that
is refused (naming the row and the turn), never trained on every token instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torchmoe.data.chat_template import ChatTemplate, TemplateRefused
from torchmoe.data.errors import DataConfigError

__all__ = ["Conversation", "Rendered", "render"]

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
    """A conversation's token ids and, per token, 1 where it is a target."""

    ids: list[int]
    mask: list[int]


def render(template: ChatTemplate, conversation: Conversation, loss_on: str, *, where: str,
           source: tuple[str, str]) -> Rendered:
    """The tokens of `conversation` through `template` and its mask for `loss_on`; `where` names
    the row (``file:line``) and `source` the dataset setting and its value, for messages.

    Raises:
        DataConfigError: the template refuses the row, or a turn to train on cannot be found
            (the template is not prefix-stable there).
    """
    messages, tools = conversation.messages, conversation.tools
    turns = [k for k, message in enumerate(messages)
             if k >= conversation.first_target and message.get("role") == "assistant"]
    if loss_on == "last":
        turns = turns[-1:]
    with _refusals(where, source):
        if loss_on == "all":
            ids = template.tokens(messages, tools)
            return Rendered(ids, [1] * len(ids))
        if not turns:
            ids = template.tokens(messages, tools)
            return Rendered(ids, [0] * len(ids))
        if template.has_markers(tools):
            ids, marks = template.marked(messages, tools)
            every_turn = len(turns) == sum(1 for message in messages if message.get("role") == "assistant")
            start = 0 if every_turn else _prefix(template, conversation, turns[0], ids, loss_on, where)
            return Rendered(ids, [mark if t >= start else 0 for t, mark in enumerate(marks)])
        ids = template.tokens(messages, tools)
        mask = [0] * len(ids)
        for k in turns:
            start = _prefix(template, conversation, k, ids, loss_on, where)
            through = template.tokens(messages[:k + 1], tools)
            if ids[:len(through)] != through or len(through) < start:
                raise _unstable(template, k, loss_on, where)
            mask[start:len(through)] = [1] * (len(through) - start)
        return Rendered(ids, mask)


def _prefix(template: ChatTemplate, conversation: Conversation, k: int, ids: list[int], loss_on: str,
            where: str) -> int:
    """Where turn `k` begins in `ids`: the length of the rendering of the messages before it with
    the generation prompt, which `ids` must begin with."""
    if k == 0:
        raise DataConfigError("training.loss_on", loss_on, f"{where}, turn 0 (messages[0], the assistant's): it "
                              "begins the conversation, so no prompt comes before it and where its turn begins cannot "
                              "be told",
                              "start the conversation with the message the assistant answers (system or user)")
    before = template.tokens(conversation.messages[:k], conversation.tools, add_generation_prompt=True)
    if ids[:len(before)] != before:
        raise _unstable(template, k, loss_on, where)
    return len(before)


def _unstable(template: ChatTemplate, k: int, loss_on: str, where: str) -> DataConfigError:
    marked = "" if template.has_markers() else ", and it has no {% generation %} markers"
    fix = ('set training.loss_on = "last" (only the last assistant turn of each conversation, whose prefix such '
           f"templates render alike), or use {_MARKERS}") if loss_on == "assistant" else \
        f'use {_MARKERS}, or set training.loss_on = "all" to train on every token'
    return DataConfigError(
        "training.loss_on", loss_on,
        f"{where}, turn {k} (messages[{k}], the assistant's): the chat template of {template.folder} renders the "
        "conversation before that turn (with the generation prompt) or through it as tokens that the whole "
        "conversation does not begin with (it is not prefix-stable there: e.g. it drops the reasoning of earlier "
        f"turns){marked}, so which tokens are that turn's cannot be known", fix,
    )  # fmt: skip


@contextmanager
def _refusals(where: str, source: tuple[str, str]) -> Iterator[None]:
    """The template's own refusal of a row (`TemplateRefused`), as the row's error."""
    try:
        yield
    except TemplateRefused as err:
        raise DataConfigError(*source, f"{where}: the chat template refuses this conversation ({err})",
                              "fix the row (its roles, their order and fields) or remove it") from None
