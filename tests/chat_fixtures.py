"""Tiny tokenizer folders with chat templates, made offline, for the chat data tests.

The templates are written here after the real families' (none copied): ChatML as Qwen3 writes it
(with and without {% generation %} markers), Qwen3's reasoning, which it keeps only for the turns
after the last user message (not prefix-stable), DeepSeek-V3's (the template writes BOS itself),
and gpt-oss's harmony format, whose last assistant turn ends in <|return|> (not prefix-stable).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, processors

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
DEEPSEEK_SPECIALS = ["<bos>", "<eos>", "<User>", "<Assistant>", "<tool_out>"]
HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"]

_TURN = "<|im_start|>{{ m.role }}\n"
_CALLS = "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}({{ c.function.arguments | tojson }})" \
    "</tool_call>{% endfor %}"
_CHATML_BODY = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}" + _TURN +
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content or '' }}" + _CALLS + "<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = _CHATML_BODY
CHATML = _CHATML_BODY.replace("{% generation %}", "").replace("{% endgeneration %}", "")

# Qwen3: reasoning is shown only for the assistant turns after the last user message.
QWEN3_REASONING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_user %}<think>\n{{ m.reasoning_content or '' }}\n"
    "</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_DEEPSEEK_BODY = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<User>{{ m.content }}"
    "{% elif m.role == 'tool' %}<tool_out>{{ m.content }}"
    "{% else %}<Assistant>{% generation %}{{ m.content }}<eos>{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<Assistant>{% endif %}"
)
DEEPSEEK_MARKED = _DEEPSEEK_BODY
DEEPSEEK = _DEEPSEEK_BODY.replace("{% generation %}", "").replace("{% endgeneration %}", "")

# gpt-oss: the last assistant turn ends with <|return|>, earlier ones with <|end|>.
HARMONY = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}{% if m.role == 'assistant' and loop.last %}<|return|>{% else %}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def tokenizer_folder(folder: Path, template: str | list[dict[str, str]] | None, specials: list[str], *, eos: str, bos: str | None = None,
                     jinja_file: str | None = None, prepend_bos: bool = False) -> Path:
    """A tokenizer folder: a character-level BPE (printable ASCII and newline, with a few merges)
    plus `specials`, its tokenizer_config.json naming `eos` (and `bos`) and holding `template`,
    and `jinja_file` as chat_template.jinja when given. `prepend_bos`: the tokenizer's post-processor
    puts BOS before every encoding (as Llama's does) unless special tokens are left out."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    merges = [("a", "s"), ("as", "s"), ("t", "h"), ("th", "e"), ("\n", "\n"), ("o", "u")]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(specials)
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos, "bos_token": bos, "model_max_length": 1 << 20}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder


def chatml(folder: Path, *, marked: bool) -> Path:
    return tokenizer_folder(folder, CHATML_MARKED if marked else CHATML, CHATML_SPECIALS, eos="<|im_end|>")


def deepseek(folder: Path, *, marked: bool) -> Path:
    return tokenizer_folder(folder, DEEPSEEK_MARKED if marked else DEEPSEEK, DEEPSEEK_SPECIALS, eos="<eos>",
                            bos="<bos>", prepend_bos=True)


CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
     {"role": "assistant", "content": "hello, as asked"}, {"role": "user", "content": "the sum?"},
     {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "it rains\n\nthough"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}],
]
"""Multi-turn, with a system prompt; a tool call and its answer; one turn."""
