"""Tokenizers: a built-in byte tokenizer and Hugging Face `tokenizer.json` files.

    from torchmoe.data import build_tokenizer
    tok = build_tokenizer("")                      # bytes, vocab 258, no files
    tok = build_tokenizer("path/to/Llama-4-Scout") # folder holding tokenizer.json

Both expose the same small interface, which is all the data pipeline and the trainer use.
`encode` never adds special tokens: the packer decides where BOS/EOS go. `fingerprint()` names a
tokenizer and hashes what decides its ids, so that token ids made by one are never read with another
(pre-tokenized shards record it: `token_shards.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchmoe.config.files.nesting import json_loads
from torchmoe.config.files.paths import path_faults
from torchmoe.config.files.text import NotUTF8, utf8_text
from torchmoe.data.errors import DataConfigError
from torchmoe.data.read_bounds import read_whole

__all__ = ["Fingerprint", "Tokenizer", "ByteTokenizer", "HFTokenizer", "build_tokenizer", "special_tokens"]


@dataclass(frozen=True)
class Fingerprint:
    """Which tokenizer made some token ids: a name for people (`byte`, a tokenizer.json path) and a
    hash of everything that decides the ids; two tokenizers with the same hash encode alike."""

    name: str
    hash: str

    def __str__(self) -> str:
        return f"{self.name} (hash {self.hash[:16]})"


class Tokenizer(ABC):
    """Text <-> token ids. Ids are in `[0, vocab_size)`."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text; tokenizers that can encode in parallel override it."""
        return [self.encode(text) for text in texts]

    def encode_pieces(self, text: str, size: int) -> Iterator[list[int]]:
        """`encode(text)` in pieces of about `size` characters, for texts too long to hold all
        their ids at once; concatenated, the pieces are `encode(text)`.

        This default cuts only before a space that follows a character other than whitespace,
        where the pre-tokenizers of byte-level BPE (GPT-2, Llama 3 / 4) and of SentencePiece's
        Metaspace start a new word anyway, so no token spans a cut. (A tokenizer whose normalizer
        prepends to every input, as Llama 2's tokenizer.json does, would get one more piece at
        each cut.) A text without such a space is encoded whole.
        """
        start = 0
        while start < len(text):
            end = _word_start(text, start + size)
            yield self.encode(text[start:end])
            start = end

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens are kept, as their text where they have one)."""

    @abstractmethod
    def fingerprint(self) -> Fingerprint:
        """This tokenizer's name and the hash of what decides its ids (the class docstring says what)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; the model's vocab must be at least this."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """Beginning-of-text id, or None when the tokenizer has none."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-text id; the packer puts it after every document."""


