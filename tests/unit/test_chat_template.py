"""Chat templates render in a bounded sandbox exactly as transformers renders them: the text, the
ids and the assistant masks of `apply_chat_template` (content parts included); the bounds on work
and size stop a template that never ends or fills memory, each with one message; no escape from
jinja2's sandbox opens; a container written as text names its field.

    python -m pytest -q tests/unit/test_chat_template.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.chat_fixtures import (
    CHATML_SPECIALS,
    CONVERSATIONS,
    HARMONY,
    HARMONY_SPECIALS,
    QWEN3_REASONING,
    chatml,
    deepseek,
    tokenizer_folder,
)
from torchmoe.data.chat import template_sandbox
from torchmoe.data.chat.chat_masks import Conversation, render
from torchmoe.data.chat.chat_template import ChatTemplate, TemplateRefused
from torchmoe.data.chat.template_sandbox import RenderBound, TemplateSandbox, transformers_sandbox
from torchmoe.data.errors import DataConfigError

SOURCE = ("training.dataset_path", "chat.jsonl")

# A multimodal template's way with content: a string as it is, else each part by its type.
PARTS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for part in m.content %}{% if part.type == 'text' %}{{ part.text }}{% elif part.type == 'image' %}<think>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
WITH_PARTS = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
              {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"},
                                           {"type": "text", "text": "?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]
# The answer's first newline merges with the header's ("\n\n" is one token): a token that straddles
# the start of a {% generation %} block is marked, as transformers marks every token overlapping one.
STRADDLE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\nthe answer"}]
REASONING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "r1"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "thinking": "r2"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "chatml": chatml(root / "chatml", marked=False),
        "chatml_marked": chatml(root / "chatml_marked", marked=True),
        "deepseek_marked": deepseek(root / "deepseek_marked", marked=True),
        "qwen3": tokenizer_folder(root / "qwen3", QWEN3_REASONING, CHATML_SPECIALS, eos="<|im_end|>"),
        "harmony": tokenizer_folder(root / "harmony", HARMONY, HARMONY_SPECIALS, eos="<|return|>"),
        "parts": tokenizer_folder(root / "parts", PARTS, CHATML_SPECIALS, eos="<|im_end|>"),
    }


CASES = [("chatml", c) for c in CONVERSATIONS] + [("chatml_marked", c) for c in CONVERSATIONS] + [
    ("chatml_marked", STRADDLE), ("chatml", STRADDLE), ("deepseek_marked", CONVERSATIONS[1]), ("qwen3", REASONING), ("harmony", CONVERSATIONS[0]),
    ("parts", WITH_PARTS), ("parts", CONVERSATIONS[0])]


@pytest.mark.parametrize(("family", "messages"), CASES)
@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "get_weather"}}]])
def test_renderings_are_transformers_own(folders, family, messages, tools):
    """Text (with and without the generation prompt), ids and the assistant mask equal
    `apply_chat_template`'s, reasoning under its older names and content parts included."""
    ours, theirs = ChatTemplate.load(folders[family]), AutoTokenizer.from_pretrained(folders[family])
    for prompt in (False, True):
        assert ours.text(messages, tools, add_generation_prompt=prompt) == theirs.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
        assert ours.tokens(messages, tools, add_generation_prompt=prompt) == theirs.apply_chat_template(
            messages, tools=tools, add_generation_prompt=prompt, return_dict=True)["input_ids"]
    if ours.has_markers(tools):
        want = theirs.apply_chat_template(messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True)
        assert ours.marked(messages, tools) == (want["input_ids"], want["assistant_masks"])
        assert 0 < sum(want["assistant_masks"]) < len(want["input_ids"])


def test_content_parts_are_trained_as_the_template_renders_them(folders):
    """A template that iterates content parts: the assistant's parts are the targets, and the
    text is transformers' (the parts' texts and the image's token, no Python repr)."""
    template = ChatTemplate.load(folders["parts"])
    rendered = render(template, Conversation(WITH_PARTS), "assistant", where="chat.jsonl:3", source=SOURCE)
    tokens = template.tokenizer.convert_ids_to_tokens(rendered.ids)
    assert "".join(tokens) == AutoTokenizer.from_pretrained(folders["parts"]).apply_chat_template(
        WITH_PARTS, tokenize=False) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is <think>?"
                                        "<|im_end|>\n<|im_start|>assistant\na cat<|im_end|>\n")
    assert "".join(t for t, m in zip(tokens, rendered.mask, strict=True) if m) == "a cat<|im_end|>\n"


