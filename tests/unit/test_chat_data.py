"""Chat SFT data: the template's tokens, exact loss masks, files, packing, counts and mixtures.

    python -m pytest -q tests/unit/test_chat_data.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.chat_fixtures import (
    CHATML,
    CHATML_MARKED,
    CHATML_SPECIALS,
    CONVERSATIONS,
    DEEPSEEK,
    DEEPSEEK_SPECIALS,
    HARMONY,
    HARMONY_SPECIALS,
    QWEN3_REASONING,
    chatml,
    deepseek,
    tokenizer_folder,
)
from torchmoe.config import JobConfig
from torchmoe.config.errors import ConfigError
from torchmoe.config.loader import load_job_config
from torchmoe.config.validate import validate_training
from torchmoe.data import build_dataloader, build_tokenizer
from torchmoe.data.chat import chat_masks
from torchmoe.data.chat.chat_files import chat_rows, conversation
from torchmoe.data.chat.chat_masks import Conversation, render
from torchmoe.data.chat.chat_template import ChatTemplate
from torchmoe.data.errors import DataConfigError
from torchmoe.data.micro_batches import IGNORE
from torchmoe.nn.document_attention import document_starts

SOURCE = ("training.dataset_path", "chat.jsonl")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml_marked": chatml(root / "chatml_marked", marked=True),
        "chatml": chatml(root / "chatml", marked=False),
        "deepseek_marked": deepseek(root / "deepseek_marked", marked=True),
        "deepseek": deepseek(root / "deepseek", marked=False),
        "qwen3": tokenizer_folder(root / "qwen3", QWEN3_REASONING, CHATML_SPECIALS, eos="<|im_end|>"),
        "harmony": tokenizer_folder(root / "harmony", HARMONY, HARMONY_SPECIALS, eos="<|return|>"),
    }


def _render(folder: Path, messages: list[dict], loss_on: str = "assistant", **kw) -> tuple[list[int], list[int]]:
    out = render(ChatTemplate.load(folder), Conversation(messages, **kw), loss_on, where="chat.jsonl:7", source=SOURCE)
    return out.ids, out.mask


def _masked_text(folder: Path, ids: list[int], mask: list[int]) -> str:
    tokenizer = ChatTemplate.load(folder).tokenizer
    return "".join(tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask, strict=True) if m]))


@pytest.mark.parametrize("family", ["chatml_marked", "deepseek_marked"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_marker_masks_are_transformers_assistant_masks(folders, family, conv):
    messages = CONVERSATIONS[conv]
    ids, mask = _render(folders[family], messages)
    expected = AutoTokenizer.from_pretrained(folders[family]).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == expected["input_ids"]
    assert mask == expected["assistant_masks"]
    assert 0 < sum(mask) < len(mask)


@pytest.mark.parametrize("family", ["chatml", "deepseek"])
@pytest.mark.parametrize("loss_on", ["assistant", "last"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_masks_from_prefixes_equal_the_marker_masks(folders, family, loss_on, conv):
    """A prefix-stable template without markers gives, turn by turn, the marked template's mask."""
    derived = _render(folders[family], CONVERSATIONS[conv], loss_on)
    marked = _render(folders[f"{family}_marked"], CONVERSATIONS[conv], loss_on)
    assert derived == marked


def test_masked_tokens_are_the_assistant_turns(folders):
    ids, mask = _render(folders["chatml"], CONVERSATIONS[0], "assistant")
    assert _masked_text(folders["chatml"], ids, mask) == "hello, as asked<|im_end|>\nfour<|im_end|>\n"
    ids, mask = _render(folders["chatml"], CONVERSATIONS[0], "last")
    assert _masked_text(folders["chatml"], ids, mask) == "four<|im_end|>\n"
    ids, mask = _render(folders["deepseek"], CONVERSATIONS[1], "assistant")
    assert _masked_text(folders["deepseek"], ids, mask) == "<eos>it rains\n\nthough<eos>"
    ids, mask = _render(folders["chatml"], CONVERSATIONS[0], "all")
    assert mask == [1] * len(ids)