def _word_start(text: str, at: int) -> int:
    """The first index >= `at` of a space that follows a character other than whitespace, or
    `len(text)`."""
    at = text.find(" ", max(at, 1))
    while at != -1 and text[at - 1].isspace():
        at = text.find(" ", at + 1)
    return len(text) if at == -1 else at


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257 (vocab 258).

    Needs no files, so the debug model trains anywhere; its vocab (512) holds every id. Its
    fingerprint is fixed: it has no file, and its ids never change.
    """

    _BOS = 256
    _EOS = 257
    _FINGERPRINT = Fingerprint("byte", "torchmoe-byte-tokenizer-v1")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_pieces(self, text: str, size: int) -> Iterator[list[int]]:
        # Every character is its own bytes: any cut is exact.
        for start in range(0, len(text), size):
            yield self.encode(text[start : start + size])

    def decode(self, ids: list[int]) -> str:
        # Specials have no bytes; dropping them keeps decode total on any id list.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> Fingerprint:
        return self._FINGERPRINT

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_id(self) -> int:
        return self._BOS

    @property
    def eos_id(self) -> int:
        return self._EOS


# Tried in order when no tokenizer_config.json / special_tokens_map.json names the token.
# Llama 4 first; then the conventions of other common families.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("<|end_of_text|>", "<|eot|>", "</s>", "<eos>", "<|endoftext|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer loaded from `tokenizer.json` via the `tokenizers` library.

    Its fingerprint is named by the file and hashes (sha256) the bytes of `tokenizer.json` with the
    BOS and EOS ids, which the config files next to it may choose.

    Args:
        path: the `tokenizer.json` file, or a folder holding it. BOS/EOS are read from the
            `bos_token`/`eos_token` of `tokenizer_config.json` (then `special_tokens_map.json`)
            next to it when present, else found by their usual names (Llama 4:
            `<|begin_of_text|>`, `<|end_of_text|>`).
        key: the setting that named `path`, for messages (``model.hf_assets_path`` where that
            filled the tokenizer's).

    Raises:
        DataConfigError: the `tokenizers` package is missing, the OS refuses the file (missing,
            a folder, no permission...: its reason), it is not a tokenizer, or the tokenizer has
            no end-of-text token.
    """

    def __init__(self, path: str | Path, *, key: str = "model.tokenizer_path") -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as e:
            raise DataConfigError(
                key, str(path), "loading tokenizer.json needs the 'tokenizers' package",
                "pip install 'torchmoe[data]', or leave it empty for the built-in byte tokenizer",
            ) from e  # fmt: skip
        path = Path(path)
        # Read here rather than by the library, whose errors carry no errno: the OS's reason is
        # the message.
        fix = "give a tokenizer.json this user can read, or a folder holding one; or leave it empty for the built-in " \
            "byte tokenizer"
        with path_faults(key, str(path), fix, error=DataConfigError):
            file = path / "tokenizer.json" if path.is_dir() else path
        data = read_whole(file, key=key, value=str(path), fix=fix)
        try:
            text = utf8_text(data, nul=False)
        except NotUTF8 as e:
            raise DataConfigError(key, str(path), f"{file} {e.problem}", e.fix(file)) from None
        try:
            self._tok = _RustTokenizer.from_str(text)
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise DataConfigError(key, str(path), f"{file} is not a valid tokenizer.json ({e})",
                                  "point it at a Hugging Face tokenizer.json (or its folder)") from None
        self.path = file
        named = _special_tokens_from_configs(file.parent, str(path), key)
        for role, token in named.items():
            if self._tok.token_to_id(token) is None:
                raise DataConfigError(key, str(path),
                                      f"its config names {role} {token!r}, which {file} does not hold",
                                      f"fix {role} in tokenizer_config.json / special_tokens_map.json, or use the "
                                      "tokenizer.json they belong to")
        self._bos = self._find_id(named.get("bos_token"), _BOS_CANDIDATES)
        eos = self._find_id(named.get("eos_token"), _EOS_CANDIDATES)
        if eos is None:
            raise DataConfigError(
                key, str(path),
                f"the tokenizer has no end-of-text token (looked for {', '.join(_EOS_CANDIDATES)})",
                "name it as eos_token in a tokenizer_config.json next to tokenizer.json",
            )  # fmt: skip
        self._eos = eos
        specials = json.dumps({"bos_id": self._bos, "eos_id": self._eos}, sort_keys=True).encode()
        # The length first: no tokenizer.json and specials can hash like another pair.
        self._hash = hashlib.sha256(len(data).to_bytes(8, "little") + data + specials).hexdigest()

    def _find_id(self, named: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in ((named,) if named else ()) + candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Runs on all cores (the library's thread pool; TOKENIZERS_PARALLELISM=false disables).
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(str(self.path), self._hash)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos


def _special_tokens_from_configs(folder: Path, tokenizer_path: str, key: str) -> dict[str, str]:
    """`bos_token`/`eos_token` from the HF config files in `folder`.

    `tokenizer_config.json` takes precedence over `special_tokens_map.json`. A value is a string
    or a serialized AddedToken ``{"content": ...}``; null (or absent) names none.

    Raises:
        DataConfigError: a config file that cannot be read, is not a JSON object, or names a
            token in another form.
    """
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.exists():
            continue
        config = _json_object(file, tokenizer_path, key)
        found.update(special_tokens(config, ("bos_token", "eos_token"), file, tokenizer_path, key))
    return found


def special_tokens(config: dict[str, Any], fields: tuple[str, ...], file: Path, tokenizer_path: str,
                   key: str) -> dict[str, str]:
    """The tokens that the `fields` of `config` (read from `file`) name: a string, or a serialized
    AddedToken ``{"content": ...}``; null (or absent) names none.

    Raises:
        DataConfigError: a field in another form (a number, a dict without a string content).
    """
    found = {}
    for field in fields:
        value = config.get(field)
        token = value.get("content") if isinstance(value, dict) else value
        if value is None:
            continue
        if not isinstance(token, str) or not token:
            raise DataConfigError(key, tokenizer_path, f"{file}: {field} is {value!r}, not a token string (or "
                                  '{"content": "<token>"})', f'write it as "{field}": "<token>", or remove it')
        found[field] = token
    return found


def _json_object(file: Path, tokenizer_path: str, key: str) -> dict[str, Any]:
    """The JSON object in `file`, or a `DataConfigError` saying why there is none."""
    fix = f"fix or delete {file.name} (it only names the special tokens)"
    data = read_whole(file, key=key, value=tokenizer_path, fix=fix, large_fix=fix)
    try:
        config = json_loads(utf8_text(data, nul=False))
    except NotUTF8 as e:
        raise DataConfigError(key, tokenizer_path, f"{file} {e.problem}", e.fix(file)) from None
    except json.JSONDecodeError as e:
        problem = f"{file} is not JSON ({e.msg} at line {e.lineno} column {e.colno})"
    else:
        if isinstance(config, dict):
            return config
        problem = f"{file} holds a JSON {type(config).__name__}, not an object"
    raise DataConfigError(key, tokenizer_path, problem, fix)


def build_tokenizer(tokenizer_path: str, *, key: str = "model.tokenizer_path") -> Tokenizer:
    """The tokenizer for `model.tokenizer_path`: bytes when empty, else a Hugging Face file;
    `key` names the path in messages (`HFTokenizer`). A Hugging Face one is built once per
    process for its files as they are (the checks before a run and the run itself share it:
    a 28 MB tokenizer.json read and parsed twice by each of 1,000 ranks is 56 GB)."""
    if not tokenizer_path:
        return ByteTokenizer()
    try:
        ident = (key, *_file_identities(Path(tokenizer_path)))
    except OSError:  # the build says what the OS refuses
        return HFTokenizer(tokenizer_path, key=key)
    if ident not in _BUILT:
        _BUILT.clear()  # one at a time: a process builds one run's tokenizer
        _BUILT[ident] = HFTokenizer(tokenizer_path, key=key)
    return _BUILT[ident]


_BUILT: dict[tuple, Tokenizer] = {}


def _file_identities(path: Path) -> tuple:
    """What tells this version of a tokenizer's files from another: the path, and each file's
    (name, size, modification and change times, inode), None for one that cannot be stat'ed (the
    build then says why)."""
    folder = path if path.is_dir() else path.parent
    files = (path / "tokenizer.json" if path.is_dir() else path, folder / "special_tokens_map.json",
             folder / "tokenizer_config.json")
    idents = []
    for file in files:
        try:
            st = os.stat(file)
            idents.append((str(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        except OSError:
            idents.append((str(file), None))
    return (os.path.abspath(path), *idents)
