"""The model's chat template, rendered and tokenized by transformers, never by a template of ours.

    template = ChatTemplate.load(Path("models/Qwen3-30B-A3B"))    # tokenizer.json + its configs
    ids = template.tokens(messages)                               # the template's rendering, tokenized
    ids, mask = template.marked(messages)                         # with {% generation %} spans (has_markers)

The template is the one transformers itself reads from the tokenizer's folder: `chat_template.jinja`
beside `tokenizer.json` first, else `tokenizer_config.json`'s `chat_template` (a string, or a list
of named templates of which the default, or `tool_use` when the row has tools, is taken). The
ids are exactly the rendering's (`add_special_tokens=False`): a template that writes BOS itself
(DeepSeek-V3's) gets one BOS, never two, and nothing is appended.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchmoe.data.errors import DataConfigError

__all__ = ["GENERATION_TAG", "ChatTemplate", "Messages", "TemplateRefused"]

Messages = Sequence[dict[str, Any]]
# transformers' own test for a template with generation markers (`render_jinja_template`).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class TemplateRefused(Exception):
    """The template raised on a conversation (its `raise_exception`, a missing field): the row's
    fault, which the caller names."""


class ChatTemplate:
    """The chat template and tokenizer of one tokenizer folder, through transformers.

    Args:
        tokenizer: a transformers tokenizer holding its chat template.
        folder: where it was read, for messages.
    """

    def __init__(self, tokenizer: Any, folder: Path) -> None:
        self.tokenizer = tokenizer
        self.folder = folder

    @classmethod
    def load(cls, folder: Path, *, key: str = "model.tokenizer_path") -> ChatTemplate:
        """The tokenizer of `folder` (its tokenizer.json, tokenizer_config.json and
        chat_template.jinja), read offline.

        Raises:
            DataConfigError: transformers is missing, cannot read the folder, or finds no chat template.
        """
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise DataConfigError(key, str(folder), 'rendering chat templates (training.dataset = "chat") needs '
                                  "the 'transformers' package", "pip install transformers") from e
        with _quiet_transformers():
            try:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
            except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a folder it cannot read
                raise DataConfigError(key, str(folder), f"transformers cannot read its tokenizer ({type(e).__name__}: "
                                      f"{e})", "point it at the folder holding the model's tokenizer.json and "
                                      "tokenizer_config.json") from None
        if not tokenizer.chat_template:
            raise DataConfigError(key, str(folder), "its tokenizer has no chat template (no chat_template.jinja "
                                  "beside tokenizer.json, no chat_template in tokenizer_config.json)",
                                  "use the tokenizer folder of the chat model you fine-tune, or write its template "
                                  "to chat_template.jinja there")
        return cls(tokenizer, folder)

    def template(self, tools: list[Any] | None) -> str:
        """The template text a conversation (with `tools` or not) is rendered with."""
        return self.tokenizer.get_chat_template(None, tools)

    def has_markers(self, tools: list[Any] | None = None) -> bool:
        """Whether that template marks the assistant's text with {% generation %} blocks."""
        return bool(GENERATION_TAG.search(self.template(tools)))

    def tokens(self, messages: Messages, tools: list[Any] | None = None, *,
               add_generation_prompt: bool = False) -> list[int]:
        """The token ids of the rendering of `messages` (and the generation prompt after them)."""
        return self._apply(messages, tools, add_generation_prompt=add_generation_prompt)["input_ids"]

    def marked(self, messages: Messages, tools: list[Any] | None = None) -> tuple[list[int], list[int]]:
        """The token ids of `messages` and the template's assistant mask: 1 for every token that
        overlaps a {% generation %} span (transformers' `return_assistant_tokens_mask`)."""
        out = self._apply(messages, tools, return_assistant_tokens_mask=True)
        return out["input_ids"], out["assistant_masks"]

    def _apply(self, messages: Messages, tools: list[Any] | None, **kwargs: Any) -> dict[str, Any]:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=True, return_dict=True,
                                                      **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors are the row's to fix
            raise TemplateRefused(f"{type(e).__name__}: {e}") from None


@contextmanager
def _quiet_transformers() -> Any:
    """transformers logs, as warnings, that a tokenizer folder has no model config: not ours to show."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