def test_the_template_writes_the_only_bos(folders):
    """DeepSeek-V3's template writes BOS; the tokenizer's post-processor would add another."""
    template = ChatTemplate.load(folders["deepseek"])
    bos = template.tokenizer.convert_tokens_to_ids("<bos>")
    assert template.tokenizer.encode("x") == [bos, template.tokenizer.convert_tokens_to_ids("x")]  # it would
    ids, _ = _render(folders["deepseek"], CONVERSATIONS[0])
    assert ids[0] == bos and ids.count(bos) == 1


REASONING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "r2"}]


def test_prefix_unstable_template_is_refused_naming_row_and_turn(folders):
    with pytest.raises(DataConfigError) as err:
        _render(folders["qwen3"], REASONING, "assistant")
    assert str(err.value) == (
        f'training.loss_on = "assistant": chat.jsonl:7, turn 1 (messages[1], the assistant\'s): the chat template of '
        f"{folders['qwen3']} renders the conversation before that turn (with the generation prompt) or through it as "
        "text that the whole conversation's rendering does not begin with (it is not prefix-stable there: e.g. it "
        "drops the reasoning of earlier turns), and it has no {% generation %} markers, so which tokens are that "
        'turn\'s cannot be known\n  fix: set training.loss_on = "last" (only the last assistant turn of each conversation, whose '
        "prefix such templates render alike), or use a chat template that marks the assistant's text with "
        "{% generation %} ... {% endgeneration %} (chat_template.jinja beside tokenizer.json)")
    ids, mask = _render(folders["qwen3"], REASONING, "last")  # the suggested fix works
    assert _masked_text(folders["qwen3"], ids, mask) == "<think>\nr2\n</think>\n\nd<|im_end|>\n"


def test_a_generation_prompt_the_turn_does_not_begin_with_is_refused(tmp_path):
    """DeepSeek-R1's prompt opens a <think> block that its rendered turns do not hold."""
    folder = tokenizer_folder(tmp_path, DEEPSEEK.replace("{% if add_generation_prompt %}<Assistant>",
                                                         "{% if add_generation_prompt %}<Assistant><think>\n"),
                              [*DEEPSEEK_SPECIALS, "<think>"], eos="<eos>", bos="<bos>")
    with pytest.raises(DataConfigError, match=r"chat.jsonl:7, turn 3 \(messages\[3\], the assistant's\)"):
        _render(folder, CONVERSATIONS[2][:1] * 3 + CONVERSATIONS[2][1:], "last")


def test_harmony_last_turn_end_is_refused_for_earlier_turns_only(folders):
    """gpt-oss ends the last turn with <|return|>: turn 1's rendering alone ends so, the whole
    conversation's turn 1 with <|end|>."""
    conv = CONVERSATIONS[0][1:]
    with pytest.raises(DataConfigError, match=r"chat.jsonl:7, turn 1 \(messages\[1\]"):
        _render(folders["harmony"], conv, "assistant")
    ids, mask = _render(folders["harmony"], conv, "last")
    assert _masked_text(folders["harmony"], ids, mask) == "<|channel|>final<|message|>four<|return|>"


