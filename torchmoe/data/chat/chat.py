"""`training.dataset = "chat"`: conversations rendered by the model's chat template, packed whole.

    corpus = ChatCorpus(chat_rows("data/chat.jsonl"), loss_on="assistant", overlong="truncate")
    corpus.check_tokenizer(tokenizer)            # loads the chat template beside tokenizer.json
    stream = corpus.stream(row, rows, window=seq_len + 1, pad_id=tokenizer.eos_id)
    stream.take(1)                               # ChatWindows: inputs, labels, starts, real, each (1, seq_len)

Batch row j of G packs conversations [j*N/G, (j+1)*N/G) of the N rows, in order, pass after pass:
each one's tokens exactly as the template renders them (`chat_masks.render`: no BOS or EOS
added), whole, never cut between two rows of a batch. A window holds `seq_len + 1` tokens (a
conversation of n tokens has n - 1 targets, so one of seq_len + 1 tokens fits a row); a
conversation that does not fit the rest of a window starts the next one, and the rest is padding
(EOS ids, no targets, a document of its own, and no data: `ChatWindows.real` is False there, so
the MoE routers leave it out of their statistics). The labels are the next token where that
token is a target of the same conversation (`training.loss_on`), else -100: a conversation's
first token is never a target, so nothing is learned across a boundary.

A conversation longer than `seq_len + 1` tokens is cut to that length or dropped
(`training.chat_overlong`; only its first `seq_len + 1` tokens' targets are found); both are
counted (`ChatStats`, `DataLoader.chat_stats`) and the first of each is logged with its row. A
conversation left with no target (no assistant turn, or its turns cut off) is packed and adds
nothing to the loss; a batch row whose whole range holds none is refused when its stream is made
(its conversations are rendered until one has a target: before the first step, on every rank for
its own rows, in validation and `eval` alike), never trained on with a loss of 0. When the rows
of a source start another pass over their conversations (the data repeats), one line a pass says
so, with the counts.

The position of a row is `(epoch, index, 0)`: its next conversation not yet handed out in a
window. Packing from a window's start depends on nothing before it, so a resumed run packs the
same windows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchmoe.data.chat.chat_files import ChatRows, chat_rows, conversation
from torchmoe.data.chat.chat_masks import Rendered, render
from torchmoe.data.chat.chat_template import ChatTemplate
from torchmoe.data.documents import Documents
from torchmoe.data.errors import CorpusEnd, DataConfigError
from torchmoe.data.micro_batches import IGNORE, ChatWindows
from torchmoe.data.passes import Passes

if TYPE_CHECKING:
    from torchmoe.config.job_config import Training
    from torchmoe.data.tokenizer import Tokenizer

__all__ = ["ChatCorpus", "ChatRange", "ChatStats", "ChatStream", "chat_corpus"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ChatStats:
    """What one chat source's rows on this process did with their conversations since it started
    (each rank counts its own rows)."""

    packed: int = 0
    """Conversations put in a window."""
    truncated: int = 0
    """Of those, cut to `seq_len + 1` tokens (`training.chat_overlong = "truncate"`)."""
    dropped: int = 0
    """Longer than `seq_len + 1` tokens and left out (`"drop"`)."""
    unsupervised: int = 0
    """Packed with no target (no assistant turn to train on, or cut off)."""
    targets: int = 0
    """Target tokens packed."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ChatRange:
    """Conversations [lo, hi) of a chat corpus: what one batch row packs."""

    def __init__(self, rows: ChatRows, lo: int, hi: int) -> None:
        self.rows, self.lo, self.hi = rows, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def read(self, index: int) -> Any:
        return self.rows.read(self.lo + index)

    def locate(self, index: int) -> str:
        return self.rows.locate(self.lo + index)


