"""The model's chat template, rendered as transformers renders it and tokenized by transformers.

    template = ChatTemplate.load(Path("models/Qwen3-30B-A3B"))    # tokenizer.json + its configs
    ids = template.tokens(messages)                               # the template's rendering, tokenized
    ids, mask = template.marked(messages)                         # with {% generation %} spans (has_markers)
    ids, offsets = template.encode(template.text(messages))       # each token's characters

The template is the one transformers itself takes from the tokenizer's folder: `chat_template.jinja`
beside `tokenizer.json` first (with `additional_chat_templates/*.jinja`), else
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which the
default, or `tool_use` when the row has tools, is rendered). The folder's files are read here and
handed to a `PreTrainedTokenizerFast` (transformers' own `from_pretrained` is not used: a config
can point it at code, and torchmoe runs none from a data file). A template is rendered in
transformers' sandbox, bounded (`template_sandbox`: its work, the sizes of what it builds, no
container written as its Python repr), with the data transformers gives it (the messages and
tools as plain data, a message's reasoning under each name templates read, the special tokens by
name); within the bounds the text, the ids and the assistant mask are `apply_chat_template`'s
(tests/unit/test_chat_template.py compares them). The ids are exactly the rendering's
(`add_special_tokens=False`): a template that writes BOS itself (DeepSeek-V3's) gets one BOS,
never two, and nothing is appended.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchmoe.config.files.paths import path_faults
from torchmoe.config.files.text import NotUTF8, utf8_text
from torchmoe.data import read_bounds
from torchmoe.data.chat.template_sandbox import ContainerWritten, RenderBound, TemplateSandbox, transformers_sandbox
from torchmoe.data.errors import DataConfigError, shown_json
from torchmoe.data.read_bounds import read_whole
from torchmoe.data.tokenizer import _json_object, special_tokens

__all__ = ["GENERATION_TAG", "ChatTemplate", "Messages", "TemplateRefused", "overlapping"]

Messages = Sequence[dict[str, Any]]
# transformers' own test for a template with generation markers (`render_jinja_template`).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# The special tokens a tokenizer config names, which templates read by name ({{ bos_token }}).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TEMPLATE_FIX = "write the chat template to chat_template.jinja beside tokenizer.json as UTF-8 text"


class TemplateRefused(Exception):
    """The template raised on a conversation (its `raise_exception`, a missing field), broke a
    bound of the sandbox (`bound` True: the template's fault) or wrote `written`, a container of
    the conversation, as its Python repr."""

    def __init__(self, problem: str, *, bound: bool = False, written: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.bound, self.written = problem, bound, written


class ChatTemplate:
    """The chat template and tokenizer of one tokenizer folder, through transformers.

    Args:
        tokenizer: a transformers tokenizer holding its chat template.
        folder: where it was read, and `key` the setting that named it, for messages.
    """

    def __init__(self, tokenizer: Any, folder: Path, key: str = "model.tokenizer_path") -> None:
        self.tokenizer = tokenizer
        self.folder, self.key = folder, key
        self._sandbox = TemplateSandbox(transformers_sandbox())

    @classmethod
    def load(cls, folder: Path, *, key: str = "model.tokenizer_path") -> ChatTemplate:
        """The tokenizer of `folder`: its tokenizer.json, with the special tokens and the chat
        template(s) its files name, read as transformers reads a local folder (its own loader is
        not used: it may follow a config to code).

        Raises:
            DataConfigError: transformers is missing, a file cannot be read (or is not a regular
                file, or is larger than its bound), a special token is named in a form transformers
                does not take or is not in tokenizer.json, there is no chat template, or of several
                none is the default.
        """
        try:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise DataConfigError(key, str(folder), 'rendering chat templates (training.dataset = "chat") needs '
                                  "the 'transformers' package", "pip install transformers") from e
        config: dict[str, Any] = {}
        specials: dict[str, str] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as in transformers
            if (folder / name).exists():
                read = _json_object(folder / name, str(folder), key)
                config.update(read)
                specials.update(special_tokens(read, _SPECIAL_TOKENS, folder / name, str(folder), key))
        templates = _templates(folder, config, key)
        if not templates:
            raise DataConfigError(key, str(folder), "its tokenizer has no chat template (no chat_template.jinja "
                                  "beside tokenizer.json, no chat_template in tokenizer_config.json)",
                                  "use the tokenizer folder of the chat model you fine-tune, or write its template "
                                  "to chat_template.jinja there")
        if "default" not in templates:  # transformers renders a conversation without tools with it
            raise DataConfigError(key, str(folder), f"its chat templates are named {sorted(templates)}, and none is "
                                  '"default", the one transformers renders a conversation with',
                                  'name the template to train with "default"')
        chosen = templates["default"] if list(templates) == ["default"] else templates
        data = read_whole(folder / "tokenizer.json", key=key, value=str(folder),
                          fix="give the folder of the model's tokenizer.json")
        try:
            vocabulary = Tokenizer.from_str(utf8_text(data, nul=False))
        except NotUTF8 as e:
            raise DataConfigError(key, str(folder), f"tokenizer.json {e.problem}", e.fix("tokenizer.json")) from None
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
            raise DataConfigError(key, str(folder), f"transformers cannot read its tokenizer ({type(e).__name__}: "
                                  f"{e})", "point it at the folder holding the model's tokenizer.json") from None
        for field, token in specials.items():  # transformers would add it to the vocabulary, past the model's
            if vocabulary.token_to_id(token) is None:
                raise DataConfigError(key, str(folder), f"its config names {field} {token!r}, which tokenizer.json "
                                      "does not hold", f"fix {field} in tokenizer_config.json / "
                                      "special_tokens_map.json, or use the tokenizer.json they belong to")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocabulary, chat_template=chosen, **specials)
        return cls(tokenizer, folder, key)

    def template(self, tools: list[Any] | None) -> str:
        """The template text a conversation (with `tools` or not) is rendered with."""
        return self.tokenizer.get_chat_template(None, tools)

    def has_markers(self, tools: list[Any] | None = None) -> bool:
        """Whether that template marks the assistant's text with {% generation %} blocks."""
        return bool(GENERATION_TAG.search(self.template(tools)))

    def render(self, messages: Messages, tools: list[Any] | None = None, *, add_generation_prompt: bool = False,
               track: bool = False, given: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The text of `messages` (and the generation prompt after them) as the template renders
        it, and with `track` the character spans of its {% generation %} blocks; `given`: the
        messages are already as the template is given them (`given`: a prefix of a conversation
        so made is the same prefix, made once).

        Raises:
            TemplateRefused: the template raised, broke a bound, or wrote a container as text.
        """
        messages = list(messages)
        context = {**self.tokenizer.special_tokens_map, "messages": messages if given else self.given(messages),
                   "tools": _plain(tools), "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            return self._sandbox.render(self.template(tools), context, messages=len(messages) + len(tools or ()),
                                        track=track)
        except RenderBound as e:
            raise TemplateRefused(e.problem, bound=True) from None
        except ContainerWritten as e:
            raise TemplateRefused(str(e), written=e.value) from None
        except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors are the row's to fix
            raise TemplateRefused(f"{type(e).__name__}: {e}") from None

    @staticmethod
    def given(messages: Messages) -> list[dict[str, Any]]:
        """`messages` as `apply_chat_template` gives them to a template: fields that are None
        dropped, plain data, each message's reasoning also under the other names templates read it
        by (transformers' own helpers, where this version has them). Each message is made alone,
        so the first k of them made are the first k made."""
        from transformers.utils import chat_template_utils as helpers

        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return getattr(helpers, "_alias_reasoning_fields", lambda chat: chat)(_plain(messages))

    def text(self, messages: Messages, tools: list[Any] | None = None, *, add_generation_prompt: bool = False,
             given: bool = False) -> str:
        """The rendering of `messages` (and the generation prompt after them) as text (`given` as `render`'s)."""
        return self.render(messages, tools, add_generation_prompt=add_generation_prompt, given=given)[0]

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids of `text`, as `apply_chat_template` tokenizes a rendering (no special
        tokens added), and each token's character span.

        Raises:
            TemplateRefused: the tokenizer cannot take it (a lone surrogate the template wrote).
        """
        try:
            out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception as e:  # noqa: BLE001 - the tokenizers library's own TypeError for text it cannot take
            raise TemplateRefused(f"its rendering cannot be tokenized ({type(e).__name__}: {e})") from None
        return out["input_ids"], out["offset_mapping"]

    def tokens(self, messages: Messages, tools: list[Any] | None = None, *,
               add_generation_prompt: bool = False) -> list[int]:
        """The token ids of the rendering of `messages` (and the generation prompt after them)."""
        return self.encode(self.text(messages, tools, add_generation_prompt=add_generation_prompt))[0]

    def marked(self, messages: Messages, tools: list[Any] | None = None) -> tuple[list[int], list[int]]:
        """The token ids of `messages` and the template's assistant mask: 1 for every token that
        overlaps a {% generation %} span (transformers' `return_assistant_tokens_mask`)."""
        text, spans = self.render(messages, tools, track=True)
        ids, offsets = self.encode(text)
        return ids, overlapping(offsets, spans)


def overlapping(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Per token (its character span in `offsets`), 1 where it overlaps one of `spans` (in order),
    else 0: transformers' assistant mask of {% generation %} spans (`apply_chat_template`)."""
    mask = [0] * len(offsets)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask


def _plain(value: Any) -> Any:
    """`value` rebuilt of plain data, as transformers gives a template its inputs (where this
    version does)."""
    from transformers.utils import chat_template_utils as helpers

    return getattr(helpers, "_plain_template_data", lambda data: data)(value)


def _templates(folder: Path, config: dict[str, Any], key: str) -> dict[str, str]:
    """The named chat templates of a tokenizer folder, as transformers takes them: chat_template.jinja
    (the default) and additional_chat_templates/NAME.jinja when they exist, else the config's
    `chat_template` (a string, or a list of {"name", "template"})."""
    with path_faults(key, str(folder), "fix the chat template files' permissions", error=DataConfigError):
        files = {"default": folder / "chat_template.jinja"} if (folder / "chat_template.jinja").exists() else {}
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            files.update({file.stem: file for file in sorted(extra.glob("*.jinja"))})
    if files:
        return {name: _template_file(file, folder, key) for name, file in files.items()}
    written = config.get("chat_template")
    if isinstance(written, str):
        return {"default": written}
    named = written if isinstance(written, list) else []
    if written is not None and not (named and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  and isinstance(t.get("template"), str) for t in named)):
        raise DataConfigError(key, str(folder), f"tokenizer_config.json's chat_template is {shown_json(written)}, not a "
                              'template (a string) or a list of {"name": str, "template": str}',
                              f"fix it, or {_TEMPLATE_FIX}")
    return {t["name"]: t["template"] for t in named}


def _template_file(file: Path, folder: Path, key: str) -> str:
    """The text of a chat template file (UTF-8, a regular file within `read_bounds.TEMPLATE_BYTES`)."""
    data = read_whole(file, key=key, value=str(folder), fix="fix its permissions, or remove it",
                      large_fix=f"use the model's own {file.name}", limit=read_bounds.TEMPLATE_BYTES)
    try:
        return utf8_text(data, nul=False)
    except NotUTF8 as e:
        raise DataConfigError(key, str(folder), f"{file} {e.problem}", e.fix(file)) from None