def test_templates_are_chosen_as_transformers_chooses_them(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's; of named templates, tool_use for tools."""
    folder = tokenizer_folder(tmp_path, CHATML, CHATML_SPECIALS, eos="<|im_end|>", jinja_file=CHATML_MARKED)
    assert ChatTemplate.load(folder).has_markers()
    assert ChatTemplate.load(folder).template(None) == AutoTokenizer.from_pretrained(folder).chat_template
    named = tokenizer_folder(tmp_path / "named", [{"name": "default", "template": CHATML},
                                                  {"name": "tool_use", "template": CHATML_MARKED}],
                             CHATML_SPECIALS, eos="<|im_end|>")
    tools = [{"name": "get_weather"}]
    assert ChatTemplate.load(named).template(tools) == AutoTokenizer.from_pretrained(named).get_chat_template(None, tools)
    assert ChatTemplate.load(named).has_markers(tools) and not ChatTemplate.load(named).has_markers()
    assert not ChatTemplate.load(tokenizer_folder(tmp_path / "plain", CHATML, CHATML_SPECIALS,
                                                  eos="<|im_end|>")).has_markers()


def test_no_template_is_refused(tmp_path):
    folder = tokenizer_folder(tmp_path, None, CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(DataConfigError, match="its tokenizer has no chat template"):
        ChatTemplate.load(folder)


@pytest.mark.parametrize("family", ["chatml", "chatml_marked"])
def test_prompt_completion_trains_on_the_completion(folders, family):
    messages = CONVERSATIONS[0]
    as_messages = conversation({"prompt": messages[:4], "completion": messages[4:]}, "r", SOURCE)
    assert as_messages == Conversation(messages, None, first_target=4)
    ids, mask = _render(folders[family], messages, "assistant", first_target=4)
    assert (ids, mask) == _render(folders[family], messages, "last")
    strings = conversation({"prompt": "one", "completion": "two"}, "r", SOURCE)
    assert _render(folders[family], strings.messages, first_target=strings.first_target) == \
        _render(folders[family], CONVERSATIONS[2])


def test_bad_rows_are_named(folders):
    with pytest.raises(DataConfigError, match=r"chat.jsonl:3 is not a chat row \(found \['text'\]\)"):
        conversation({"text": "x"}, "chat.jsonl:3", SOURCE)
    with pytest.raises(DataConfigError, match=r"r: messages\[1\] is not a message"):
        conversation({"messages": [{"role": "user", "content": "a"}, "b"]}, "r", SOURCE)
    with pytest.raises(DataConfigError, match=r"r, turn 0 \(messages\[0\], the assistant's\): it begins the conversation"):
        render(ChatTemplate.load(folders["chatml"]), Conversation([{"role": "assistant", "content": "a"}]), "assistant",
               where="r", source=SOURCE)


ROWS = [{"messages": c} for c in CONVERSATIONS] + [{"prompt": "one", "completion": "two"}]


def _write(kind: str, root: Path) -> str:
    """ROWS (with `tools` on the first) as `kind`; the dataset path to read them."""
    rows = [dict(ROWS[0], tools=[{"name": "get_weather"}]), *ROWS[1:]]
    root.mkdir()
    if kind == "jsonl":
        (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
        return str(root / "a.jsonl")
    if kind == "json":
        (root / "a.json").write_text(json.dumps(rows))
        return str(root / "a.json")
    if kind in ("folder", "glob"):
        (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]))
        (root / "b.json").write_text(json.dumps(rows[2:]))
        if kind == "glob":
            (root / "c.txt").write_text("not read by the glob")
        return str(root / "*.json*") if kind == "glob" else str(root)
    rows = [{key: row.get(key) for key in ("messages", "tools", "prompt", "completion")} for row in rows]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), root / "a.parquet", row_group_size=2)
        return str(root / "a.parquet")
    import datasets

    data = datasets.Dataset.from_list(rows)
    if kind == "saved_dict":
        datasets.DatasetDict({"train": data}).save_to_disk(str(root / "d"))
    else:
        data.save_to_disk(str(root / "d"))
    return str(root / "d")


