"""Text files a user gives (TOML, JSON, documents) as UTF-8: what else they are, said in one line.

    try:
        text = utf8_text(path.read_bytes())
    except NotUTF8 as err:
        raise ConfigError("--config", str(path), err.problem, err.fix(path))

Editors on Windows save UTF-8 with a byte order mark, or UTF-16; TOML and JSON allow neither,
and a parser meeting one reports only an invalid first character. A BOM names the encoding the
file is in, so the message does too, and the fix converts it.
"""

from __future__ import annotations

import codecs
import os
import re

__all__ = ["SURROGATE_FIX", "NotUTF8", "lone_surrogate", "utf8_text"]

# A code point of a UTF-16 surrogate pair, alone in a str: JSON's escapes write one ("\\ud800"), no
# encoding holds it, and the tokenizers library refuses it.
_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_FIX = "a character beyond U+FFFF is written in JSON as a pair of surrogates (\\ud83d\\ude00), or as itself"

# UTF-32 LE's mark begins with UTF-16 LE's: the longer marks are tried first.
_BOMS = (("UTF-32LE", codecs.BOM_UTF32_LE), ("UTF-32BE", codecs.BOM_UTF32_BE), ("UTF-8", codecs.BOM_UTF8),
         ("UTF-16LE", codecs.BOM_UTF16_LE), ("UTF-16BE", codecs.BOM_UTF16_BE))


class NotUTF8(ValueError):
    """Bytes that are not plain UTF-8 text: `problem` says what they are (a byte order mark and
    the encoding it marks, or the first byte that is not UTF-8); `fix(path)` how to convert.

    Args:
        problem: one line, e.g. "starts with the UTF-8 byte order mark (BOM, bytes EF BB BF)".
        source: the encoding to convert from, as iconv names it; "" for UTF-8 with a BOM (which
            only needs the mark removed).
    """

    def __init__(self, problem: str, source: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.source = source

    def fix(self, path: str | os.PathLike) -> str:
        """What to do about the file at `path` (the message names its folder already)."""
        name = os.path.basename(path)
        if not self.source:
            return f"save {name} as UTF-8 without a BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' {name}"
        return f"convert {name} to UTF-8, e.g. iconv -f {self.source} -t UTF-8 {name} > {name}.utf8, then replace it"


def utf8_text(data: bytes, *, nul: bool = True) -> str:
    """`data` decoded as UTF-8; `nul=False` for formats that allow no NUL byte (TOML, JSON), which
    UTF-16 / UTF-32 text without a byte order mark is full of.

    Raises:
        NotUTF8: it starts with a byte order mark (UTF-8's, which TOML and JSON refuse, or that
            of UTF-16 / UTF-32), a byte is not UTF-8 (with its offset), or (`nul=False`) one is NUL.
    """
    for encoding, bom in _BOMS:
        if data.startswith(bom):
            mark = f"the {encoding} byte order mark (BOM, bytes {bom.hex(' ').upper()})"
            if encoding == "UTF-8":
                raise NotUTF8(f"starts with {mark}", "")
            # iconv takes the byte order from the mark, and drops it, only when told no endianness.
            raise NotUTF8(f"is {encoding} text, not UTF-8: it starts with {mark}", encoding[:6])
    if not nul and (at := data.find(b"\x00")) >= 0:
        # ASCII in UTF-16 without a mark: a NUL after each character (LE) or before it (BE).
        guess = "UTF-16LE" if at % 2 else "UTF-16BE"
        raise NotUTF8(f"is not UTF-8 text: byte {at} is NUL ({guess} text without a byte order mark?)", guess)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        # latin1: a guess, the most common other encoding.
        raise NotUTF8(f"is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02X}: {err.reason})",
                      "latin1") from None


def lone_surrogate(text: str) -> str | None:
    """What is wrong with `text` if it holds a lone surrogate (parsed from JSON's escapes), in
    words ("holds a lone surrogate (\\ud800 at character 3), which is no text: ..."), else None."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (f"holds a lone surrogate (\\u{ord(found.group()):04x} at character {found.start()}), which is no text: it "
            "cannot be encoded as UTF-8, nor tokenized")
