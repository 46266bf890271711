"""Hugging Face datasets as document sources (`training.dataset = "hf"`, torchtitan's `c4` and
`c4_validation`): streamed with `datasets`, never shuffled, so every pass and every rank sees
the same rows in the same order (`dataset.py` has the sources and `build_documents`).

    docs = HFDocuments.from_spec("allenai/c4:en", split="validation")
    for text in docs.split(0, 2).iter_from(10): ...   # rows of sub-corpus 0 of 2, from its 10th
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from torchmoe.data.documents import DataConfigError, Documents, check_split


def as_text(value: Any, where: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataConfigError(
            "training.dataset_text_field", field, f"{where} holds {type(value).__name__}, not a string",
            "set it to the field that holds the text",
        )  # fmt: skip
    return value


class HFDocuments(Documents):
    """A Hugging Face dataset, streamed with `datasets.load_dataset(..., streaming=True)`.

    `name` is anything `load_dataset` accepts as its first argument: a hub id
    (`allenai/c4`) or a local folder of data files. The stream is never shuffled, so its order
    is the dataset's own. Resuming at document k streams past the first k rows (no
    tokenization, but they are downloaded/read again).

    `split(j, G)` is `datasets.distributed.split_dataset_by_node(stream, rank=j, world_size=G)`:
    when the dataset has a multiple of G shards (files), sub-corpus j is shards j, j+G, ... and
    reads nothing else; otherwise it keeps rows j, j+G, ... of the whole stream. `key` is the
    setting that named the dataset, for messages.
    """

    def __init__(
        self, name: str, config: str | None = None, *, split: str = "train", text_field: str = "text",
        key: str = "training.dataset_path",
    ) -> None:
        # Fail when the job is built, not at the first batch.
        if importlib.util.find_spec("datasets") is None:
            raise DataConfigError(
                "training.dataset", "hf", "streaming hub datasets needs the 'datasets' package",
                "pip install 'torchmoe[data]'",
            )  # fmt: skip
        self.name = name
        self.config = config
        self.split_name = split
        self.text_field = text_field
        self.key = key

    def __repr__(self) -> str:
        return f"HFDocuments({self.name!r}, {self.config!r}, split={self.split_name!r})"

    @classmethod
    def from_spec(cls, spec: str, *, split: str = "train", text_field: str = "text",
                  key: str = "training.dataset_path") -> HFDocuments:
        """From `training.dataset_path` (the setting `key`): `"name"` or `"name:config"` (an
        existing local path is taken whole, even if it holds a colon)."""
        if not spec:
            raise DataConfigError(
                key, spec, 'dataset = "hf" needs a hub dataset',
                "set it to 'name' or 'name:config', e.g. 'allenai/c4:en'",
            )  # fmt: skip
        if os.path.exists(spec) or ":" not in spec:
            return cls(spec, None, split=split, text_field=text_field, key=key)
        name, _, config = spec.partition(":")
        return cls(name, config or None, split=split, text_field=text_field, key=key)

    @cached_property
    def stream(self) -> Any:
        """The `datasets.IterableDataset`, resolved once (its data files) and shared by every
        sub-corpus of this process."""
        import datasets

        with self._loading():
            return datasets.load_dataset(self.name, self.config, split=self.split_name, streaming=True)

    @contextmanager
    def _loading(self) -> Iterator[None]:
        """`datasets` raises a dozen exception types for a dataset it cannot resolve or read (no
        such dataset, config or split, no data files, a corrupt file, no network): each is the
        user's to fix, so each becomes one message naming the dataset."""
        hub_logger = logging.getLogger("datasets")  # it also logs such errors itself, as ERROR
        level = hub_logger.level
        hub_logger.setLevel(logging.CRITICAL)
        try:
            yield
        except DataConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - see above
            spec = self.name + (f":{self.config}" if self.config else "")
            raise DataConfigError(
                self.key, spec, f"the hub dataset cannot be read ({type(e).__name__}: {e})",
                "check the dataset name and config ('name' or 'name:config'), the split "
                "(training.dataset_split), its files, and the network or the datasets cache",
            ) from None
        finally:
            hub_logger.setLevel(level)

    def iter_from(self, start: int = 0) -> Iterator[str]:
        return self._rows(self.stream.skip(start) if start else self.stream, start, "")

    def split(self, index: int, count: int) -> Documents:
        check_split(index, count)
        return self if count == 1 else HFSubCorpus(self, index, count)

    def locate(self, index: int, where: str = "") -> str:
        """Row `index` (of `where`: a sub-corpus) of the hub dataset."""
        return f"row {index}{where} of hub dataset {self.name!r}"

    def _rows(self, stream: Any, start: int, where: str) -> Iterator[str]:
        """The text of each row of `stream`, whose first row is row `start` of `where`."""
        rows = iter(stream)
        for i in itertools.count(start):
            with self._loading():  # reading a row reads (and may fail on) the dataset's files
                row = next(rows, None)
            if row is None:
                return
            if self.text_field not in row:
                raise DataConfigError(
                    "training.dataset_text_field", self.text_field,
                    f"{self.locate(i, where)} has no such field (found {sorted(row)})",
                    "set it to the field that holds the text",
                )  # fmt: skip
            yield as_text(row[self.text_field], self.locate(i, where), self.text_field)


class HFSubCorpus(Documents):
    """Sub-corpus `index` of `count` of a hub dataset (`HFDocuments.split`)."""

    def __init__(self, parent: HFDocuments, index: int, count: int) -> None:
        self.parent = parent
        self.index = index
        self.count = count

    def __repr__(self) -> str:
        return f"split_dataset_by_node(rank={self.index}, world_size={self.count}) of {self.parent!r}"

    def iter_from(self, start: int = 0) -> Iterator[str]:
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(self.parent.stream, rank=self.index, world_size=self.count)
        # islice, not part.skip(): on a split by examples, datasets applies skip() to the whole
        # stream before keeping 1 row in `count`, which would start at the wrong row.
        rows = itertools.islice(part, start, None)
        return self.parent._rows(rows, start, self._where)

    def locate(self, index: int) -> str:
        return self.parent.locate(index, self._where)

    @property
    def _where(self) -> str:
        return f" of sub-corpus {self.index}/{self.count}"


# Directories that differ between machines with the same Python (installed packages, build
# configuration, bytecode caches); never read.