@pytest.mark.parametrize("kind", ["jsonl", "json", "folder", "glob", "parquet", "saved", "saved_dict"])
def test_files_folders_globs_and_saved_datasets(tmp_path, kind):
    rows = chat_rows(_write(kind, tmp_path / kind))
    read = [rows.read(i) for i in range(rows.count())]
    # Arrow-backed rows hold every column (None where a row has none) and every struct field.
    assert [conversation(r, "x", SOURCE).messages for r in read] == [*CONVERSATIONS, CONVERSATIONS[2]]
    assert conversation(read[3], "x", SOURCE).first_target == 1
    assert read[0]["tools"] == [{"name": "get_weather"}]
    where = {"jsonl": "a.jsonl:3", "json": "a.json[2]", "folder": "b.json[0]", "glob": "b.json[0]", "parquet": "a.parquet row 2",
             "saved": "x", "saved_dict": "x"}[kind]
    if not kind.startswith("saved"):
        assert rows.locate(2) == f"{tmp_path / kind / where}"
    else:
        assert rows.locate(2) == f"row 2 of the saved dataset {tmp_path / kind / 'd'}"


def test_a_named_pipe_in_a_saved_dataset_is_refused_unopened(tmp_path):
    """datasets opens each file of the folder: a named pipe among them waited for ever."""
    import os

    path = _write("saved", tmp_path / "saved")
    arrow = next(Path(path).glob("*.arrow"))
    arrow.unlink()
    os.mkfifo(arrow)
    with pytest.raises(DataConfigError, match=rf'training.dataset_path = "{path}": .*{arrow.name} is a named pipe, '
                                              "not a regular file"):
        chat_rows(path)


def _training(path: str, **kw) -> object:
    t = JobConfig().training
    return dataclasses.replace(t, dataset=kw.pop("dataset", "chat"), dataset_path=path, seq_len=kw.pop("seq_len", 64),
                               local_batch_size=kw.pop("local_batch_size", 2), global_batch_size=-1, **kw)


def _loader(folder: Path, path: str, **kw):
    return build_dataloader(_training(path, **kw), build_tokenizer(str(folder)))


def test_rows_are_packed_whole_with_exact_labels_starts_and_counts(folders, tmp_path):
    path = _write("jsonl", tmp_path / "d")
    loader = _loader(folders["chatml"], path, local_batch_size=2, seq_len=240)
    template = ChatTemplate.load(folders["chatml"])
    rows = chat_rows(path)
    rendered = [render(template, conversation(rows.read(i), "x", SOURCE), "assistant", where="x", source=SOURCE)
                for i in range(rows.count())]
    (batch,) = loader.next_batch()
    inputs, labels = batch
    eos = build_tokenizer(str(folders["chatml"])).eos_id
    # Row 0 packs conversations 0 and 1 (two of four, the first half): tokens as rendered, then padding.
    first, second = rendered[0], rendered[1]
    n0, n1 = len(first.ids), len(second.ids)
    assert n0 + n1 <= 241 and inputs[0, :n0].tolist() == first.ids and inputs[0, n0:n0 + n1].tolist() == second.ids
    assert (inputs[0, n0 + n1:] == eos).all()
    # Labels: the next token where it is a target of the same conversation, HF's shifted labels.
    hf_labels = [i if m else IGNORE for i, m in zip(first.ids, first.mask, strict=True)]
    assert labels[0, :n0 - 1].tolist() == hf_labels[1:]
    assert labels[0, n0 - 1] == IGNORE and (labels[0, n0 + n1 - 1:] == IGNORE).all()
    assert batch.starts[0].tolist() == [0] * n0 + [n0] * n1 + [n0 + n1] * (240 - n0 - n1)
    # The conversations' tokens are data, targets or not; the padding is not.
    assert batch.real[0].tolist() == [True] * (n0 + n1) + [False] * (240 - n0 - n1)
    assert batch.real_tokens == int(batch.real.sum()) == sum(len(r.ids) for r in rendered)
    assert batch.supervised == int((labels != IGNORE).sum()) == sum(sum(r.mask[1:]) for r in rendered)
    assert loader.chat_stats() == {"data": {"packed": 4, "truncated": 0, "dropped": 0, "unsupervised": 0,
                                            "targets": batch.supervised}}


