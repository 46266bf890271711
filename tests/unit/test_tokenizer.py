"""Tokenizers: the built-in byte tokenizer and tokenizer.json files built in tmp_path.

    pytest tests/unit/test_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe.data import ByteTokenizer, HFTokenizer, build_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"]
CORPUS = [
    "def main():\n    return 0\n",
    "import torch\nx = torch.zeros(3)\n",
    "The quick brown fox jumps over the lazy dog.",
] * 20


def _write_bpe(folder: Path, specials: list[str] = SPECIALS, with_bos_template: bool = False) -> Path:
    """Train a tiny byte-level BPE on CORPUS and save it as folder/tokenizer.json."""
    pytest.importorskip("tokenizers", reason="HFTokenizer needs the 'tokenizers' package")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if with_bos_template:
        # A post-processor that adds BOS, like Llama's: encode() must not apply it.
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "tokenizer.json"
    tok.save(str(file))
    return file


def test_byte_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld → 你好\n\tdef f(): pass"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    # Specials carry no bytes: decode skips them.
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text


def test_build_tokenizer_empty_path_is_bytes() -> None:
    assert isinstance(build_tokenizer(""), ByteTokenizer)


def test_hf_tokenizer_from_file_and_folder(tmp_path: Path) -> None:
    file = _write_bpe(tmp_path / "tok")
    for path in (file, file.parent, str(file.parent)):
        tok = build_tokenizer(str(path))
        assert isinstance(tok, HFTokenizer)
        text = "def main():\n    x = torch.zeros(3)\n"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        # The trained merges are used: fewer tokens than bytes.
        assert len(ids) < len(text.encode())
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.bos_id == tok._tok.token_to_id("<|begin_of_text|>")
        assert tok.eos_id == tok._tok.token_to_id("<|end_of_text|>")
        assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)


def test_hf_encode_adds_no_special_tokens(tmp_path: Path) -> None:
    tok = HFTokenizer(_write_bpe(tmp_path, with_bos_template=True))
    assert tok.bos_id not in tok.encode("import torch")
    # The parallel batch path gives the same ids, also without specials.
    assert tok.encode_batch(CORPUS[:3]) == [tok.encode(text) for text in CORPUS[:3]]


def test_hf_specials_from_tokenizer_config(tmp_path: Path) -> None:
    _write_bpe(tmp_path)
    # Instruct checkpoints end turns with <|eot|>; the AddedToken dict form must be understood.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot|>"}})
    )
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == tok._tok.token_to_id("<|eot|>")
    assert tok.bos_id == tok._tok.token_to_id("<|begin_of_text|>")


def test_hf_tokenizer_without_bos_or_eos(tmp_path: Path) -> None:
    gpt2_style = HFTokenizer(_write_bpe(tmp_path / "a", specials=["<|endoftext|>"]))
    assert gpt2_style.bos_id is None
    assert gpt2_style.eos_id == gpt2_style._tok.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="no end-of-text token"):
        HFTokenizer(_write_bpe(tmp_path / "b", specials=["<pad>"]))


def test_hf_tokenizer_missing_file(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="HFTokenizer needs the 'tokenizers' package")
    with pytest.raises(ValueError, match=r"tokenizer\.json: No such file or directory"):
        build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="nope.json"):
        build_tokenizer(str(tmp_path / "nope.json"))


def test_malformed_tokenizer_json_is_a_config_error(tmp_path):
    pytest.importorskip("tokenizers", reason="HFTokenizer needs the 'tokenizers' package")
    from torchmoe.data.dataset import DataConfigError
    from torchmoe.data.tokenizer import build_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(DataConfigError, match="not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path))


# Long text with every kind of whitespace run a pre-tokenizer treats specially: double spaces,
# newlines after punctuation, tabs, spaces before newlines, a space at the very start.
_LONG = " " + "".join(f"def f{i}(x):\n    return x  +  {i}.\n\n\t# the quick  brown fox jumps over the lazy dog \n"
                      for i in range(40))


@pytest.mark.parametrize("size", [1, 7, 50, 1000, 10**6])
def test_byte_pieces_are_the_whole_encoding(size: int) -> None:
    text = "héllo, wörld → 你好 " * 30
    pieces = list(ByteTokenizer().encode_pieces(text, size))
    assert [i for piece in pieces for i in piece] == ByteTokenizer().encode(text)
    assert len(pieces) == -(-len(text) // size)  # cut anywhere: every character is its own bytes


@pytest.mark.parametrize("pre_tokenizer", ["byte_level", "metaspace"])
@pytest.mark.parametrize("size", [1, 13, 200])
def test_hf_pieces_are_the_whole_encoding(tmp_path: Path, pre_tokenizer: str, size: int) -> None:
    """Cut only before a space after a non-space: byte-level BPE (Llama 3 / 4, GPT-2) and
    SentencePiece's Metaspace start a word there anyway, so no token spans a cut."""
    pytest.importorskip("tokenizers", reason="HFTokenizer needs the 'tokenizers' package")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if pre_tokenizer == "metaspace" else None))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if pre_tokenizer == "byte_level"
                         else pre_tokenizers.Metaspace(prepend_scheme="first"))
    tok.train_from_iterator(CORPUS + [_LONG], trainers.BpeTrainer(
        vocab_size=400, special_tokens=[*SPECIALS, "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if pre_tokenizer == "byte_level" else []))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    pieces = list(hf.encode_pieces(_LONG, size))
    assert len(pieces) > 1
    assert [i for piece in pieces for i in piece] == hf.encode(_LONG)


def test_a_tokenizer_is_read_once_per_process_for_its_files_as_they_are(tmp_path, monkeypatch) -> None:
    """The checks before a run and the run build the same tokenizer: its files are read once
    (not twice by each of 1,000 ranks); an edited file is read again."""
    from tests.helpers import small_bpe
    from torchmoe.data import tokenizer as tokenizer_module

    path = small_bpe(tmp_path / "tokenizer.json")
    built = []
    real = tokenizer_module.HFTokenizer
    monkeypatch.setattr(tokenizer_module, "HFTokenizer", lambda *a, **k: built.append(a) or real(*a, **k))
    first = tokenizer_module.build_tokenizer(str(path))
    assert tokenizer_module.build_tokenizer(str(path)) is first and len(built) == 1
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>"}')  # a config appears
    assert tokenizer_module.build_tokenizer(str(path)) is not first and len(built) == 2
    assert tokenizer_module.build_tokenizer(str(path), key="validation.tokenizer") is not first  # messages name its key