def test_a_turn_found_by_prefixes_is_the_marked_turn_where_a_token_straddles_it(folders):
    """The prefix before the turn ends inside the token "\\n\\n": its text is a prefix of the whole
    rendering (its tokens are not), and the turn's targets are the tokens overlapping its text,
    the straddling one included, exactly as the same template with markers gives them."""
    derived = render(ChatTemplate.load(folders["chatml"]), Conversation(STRADDLE), "assistant", where="x",
                     source=SOURCE)
    marked = render(ChatTemplate.load(folders["chatml_marked"]), Conversation(STRADDLE), "assistant", where="x",
                    source=SOURCE)
    assert (derived.ids, derived.mask) == (marked.ids, marked.mask)
    tokens = ChatTemplate.load(folders["chatml"]).tokenizer.convert_ids_to_tokens(derived.ids)
    assert [t for t, m in zip(tokens, derived.mask, strict=True) if m][:2] == ["\n\n", "the"]


@pytest.mark.parametrize(("field", "messages", "tools"), [
    ("messages[1].content", [CONVERSATIONS[2][0], {"role": "assistant", "content": [{"type": "text", "text": "x"}]}],
     None),
    ("messages[0].content", [{"role": "user", "content": [{"type": "text", "text": "x"}]}, CONVERSATIONS[2][1]],
     None),
])
def test_a_container_written_as_text_names_its_field(folders, field, messages, tools):
    """ChatML writes `{{ m.content }}`: a list of parts would be trained as its Python repr."""
    with pytest.raises(DataConfigError) as err:
        render(ChatTemplate.load(folders["chatml"]), Conversation(messages, tools), "assistant",
               where="chat.jsonl:3", source=SOURCE)
    assert str(err.value) == (
        f'training.dataset_path = "chat.jsonl": chat.jsonl:3: the chat template of {folders["chatml"]} writes its '
        f"{field} (a list) into the text as its Python repr\n  fix: write {field} as a string; or, for content "
        'parts ([{"type": "text", "text": ...}]), use a chat template that iterates them, as multimodal templates do')


# ---- the bounds ----------------------------------------------------------------------------------

# Each broken with the test's small bounds (1,000 steps and 10 a message; 10,000 characters), so
# that without its check each ends within a second, and the test fails rather than hangs.
BOUNDS = {
    "nested_loops": ("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
                     "it ran more than 1,010 steps (loop iterations and calls), the bound for this conversation "
                     "(1,000, and 10 more a message or tool): a loop that does not end with the conversation"),
    "calls": ("{% for i in range(300) %}{{ 'x'.upper() }}{{ 'y'.lower() }}{{ 'z'.strip() }}{% endfor %}",
              "it ran more than 1,010 steps"),
    "recursion": ("{% for i in [[1, [2]], [3]] recursive %}{% for j in range(400) %}{% endfor %}"
                  "{{ loop(i) if i is iterable else '' }}{% endfor %}", "it ran more than 1,010 steps"),
    "repeat": ("{{ 'x' * 20000 }}", "it builds a str of 20,000 characters or items, more than the bound of 10,000"),
    "repeat_huge": ("{{ 'x' * 10**12 }}", "it builds a str of 1,000,000,000,000 characters or items"),  # not built
    "repeat_list": ("{{ ([1] * 20000)|length }}", "it builds a list of 20,000 characters or items"),
    "output": ("{% for i in range(50) %}{{ 'x' * 500 }}{% endfor %}", "its output grows past 10,000 characters, "
               "the bound"),
    "concat": ("{% set ns = namespace(s='ab') %}{% for i in range(14) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               "it builds a str of 16,384 characters or items"),
    "plus": ("{% set ns = namespace(s=[1, 2]) %}{% for i in range(14) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
             "it builds a list of 16,384 characters or items"),
    "power": ("{{ 3 ** 100000 }}", "it computes an integer of more than 65,536 bits, the bound"),
    "center": ("{{ 'x'|center(20000) }}", "it builds a str or list of 20,000 characters or items"),
    "center_method": ("{{ 'x'.center(20000) }}", "it builds a str of 20,000 characters or items"),
    "indent": ("{{ ('a\\n' * 100)|indent(300) }}", "it builds a str or list of 30,500 characters or items"),
    "format": ("{{ '{:>20000}'.format(1) }}", "it builds a str of 20,000 characters or items"),
    "format_nested": ("{{ '{:>{w}}'.format(1, w=20000) }}", "it builds a str of 20,000 characters or items"),
    "percent": ("{{ '%20000d' % 1 }}", "it builds a str of 20,000 characters or items"),
    "format_filter": ("{{ '%*d'|format(20000, 1) }}", "it builds a str or list of 20,000 characters or items"),
    "replace": ("{{ ('x' * 100)|replace('', 'y' * 100) }}", "it builds a str or list of 10,200 characters or items"),
    "join": ("{{ ('x' * 6000).join(['a', 'b', 'c']) }}", "it builds a str of 12,003 characters or items"),
    "tojson": ("{{ messages|tojson(indent=20000) }}", "it builds a str or list of 40,000 characters or items"),
    "batch": ("{{ [1]|batch(20000, 0)|list|length }}", "it builds a str or list of 20,000 characters or items"),
}


@pytest.mark.parametrize("kind", list(BOUNDS))
def test_each_bound_stops_a_template_with_one_message(monkeypatch, kind):
    monkeypatch.setattr(template_sandbox, "STEPS", 1000)
    monkeypatch.setattr(template_sandbox, "STEPS_PER_MESSAGE", 10)
    monkeypatch.setattr(template_sandbox, "CHARS", 10_000)
    source, problem = BOUNDS[kind]
    with pytest.raises(RenderBound) as err:
        TemplateSandbox(transformers_sandbox()).render(source, {"messages": [{"role": "user", "content": "hi"}]},
                                                       messages=1)
    assert str(err.value).startswith(problem)


def test_a_template_within_the_bounds_renders_whole(monkeypatch, folders):
    """The bounds scale with the conversation: 600 messages through ChatML at 1,000 steps and 10 a
    message (ChatML takes about 7 a message) render whole, as transformers renders them."""
    monkeypatch.setattr(template_sandbox, "STEPS", 1000)
    monkeypatch.setattr(template_sandbox, "STEPS_PER_MESSAGE", 10)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(600)]
    assert ChatTemplate.load(folders["chatml"]).text(messages) == \
        AutoTokenizer.from_pretrained(folders["chatml"]).apply_chat_template(messages, tokenize=False)