def test_overlong_rows_are_truncated_or_dropped_and_counted(folders, tmp_path, caplog):
    path = _write("jsonl", tmp_path / "d")
    lengths = [len(render(ChatTemplate.load(folders["chatml"]), conversation(r, "x", SOURCE), "assistant",
                          where="x", source=SOURCE).ids) for r in ROWS]
    seq_len = sorted(lengths)[1]  # the two longest exceed seq_len + 1
    assert sum(n > seq_len + 1 for n in lengths) == 2
    loader = _loader(folders["chatml"], path, local_batch_size=1, seq_len=seq_len, chat_overlong="truncate")
    batches = [loader.next_batch()[0] for _ in range(4)]
    assert loader.chat_stats()["data"]["truncated"] == 2 and loader.chat_stats()["data"]["packed"] == 4
    assert "tokens, more than a row's" in caplog.text and "truncated (training.chat_overlong = 'truncate')" in caplog.text
    assert sum(b.supervised for b in batches) == loader.chat_stats()["data"]["targets"]
    loader = _loader(folders["chatml"], path, local_batch_size=1, seq_len=seq_len, chat_overlong="drop")
    for _ in range(2):  # the first drops conversations 0 and 1 and packs 2, the second packs 3
        loader.next_batch()
    stats = loader.chat_stats()["data"]
    assert (stats["dropped"], stats["truncated"], stats["packed"]) == (2, 0, 2)


def test_rows_without_targets_add_nothing_and_a_row_of_only_those_is_refused(folders, tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "no answer"}]}, ROWS[2]]))
    loader = _loader(folders["chatml"], str(tmp_path / "a.jsonl"), local_batch_size=1, seq_len=64)
    (batch,) = loader.next_batch()
    assert batch.supervised == 5  # "two<|im_end|>\n" of the second (5 tokens); the first adds none
    assert loader.chat_stats()["data"]["unsupervised"] == 1
    with pytest.raises(DataConfigError, match=r"the 1 conversation\(s\) of a batch row \(.*a.jsonl:1\) hold no token"):
        _loader(folders["chatml"], str(tmp_path / "a.jsonl"), local_batch_size=2, seq_len=16)  # before any batch


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_refuses_its_own_rows_without_targets_before_a_batch(folders, tmp_path, rank):
    """Rows 2 and 3 of 4 hold conversations without an answer: rank 1 of 2 (its rows) is refused
    when its loader is built, rank 0 trains; the validation loader (one pass) alike, and a chat
    source of a mixture."""
    lonely = {"messages": [{"role": "user", "content": "no answer"}]}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [ROWS[2], ROWS[2], lonely, lonely]))
    training = _training(str(tmp_path / "a.jsonl"), local_batch_size=2, seq_len=32)
    tokenizer = build_tokenizer(str(folders["chatml"]))
    build = lambda t, **kw: build_dataloader(dataclasses.replace(t, global_batch_size=4), tokenizer,  # noqa: E731
                                             dp_rank=rank, dp_degree=2, **kw)
    if rank == 0:
        (batch,) = build(training).next_batch()
        assert batch.supervised == 2 * 5
        return
    for made in (lambda: build(training), lambda: build(training, repeat=False),
                 lambda: build(dataclasses.replace(training, dataset="local", dataset_path="", dataset_mix=[
                     f"chat=1:chat:{tmp_path / 'a.jsonl'}", f"more=1:chat:{tmp_path / 'a.jsonl'}"]))):
        with pytest.raises(DataConfigError, match=r"the 1 conversation\(s\) of a batch row \(.*a.jsonl:3\) hold no "):
            made()


