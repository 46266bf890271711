"""The model's chat template, rendered and tokenized by transformers, never by a template of ours.

    template = ChatTemplate.load(Path("models/Qwen3-30B-A3B"))    # tokenizer.json + its configs
    ids = template.tokens(messages)                               # the template's rendering, tokenized
    ids, mask = template.marked(messages)                         # with {% generation %} spans (has_markers)

The template is the one transformers itself takes from the tokenizer's folder: `chat_template.jinja`
beside `tokenizer.json` first (with `additional_chat_templates/*.jinja`), else
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which the
default, or `tool_use` when the row has tools, is rendered). The folder's files are read here and
handed to a `PreTrainedTokenizerFast` (transformers' own `from_pretrained` is not used: a config
can point it at code, and torchmoe runs none from a data file). The
ids are exactly the rendering's (`add_special_tokens=False`): a template that writes BOS itself
(DeepSeek-V3's) gets one BOS, never two, and nothing is appended.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchmoe.config.paths import path_faults
from torchmoe.data.errors import DataConfigError
from torchmoe.data.tokenizer import _json_object

__all__ = ["GENERATION_TAG", "ChatTemplate", "Messages", "TemplateRefused"]

Messages = Sequence[dict[str, Any]]
# transformers' own test for a template with generation markers (`render_jinja_template`).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# The special tokens a tokenizer config names, which templates read by name ({{ bos_token }}).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
        """The tokenizer of `folder`: its tokenizer.json, with the special tokens and the chat
        template(s) its files name, read as transformers reads a local folder (its own loader is
        not used: it may follow a config to code).

        Raises:
            DataConfigError: transformers is missing, a file cannot be read, or there is no chat template.
        """
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise DataConfigError(key, str(folder), 'rendering chat templates (training.dataset = "chat") needs '
                                  "the 'transformers' package", "pip install transformers") from e
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as in transformers
            if (folder / name).exists():
                config.update(_json_object(folder / name, str(folder), key))
        specials = {field: value["content"] if isinstance(value, dict) else value
                    for field in _SPECIAL_TOKENS if isinstance(value := config.get(field), (str, dict))}
        templates = _templates(folder, config, key)
        if not templates:
            raise DataConfigError(key, str(folder), "its tokenizer has no chat template (no chat_template.jinja "
                                  "beside tokenizer.json, no chat_template in tokenizer_config.json)",
                                  "use the tokenizer folder of the chat model you fine-tune, or write its template "
                                  "to chat_template.jinja there")
        chosen = templates["default"] if list(templates) == ["default"] else templates
        with path_faults(key, str(folder), "give the folder of the model's tokenizer.json", error=DataConfigError):
            (folder / "tokenizer.json").stat()  # the OS's reason when it cannot be read
        try:
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=chosen,
                                                **specials)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
            raise DataConfigError(key, str(folder), f"transformers cannot read its tokenizer ({type(e).__name__}: "
                                  f"{e})", "point it at the folder holding the model's tokenizer.json") from None
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
        return self._apply(messages, tools, tokenize=True, return_dict=True,
                           add_generation_prompt=add_generation_prompt)["input_ids"]

    def text(self, messages: Messages, tools: list[Any] | None = None, *, add_generation_prompt: bool = False) -> str:
        """The rendering of `messages` (and the generation prompt after them) as text."""
        return self._apply(messages, tools, tokenize=False, add_generation_prompt=add_generation_prompt)

    def marked(self, messages: Messages, tools: list[Any] | None = None) -> tuple[list[int], list[int]]:
        """The token ids of `messages` and the template's assistant mask: 1 for every token that
        overlaps a {% generation %} span (transformers' `return_assistant_tokens_mask`)."""
        out = self._apply(messages, tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return out["input_ids"], out["assistant_masks"]

    def _apply(self, messages: Messages, tools: list[Any] | None, **kwargs: Any) -> Any:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors are the row's to fix
            raise TemplateRefused(f"{type(e).__name__}: {e}") from None


def _templates(folder: Path, config: dict[str, Any], key: str) -> dict[str, str]:
    """The named chat templates of a tokenizer folder, as transformers takes them: chat_template.jinja
    (the default) and additional_chat_templates/NAME.jinja when they exist, else the config's
    `chat_template` (a string, or a list of {"name", "template"})."""
    with path_faults(key, str(folder), "fix the chat template files' permissions", error=DataConfigError):
        files = {"default": folder / "chat_template.jinja"} if (folder / "chat_template.jinja").is_file() else {}
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            files.update({file.stem: file for file in sorted(extra.glob("*.jinja"))})
        if files:
            return {name: file.read_text(encoding="utf-8") for name, file in files.items()}
    written = config.get("chat_template")
    if isinstance(written, str):
        return {"default": written}
    if isinstance(written, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in written):
        return {t["name"]: t["template"] for t in written}
    if written is not None:
        raise DataConfigError(key, str(folder), f"tokenizer_config.json's chat_template is a {type(written).__name__}, "
                              'not a template or a list of {"name", "template"}', "fix it, or write the template to "
                              "chat_template.jinja beside tokenizer.json")
    return {}