class ChatCorpus(Documents):
    """The chat rows of a dataset path, to be rendered by the model's template.

    Args:
        rows: the rows (`chat_files.chat_rows`).
        loss_on: `training.loss_on`.
        overlong: `training.chat_overlong`.
    """

    def __init__(self, rows: ChatRows, *, loss_on: str = "assistant", overlong: str = "truncate") -> None:
        self.rows, self.loss_on, self.overlong = rows, loss_on, overlong
        self.source = (rows.key, rows.value)
        self.template: ChatTemplate | None = None
        self.stats = ChatStats()
        self.passes = Passes()

    def __repr__(self) -> str:
        return f"ChatCorpus({self.rows.value!r})"

    def iter_from(self, start: int = 0) -> Iterator[Any]:
        return (self.rows.read(i) for i in range(start, self.rows.count()))

    def locate(self, index: int) -> str:
        return self.rows.locate(index)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Load the chat template beside the tokenizer's tokenizer.json.

        Raises:
            DataConfigError: the tokenizer is the built-in byte tokenizer (no template), or its
                folder holds no chat template.
        """
        path = getattr(tokenizer, "path", None)
        if path is None:
            raise DataConfigError("model.tokenizer_path", "", f'{self.source[0]} = "{self.source[1]}" is chat data, '
                                  "rendered by the model's chat template, and the built-in byte tokenizer has none",
                                  "set model.tokenizer_path to the model's tokenizer folder (tokenizer.json beside "
                                  "its tokenizer_config.json or chat_template.jinja)")
        if self.template is None or self.template.folder != path.parent:  # each validation's loader asks again
            self.template = ChatTemplate.load(path.parent)

    def split(self, index: int, count: int) -> ChatRange:
        """Conversations [index*N/count, (index+1)*N/count): batch row `index` of `count`.

        Raises:
            DataConfigError: fewer conversations than batch rows.
        """
        n = self.rows.count()
        if n < count:
            raise DataConfigError("training.global_batch_size", count, f"the chat data ({self.source[0]} = "
                                  f"{self.source[1]}) holds {n} conversation(s), fewer than the {count} batch rows, "
                                  "each of which packs its own range of them",
                                  f"use a training.global_batch_size of at most {n}, or more conversations")
        return ChatRange(self.rows, index * n // count, (index + 1) * n // count)

    def stream(self, index: int, count: int, *, window: int, pad_id: int, repeat: bool = True,
               source: tuple[str, str] | None = None) -> ChatStream:
        """The packed stream of batch row `index` of `count` (`check_tokenizer` first)."""
        if self.template is None:
            raise RuntimeError("ChatCorpus.check_tokenizer must load the chat template before streams are made")
        return ChatStream(self.split(index, count), self.template, window=window, loss_on=self.loss_on,
                          overlong=self.overlong, pad_id=pad_id, repeat=repeat, source=source or self.source,
                          stats=self.stats, passes=self.passes)


class ChatStream:
    """One batch row's conversations packed into windows, with a resumable position.

    Args:
        conversations: the row's range.
        template: renders and tokenizes each conversation.
        window: tokens per window (`seq_len + 1`).
        loss_on, overlong: `training.loss_on`, `training.chat_overlong`.
        pad_id: the id that fills a window's rest.
        repeat: start another pass at the end of the range; False raises `CorpusEnd` there,
            once the last (partly filled) window is handed out.
        source: the setting that named the data and its value, for messages.
        stats: the counts this stream adds to; `passes` the passes its source's rows started.

    Raises:
        DataConfigError: no conversation of the range has a target (`_check_targets`), or one
            cannot be read or rendered.
    """

    def __init__(self, conversations: ChatRange, template: ChatTemplate, *, window: int, loss_on: str,
                 overlong: str, pad_id: int, repeat: bool, source: tuple[str, str], stats: ChatStats,
                 passes: Passes | None = None) -> None:
        self.conversations, self.template = conversations, template
        self.window, self.loss_on, self.overlong = window, loss_on, overlong
        self.pad_id, self.repeat, self.source, self.stats = pad_id, repeat, source, stats
        self.passes = passes or Passes()
        self._check_targets()
        self.seek(0, 0, 0)


    def _pass_line(self) -> str:
        """What starting another pass says: the data repeats, and what this process's rows did so far."""
        s = self.stats
        return (f"chat data ({self.source[0]} = {self.source[1]}): batch rows start pass {self._epoch} over their "
                f"conversations as each finishes the one before (data repeats); this process's rows so far packed "
                f"{s.packed:,} conversations ({s.truncated:,} cut, {s.dropped:,} dropped as longer than a row, "
                f"{s.unsupervised:,} without targets), {s.targets:,} target tokens")
    def position(self) -> tuple[int, int, int]:
        """`(epoch, index, 0)`: the next conversation not yet handed out, in pass `epoch`."""
        return self._epoch, self._next - (self._pending is not None), 0

    def seek(self, epoch: int, index: int, token_offset: int) -> None:
        """Continue from a `position()`.

        Raises:
            DataConfigError: the position is not one of a chat row's (another dataset, or more
                conversations than the row holds now).
        """
        if token_offset or index > len(self.conversations):
            raise DataConfigError(*self.source, f"the checkpoint's data position (pass {epoch}, conversation {index}, "
                                  f"token {token_offset}) is not in this batch row's {len(self.conversations)} "
                                  "conversations: the dataset changed since the checkpoint was saved",
                                  "resume with the dataset it was saved with; or set checkpoint.exclude_from_loading "
                                  '= ["dataloader"] (every batch row starts again at its first conversation)')
        self._epoch, self._next = epoch, index
        self._pending: Rendered | None = None  # read, but not in a window yet

    def take(self, n: int) -> ChatWindows:
        """The next `n` windows: inputs, labels and document starts, each (n, window - 1) int64,
        and which inputs are data (bool: the padding is not)."""
        windows = [self._window() for _ in range(n)]
        return ChatWindows(*(torch.stack(column) for column in zip(*windows, strict=True)))

    def _window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        targets: list[int] = []
        starts: list[int] = []
        while True:
            rendered = self._pending if self._pending is not None else self._next_conversation(handed_out=bool(ids))
            if rendered is None or len(ids) + len(rendered.ids) > self.window:
                self._pending = rendered
                break
            self._pending = None
            starts += [len(ids)] * len(rendered.ids)
            ids += rendered.ids
            targets += rendered.mask
        real = len(ids)
        rest = self.window - real
        starts += [real] * rest  # the padding is a document of its own
        ids += [self.pad_id] * rest
        targets += [0] * rest
        tokens, target, start = (torch.tensor(v, dtype=torch.long) for v in (ids, targets, starts))
        # A label is the next token where it is a target of the same document: a document's first
        # token (and padding) never is.
        keep = target[1:].bool() & (start[1:] == start[:-1])
        return tokens[:-1], torch.where(keep, tokens[1:], IGNORE), start[:-1], torch.arange(self.window - 1) < real

    def _render(self, index: int) -> Rendered:
        """Conversation `index` of the row, its first `window` tokens' targets found."""
        where = self.conversations.locate(index)
        return render(self.template, conversation(self.conversations.read(index), where, self.source), self.loss_on,
                      where=where, source=self.source, limit=self.window)

    def _fits(self, rendered: Rendered) -> bool:
        """Whether a conversation goes in a window: not when it is longer and `overlong` drops it."""
        return rendered.length <= self.window or self.overlong != "drop"

    def _check_targets(self) -> None:
        """Refuse a row whose conversations hold no target, as they are packed (cut or dropped by
        `overlong`), rendering them until one has one (the first, in data made for it)."""
        if any(self._fits(r) and sum(r.mask[1:]) for r in map(self._render, range(len(self.conversations)))):
            return
        shown = ", ".join(self.conversations.locate(i) for i in range(min(len(self.conversations), 3)))
        raise DataConfigError(
            "training.loss_on", self.loss_on,
            f"the {len(self.conversations)} conversation(s) of a batch row ({shown}{', ...' if len(self.conversations) > 3 else ''}) "
            "hold no token to train on (no assistant turn, or every one cut off or dropped as longer than "
            "training.seq_len + 1)",
            "give them assistant turns, raise training.seq_len, or choose another training.loss_on; each of the "
            "training.global_batch_size rows packs its own range of the conversations",
        )  # fmt: skip

    def _next_conversation(self, *, handed_out: bool) -> Rendered | None:
        """The next conversation that fits a window (cut or dropped as `overlong` says); None at
        the end of a pass when the window has some already (`handed_out`) or the stream does not
        repeat (then `CorpusEnd` once the window is empty)."""
        while True:
            if self._next == len(self.conversations):
                if handed_out:
                    return None
                self._end_pass()
            index = self._next
            self._next += 1
            rendered = self._render(index)
            if rendered.length > self.window:
                self._count("dropped" if not self._fits(rendered) else "truncated", index, rendered.length)
                if not self._fits(rendered):
                    continue
            targets = sum(rendered.mask[1:])  # a conversation's first token has nothing to predict it from
            self.stats.packed += 1
            self.stats.targets += targets
            self.stats.unsupervised += targets == 0
            return rendered

    def _count(self, what: str, index: int, size: int) -> None:
        """Count a conversation cut or dropped; the first of each kind is logged."""
        setattr(self.stats, what, getattr(self.stats, what) + 1)
        if getattr(self.stats, what) == 1:
            logger.warning("%s: %s tokens, more than a row's %d (training.seq_len + 1): %s (training.chat_overlong = "
                           "%r); the data loader's chat_stats() counts every one", self.conversations.locate(index),
                           size, self.window, what, self.overlong)

    def _end_pass(self) -> None:
        """At the end of the row's range: another pass, or `CorpusEnd`."""
        if not self.repeat:
            raise CorpusEnd(f"{len(self.conversations)} conversations of {self.source[1]}")
        self._epoch += 1
        self._next = 0
        self.passes.start(self._epoch, self._pass_line)


def chat_corpus(training: Training, *, key: str = "training.dataset_path") -> ChatCorpus:
    """The chat corpus of `training` (`dataset = "chat"`); `key` names its path in messages.

    Raises:
        DataConfigError: the path holds no chat rows.
    """
    rows = chat_rows(training.dataset_path, key=key, extensions=training.dataset_extensions,
                     split=training.dataset_split)
    return ChatCorpus(rows, loss_on=training.loss_on, overlong=training.chat_overlong)