def test_the_data_repeating_is_said_once_a_pass_with_the_counts(folders, tmp_path, caplog):
    """Four rows of one conversation each: every batch ends a pass of every row. One line a pass
    for the source (it was one a row and a pass), with this process's counts so far."""
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(ROWS[2]) for _ in range(4)))
    loader = _loader(folders["chatml"], str(tmp_path / "a.jsonl"), local_batch_size=4, seq_len=24)
    with caplog.at_level(logging.INFO, logger="torchmoe.data.passes"):
        for _ in range(3):
            loader.next_batch()
    lines = [r.getMessage() for r in caplog.records if "start pass" in r.getMessage()]
    assert lines == [
        f"chat data (training.dataset_path = {tmp_path / 'a.jsonl'}): batch rows start pass {p} over their "
        f"conversations as each finishes the one before (data repeats); this process's rows so far packed {4 * p} "
        f"conversations (0 cut, 0 dropped as longer than a row, 0 without targets), {4 * p * 5} target tokens"
        for p in (1, 2)]


@pytest.mark.parametrize("family", ["chatml", "chatml_marked", "deepseek", "harmony"])
@pytest.mark.parametrize("loss_on", ["assistant", "last"])
def test_a_row_of_limit_tokens_is_the_whole_rendering_cut(folders, family, loss_on):
    """Only the turns that begin in a row's tokens are looked for: the ids and targets of each cut
    are those of the whole conversation cut there, at every length."""
    template = ChatTemplate.load(folders[family])
    messages = CONVERSATIONS[0] + CONVERSATIONS[2] * 3
    if family == "harmony":
        loss_on = "last"  # its earlier turns are not prefix-stable
    whole = render(template, Conversation(messages), loss_on, where="x", source=SOURCE)
    assert whole.length == len(whole.ids) and sum(whole.mask) > 0
    for limit in range(1, whole.length + 2):
        cut = render(template, Conversation(messages), loss_on, where="x", source=SOURCE, limit=limit)
        assert (cut.ids, cut.mask, cut.length) == (whole.ids[:limit], whole.mask[:limit], whole.length), limit


def test_finding_turns_without_markers_is_bounded_per_conversation(folders, monkeypatch):
    """Each turn renders the conversation up to it: n^2 / 2 messages. Past the bound one message
    names the row, the bound and the fixes, which both work."""
    monkeypatch.setattr(chat_masks, "PREFIX_MESSAGES", 50)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]
    with pytest.raises(DataConfigError) as err:
        _render(folders["chatml"], messages, "assistant")
    assert str(err.value) == (
        'training.loss_on = "assistant": chat.jsonl:7: finding the tokens of its 10 assistant turns renders the '
        "conversation up to each turn, more than 50 messages in all for its 20 (the bound): the chat template of "
        f"{folders['chatml']} has no {{% generation %}} markers\n  fix: set training.loss_on = \"last\" (the last "
        "assistant turn of each conversation: one rendering of its prefix), use a chat template that marks the "
        "assistant's text with {% generation %} ... {% endgeneration %} (chat_template.jinja beside tokenizer.json) "
        "(no prefix rendered), or split the conversation into shorter ones")
    last, marked = _render(folders["chatml"], messages, "last"), _render(folders["chatml_marked"], messages, "last")
    assert last == marked and sum(last[1]) == len(template_ids(folders["chatml"], ["m19<|im_end|>\n"]))


def template_ids(folder: Path, texts: list[str]) -> list[int]:
    return [i for text in texts for i in ChatTemplate.load(folder).encode(text)[0]]