def test_a_bound_broken_names_the_template_row_and_fix(monkeypatch, tmp_path):
    """Two nested range(100000) loops (10^10 steps) stop at the default bound: one message naming
    the tokenizer folder, the row, the bound and the fix."""
    folder = tokenizer_folder(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                              "{% endfor %}{{ messages[0].content }}", CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(DataConfigError) as err:
        render(ChatTemplate.load(folder), Conversation(CONVERSATIONS[2]), "all", where="chat.jsonl:3", source=SOURCE)
    assert str(err.value) == (
        f'model.tokenizer_path = "{folder}": chat.jsonl:3: its chat template stopped: it ran more than 1,020,000 '
        "steps (loop iterations and calls), the bound for this conversation (1,000,000, and 10,000 more a message or "
        "tool): a loop that does not end with the conversation\n  fix: fix the chat template (chat_template.jinja, "
        "or tokenizer_config.json's chat_template): these bounds hold for any template that renders each "
        "conversation once over")


def test_a_200_mb_string_is_refused_before_it_is_built(tmp_path):
    folder = tokenizer_folder(tmp_path, "{{ 'x' * 200000000 }}", CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(DataConfigError, match=r"chat.jsonl:3: its chat template stopped: it builds a str of "
                                              r"200,000,000 characters or items, more than the bound of 33,554,432"):
        render(ChatTemplate.load(folder), Conversation(CONVERSATIONS[2]), "all", where="chat.jsonl:3", source=SOURCE)


# ---- the sandbox holds ---------------------------------------------------------------------------

# Ways out of jinja2's sandbox tried on chat templates: each would run `touch MARKER` if it worked.
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ strftime_now.__globals__['os'].system('touch MARKER') }}",
    "{{ dict.__call__.__globals__['os'].system('touch MARKER') }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ '{0.__class__.__base__.__subclasses__}'.format('') }}",
    "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "{{ messages.append('touch MARKER') or messages|length }}",
    "{{ range.__globals__['os'].system('touch MARKER') }}",
]


def _outcome(render_it) -> str:
    try:
        return f"text {render_it()!r}"
    except Exception as err:  # noqa: BLE001 - the kind of refusal is what is compared
        return f"refused: {type(err).__name__}"


@pytest.mark.parametrize("payload", ESCAPES)
def test_no_escape_from_the_sandbox_opens(tmp_path, monkeypatch, payload):
    """Each payload is refused (or renders nothing) as in transformers' own sandbox, and the
    command it carries never runs."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    monkeypatch.chdir(tmp_path)
    context = {"messages": [{"role": "user", "content": "hi"}]}
    ours = _outcome(lambda: TemplateSandbox(transformers_sandbox()).render(payload, dict(context), messages=1)[0])
    theirs = _outcome(lambda: _compile_jinja_template(payload).render(**context))
    assert ours == theirs and not (tmp_path / "MARKER").exists()
    assert ours.startswith("refused") or ours == "text ''", ours


def test_a_template_error_is_the_rows(tmp_path):
    """The template's own refusal (`raise_exception`) stays the row's, with its words."""
    folder = tokenizer_folder(tmp_path, "{% if messages[0].role != 'system' %}{{ raise_exception('a system "
                              "message first') }}{% endif %}", CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(DataConfigError) as err:
        render(ChatTemplate.load(folder), Conversation(CONVERSATIONS[2]), "all", where="chat.jsonl:3", source=SOURCE)
    assert str(err.value) == ('training.dataset_path = "chat.jsonl": chat.jsonl:3: the chat template refuses this '
                              "conversation (TemplateError: a system message first)\n  fix: fix the row (its roles, "
                              "their order and fields) or remove it")