@pytest.mark.parametrize(("row", "problem", "fix"), [
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content is 7 (a number), not text (a string) or a "
     'list of content parts ([{"type": "text", "text": ...}])', 'write it as a string: "7"'),
    ({"messages": [{"role": "user", "content": True}]}, "messages[0].content is true (a boolean)",
     'write it as a string: "true"'),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": {"answer": 4}}]}, 'completion[0].content is '
     '{"answer": 4} (an object)', 'write it as a string: "{\\"answer\\": 4}"'),
    ({"messages": CONVERSATIONS[2], "tools": {"name": "f"}}, 'its tools are {"name": "f"} (an object), not a list of '
     "JSON schemas", 'write them as [{"type": "function", "function": {"name": ..., ...}}, ...], or leave tools out'),
    ({"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content holds a lone surrogate (\\udfff at "
     "character 1), which is no text: it cannot be encoded as UTF-8, nor tokenized", "fix the row: a character beyond "
     "U+FFFF is written in JSON as a pair of surrogates (\\ud83d\\ude00), or as itself"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {"q": "\ud800"}}}]}]},
     "messages[0].tool_calls[0].function.arguments.q holds a lone surrogate", "fix the row"),
    ({"messages": CONVERSATIONS[2], "tools": [{"description": "x\ud800"}]}, "tools[0].description holds a lone "
     "surrogate", "fix the row"),
])
def test_a_row_s_content_tools_and_text_are_checked(row, problem, fix):
    """Content that is not text or parts would be written as Python writes it (True, {'answer': 4});
    a lone surrogate was blamed on the template. Each names the row and the field."""
    with pytest.raises(DataConfigError) as err:
        conversation(row, "chat.jsonl:3", SOURCE)
    assert str(err.value).startswith(f'training.dataset_path = "chat.jsonl": chat.jsonl:3: {problem}')
    assert f"\n  fix: {fix}" in str(err.value)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}, CONVERSATIONS[2][1]]}
    assert conversation(parts, "chat.jsonl:3", SOURCE).messages == parts["messages"]  # parts go to the template


def test_resume_packs_the_same_windows(folders, tmp_path):
    path = _write("jsonl", tmp_path / "d")
    loader = _loader(folders["chatml"], path, local_batch_size=1, seq_len=40)
    for _ in range(3):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(4)]
    again = _loader(folders["chatml"], path, local_batch_size=1, seq_len=40)
    again.load_state_dict(state)
    for want, got in zip(expected, [again.next_batch() for _ in range(4)], strict=True):
        for a, b in zip(want, got, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and torch.equal(a.starts, b.starts)
            assert a.supervised == b.supervised


def test_mixture_with_text_keeps_text_rows_as_they_were(folders, tmp_path):
    path = _write("jsonl", tmp_path / "d")
    (tmp_path / "t.txt").write_text("plain text for pretraining. " * 40)
    tokenizer = build_tokenizer(str(folders["chatml"]))
    mix = _training("", dataset="local", dataset_mix=[f"chat=1:chat:{path}", f"text=1:local:{tmp_path / 't.txt'}"],
                    local_batch_size=4, seq_len=96)  # row 0's one conversation has its first target at token 81
    text_only = dataclasses.replace(mix, dataset_mix=[], dataset_path=str(tmp_path / "t.txt"))
    mixed = build_dataloader(mix, tokenizer)
    (batch,) = mixed.next_batch()
    inputs, labels = batch
    chat_rows_seen = 0
    for r in range(4):
        if (labels[r] == IGNORE).any():
            chat_rows_seen += 1
            continue
        assert torch.equal(labels[r, :-1], inputs[r, 1:])
        assert torch.equal(batch.starts[r], document_starts(inputs[r:r + 1], tokenizer.eos_id)[0])
        assert batch.real[r].all()  # a text row holds no padding
    assert 0 < chat_rows_seen < 4
    assert batch.supervised == int((labels != IGNORE).sum())
    (plain,) = build_dataloader(text_only, tokenizer).next_batch()
    # Pretraining batches are as they were: no starts, no mask (every token data), every label a target.
    assert plain.starts is None and plain.real is None and plain.supervised == plain.real_tokens == 4 * 96


def test_byte_tokenizer_and_bad_settings_are_refused(tmp_path):
    path = _write("jsonl", tmp_path / "d")
    with pytest.raises(DataConfigError, match="the built-in byte tokenizer has none"):
        build_dataloader(_training(path), build_tokenizer(""))
    with pytest.raises(ConfigError) as err:
        validate_training(_training(path, add_bos=True))
    assert str(err.value).startswith('training.add_bos = true: would put BOS before chat data')
    with pytest.raises(ConfigError, match='training.loss_on = "assistants": not an allowed value'):
        validate_training(_training(path, loss_on="assistants"))
    with pytest.raises(ConfigError, match='training.chat_overlong = "cut": not an allowed value'):
        validate_training(_training(path, chat_overlong="cut"))
    with pytest.raises(ConfigError, match=r'training.dataset_path = "": dataset = "chat" needs a path'):
        validate_training(_training(""))


def test_every_token_is_a_target_but_none_across_a_conversation_boundary(folders, tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [ROWS[2], ROWS[2]]))
    loader = _loader(folders["chatml"], str(tmp_path / "a.jsonl"), local_batch_size=1, seq_len=60, loss_on="all")
    ((inputs, labels),) = loader.next_batch()
    n = len(ChatTemplate.load(folders["chatml"]).tokens(CONVERSATIONS[2]))
    assert n == 25 and inputs[0, :n].tolist() == inputs[0, n:2 * n].tolist()
    assert labels[0, :n - 1].tolist() == inputs[0, 1:n].tolist() == labels[0, n:2 * n - 1].tolist()
    assert labels[0, n - 1] == IGNORE and (labels[0, 2 * n - 1:] == IGNORE).all()


def test_the_fine_tuning_page_settings_read_its_chat_file(folders, tmp_path, monkeypatch):
    """docs/fine_tuning.md: its command's settings, its two rows and a Qwen3-like template."""
    page = (REPO / "docs" / "fine_tuning.md").read_text()
    rows = [line for line in page.split("```json\n")[1].split("```")[0].splitlines() if line]
    command = page.split("```bash\n")[1].split("```")[0].replace("\\\n", " ").split()
    monkeypatch.chdir(tmp_path)
    shutil.copytree(folders["qwen3"], "models/Qwen3-30B-A3B")
    Path("data").mkdir()
    Path("data/chat.jsonl").write_text("\n".join(rows))
    args = command[command.index("train") + 1:]
    args[args.index("--config") + 1] = str(REPO / args[args.index("--config") + 1])
    training = load_job_config(args, notes=[]).training
    assert (training.dataset, training.loss_on) == ("chat", "last")
    loader = build_dataloader(dataclasses.replace(training, seq_len=64, local_batch_size=2, global_batch_size=-1),
                              build_tokenizer("models/Qwen3-30B-A3B"))
    template = ChatTemplate.load(Path("models/Qwen3-30B-A3B"))
    (batch,) = loader.next_batch()
    assert ["".join(template.tokenizer.convert_ids_to_tokens([int(t) for t in row if t != IGNORE]))
            for row in batch[1]] == \
        ["<think>\n\n</think>\n\n4<|im_end|>\n", "<think>\n\n</think>\n\nOslo<|im_end|>\n"]


def test_the_packed_loss_is_transformers_loss_with_the_same_tokens_ignored(folders, tmp_path):
    """A tiny random Qwen3-MoE from transformers: the summed cross entropy of a packed row over its
    `supervised` count is the model's own loss on the conversation alone, labels -100 off the mask."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)).eval()
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]))
    (batch,) = _loader(folders["chatml_marked"], str(tmp_path / "a.jsonl"), local_batch_size=1, seq_len=100).next_batch()
    inputs, labels = batch
    hf = AutoTokenizer.from_pretrained(folders["chatml_marked"]).apply_chat_template(
        CONVERSATIONS[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt")
    with torch.no_grad():
        want = model(hf["input_ids"], labels=hf["input_ids"].masked_fill(hf["assistant_masks"] == 0, IGNORE)).loss
        logits = model(inputs).logits
    got = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / batch.supervised
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert batch.supervised == int(hf["assistant_masks"][0, 1:].sum())
