"""Packing documents into fixed-length sequences: one packed sub-stream per batch row.

    from torchmoe.data import build_dataloader, build_tokenizer
    loader = build_dataloader(job_config.training, build_tokenizer(""), dp_rank=r, dp_degree=D,
                              batch_mesh=mesh["batch"])   # the mesh only under a process group
    for inputs, labels in loader.next_batch():   # one optimizer step: the micro-batches
        ...                                      # each (local_batch_size, seq_len) int64

The global batch has G = global_batch_size rows. Row j of every global batch is the next window
of `seq_len + 1` tokens of its own endless token stream, sub-stream j: the units of row j
(`Documents.split(j, G)`: the j-th of G contiguous ranges of the corpus, documents and parts of
documents, `documents.py`; rows of a hub dataset j, j+G, ...), each document followed by EOS (and
preceded by BOS with `training.add_bos`, as torchtitan packs), unit after unit, pass after pass.
`inputs = window[:-1]`, `labels = window[1:]`; nothing is padded, so every label counts in the
loss.

Rank r of D data-parallel ranks owns the contiguous rows [r*G/D, (r+1)*G/D): it reads and
tokenizes only their ranges, and splits its rows into consecutive micro-batches of
`local_batch_size`. Concatenating every rank's micro-batches in (rank, micro-batch) order gives
the global batch, and since the ranges depend only on G, every layout with the same G trains on
the same data in the same order. The price: another G is another data order, so a run cannot
resume with a different G.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from torchmoe.data.chat.chat import ChatCorpus
from torchmoe.data.dataset import build_documents
from torchmoe.data.documents import DataConfigError, Documents
from torchmoe.data.micro_batches import MicroBatch, micro_batches
from torchmoe.data.mixture import KEY, MixSchedule, source_settings
from torchmoe.data.packing import PackedStream
from torchmoe.data.passes import Passes
from torchmoe.data.token_shards import TokenShards
from torchmoe.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchmoe.config.job_config import Training, Validation

__all__ = ["Corpus", "DataLoader", "build_corpus", "build_dataloader", "validation_data"]



# The rule that cuts a corpus into batch rows, saved with every position: 1, contiguous byte ranges
# (`documents.RowCorpus`). Checkpoints without it counted documents j, j + G, ... of each row.
ROW_SPLIT = 1


class DataLoader:
    """This rank's batch rows, packed from their own ranges of the corpus, for each optimizer step.

    Rank r builds one `PackedStream` per row it owns (rows [r*G/D, (r+1)*G/D), see the module
    docstring) and source, and never reads another row's documents: tokenization is split D ways.
    With several sources (a mixture, `mixture.py`), row j of each step reads its next window from
    the source `mix` picks for it; each source keeps its own position per row.

    Args:
        documents: the corpus (`build_documents`); row j packs `documents.split(j, G)`. Or one
            corpus per source of a mixture, with `mix` and `source_names`.
        tokenizer: the model's tokenizer.
        seq_len: tokens per sequence.
        global_batch_size: sequences per optimizer step over all dp ranks (G): the rows.
        local_batch_size: sequences per micro-batch on one rank.
        dp_rank: this rank's index on the batch mesh (dp_replicate x dp_shard); CP/TP/PP peers
            of one dp rank pass the same dp_rank and get the same data.
        dp_degree: size of the batch mesh (D).
        batch_mesh: the 1-D batch DeviceMesh when running under a process group; the checkpoint
            state is then a DTensor sharded over it (see `state_dict`). Must agree with
            dp_rank and dp_degree.
        read_ahead: documents tokenized together on this rank, split over its rows (at least
            one per row); it changes no batch.
        add_bos: start every document with the tokenizer's BOS token.
        repeat: rows start another pass at the end of their range; False makes `next_batch`
            raise `CorpusEnd` when a row of this rank runs out (one pass, for validation).
        source: the setting that named the corpus and its value, for messages (`PackedStream`);
            one per source with several.
        mix: which source each row reads, with several sources.
        source_names: each source's name in metrics (`tokens_by_source`).

    Raises:
        ValueError: dp_rank, dp_degree or batch_mesh are out of range or disagree (a caller bug).
    """

    def __init__(
        self,
        documents: Documents | Sequence[Documents],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        batch_mesh: DeviceMesh | None = None,
        read_ahead: int = 64,
        add_bos: bool = False,
        repeat: bool = True,
        source: tuple[str, str] | Sequence[tuple[str, str]] | None = None,
        mix: MixSchedule | None = None,
        source_names: Sequence[str] = (),
    ) -> None:
        corpora = [documents] if isinstance(documents, Documents) else list(documents)
        for corpus in corpora:
            corpus.check_tokenizer(tokenizer)
        if (len(corpora) > 1) != (mix is not None) or len(source_names) not in (0, len(corpora)):
            raise ValueError(f"{len(corpora)} sources need a MixSchedule exactly when there are several, and a "
                             f"name each (got {source_names})")
        sources = [source] if source is None or isinstance(source[0], str) else list(source)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        if batch_mesh is not None and (batch_mesh.ndim, batch_mesh.size(), batch_mesh.get_local_rank()) != (
            1, dp_degree, dp_rank
        ):
            raise ValueError(
                f"batch_mesh {batch_mesh} is not a 1-D mesh of size dp_degree={dp_degree} with "
                f"this rank at dp_rank={dp_rank}"
            )
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.batch_mesh = batch_mesh
        per_rank = global_batch_size // dp_degree
        self.rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)  # global row indices owned here
        bos = None
        if add_bos:
            bos = tokenizer.bos_id
            if bos is None:
                raise DataConfigError("training.add_bos", True, "the tokenizer has no BOS token",
                                      "name one as bos_token in tokenizer_config.json, or set add_bos = false")
        text_passes = [Passes() for _ in corpora]  # a text source's passes, said once each (chat's: its corpus's)
        self._streams = [  # [source][row of this rank]
            [
                corpus.stream(row, global_batch_size, window=seq_len + 1, pad_id=tokenizer.eos_id, repeat=repeat,
                              source=sources[min(s, len(sources) - 1)])  # whole conversations, no BOS added
                if isinstance(corpus, ChatCorpus) else
                PackedStream(
                    corpus.split(row, global_batch_size), tokenizer,
                    window=seq_len + 1, read_ahead=max(1, read_ahead // per_rank), bos=bos, repeat=repeat,
                    source=sources[min(s, len(sources) - 1)], passes=text_passes[s],
                )  # fmt: skip
                for row in self.rows
            ]
            for s, corpus in enumerate(corpora)
        ]
        self.mix = mix
        self.eos_id = tokenizer.eos_id
        self._chat = {name: corpus.stats for name, corpus in zip(list(source_names) or ["data"], corpora)
                      if isinstance(corpus, ChatCorpus)}
        self.source_names = list(source_names) or ["data"]
        self._source_rows = torch.zeros(len(corpora), dtype=torch.long)  # rows each source filled, all ranks
        # Each source's identity (its name, dataset and path), saved with a mixture's positions:
        # the same sources in another order took each other's positions on resume.
        self._source_ids = torch.tensor([_source_id(name, sources[min(s, len(sources) - 1)])
                                         for s, name in enumerate(self.source_names)], dtype=torch.long)
        self._saved_without_ids = False  # a mixture checkpoint from before they were saved
        self._step = 0

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank: G / (local_batch_size * D)."""
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches for the next optimizer step.

        Returns:
            `grad_accum_steps` pairs `(inputs, labels)`, each (local_batch_size, seq_len) int64,
            with `labels[:, t] == inputs[:, t + 1]` inside a text sequence; each a `MicroBatch`
            that also carries its count of targets and, with chat rows, its document starts
            (`micro_batches`).
        """
        if self.mix is None:
            rows = [stream.take(1) for stream in self._streams[0]]  # G/D rows of seq_len + 1 tokens
            self._source_rows[0] += self.global_batch_size
        else:
            picks = self.mix.sources(self._step, self.rows, self.global_batch_size)
            rows = [self._streams[s][i].take(1) for i, s in enumerate(picks.tolist())]
            self._source_rows += torch.from_numpy(self.mix.counts(self._step, self.global_batch_size))
        self._step += 1
        return micro_batches(rows, self.local_batch_size, self.eos_id)

    def chat_stats(self) -> dict[str, dict[str, int]]:
        """Per chat source (by name), what this rank's rows did with its conversations since the
        process started: packed, truncated, dropped, unsupervised and target tokens (`ChatStats`)."""
        return {name: stats.as_dict() for name, stats in self._chat.items()}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last `next_batch`.

        - `step`: optimizer steps (global batches) served so far (the same on every rank).
        - `rows`: int64 (G, 3 * S) for S sources; row j holds, per source, `(epoch, doc_index,
          token_offset)` of its stream j: its next window starts at token `token_offset` of unit
          `doc_index` of row j (a document or a part of one, `Documents.split`: its tokens, and
          EOS if it ends its document) in pass `epoch`.
        - `source_rows` (several sources only): int64 (S,), the rows each source has filled.
        - `source_ids` (several sources only): int64 (S,), each source's identity (its name,
          dataset and path): a resume with the sources renamed, repointed or reordered is refused.
        - `split`: `ROW_SPLIT`, the rule that cut the corpus into rows (a position means nothing
          under another).

        With a `batch_mesh`, `rows` is a DTensor sharded `Shard(0)` over it, each rank holding
        its own G/D rows, so DCP saves every rank's rows and reshards them on load into any dp
        degree and local batch size with the same G. Without one it is a plain tensor of this
        rank's rows: (G, 3 * S) in a single process.
        """
        width = 3 * len(self._streams)
        rows = torch.tensor([[v for streams in self._streams for v in streams[i].position()]
                             for i in range(len(self.rows))], dtype=torch.long).view(len(self.rows), width)
        if self.batch_mesh is not None:
            rows = DTensor.from_local(
                rows, self.batch_mesh, [Shard(0)], shape=torch.Size((self.global_batch_size, width)), stride=(width, 1)
            )
        state = {"step": self._step, "rows": rows, "split": torch.tensor(ROW_SPLIT)}
        if self.mix is not None:
            state["source_rows"] = self._source_rows.clone()
            if not self._saved_without_ids:
                state["source_ids"] = self._source_ids.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state` (from `state_dict`, of any layout with the same G and sources).

        `rows` may be a DTensor (this rank's shard is used), the full (G, 3 * S) tensor (this
        rank takes its rows) or this rank's own (G/D, 3 * S) rows.

        Cost: per row, the units of its range before `doc_index` are skipped by
        `Documents.iter_from` (see dataset.py for what each source re-reads); tokenization
        restarts at document `doc_index`, independent of the step count.

        Raises:
            DataConfigError: the state has another number of rows (another global_batch_size)
                or of sources, or a position is past the end of its range or document (the
                dataset or the tokenizer changed).
        """
        rows = state["rows"]
        if isinstance(rows, DTensor):  # ours (DCP loads into `state_dict()`'s), so G matches
            rows = rows.to_local()
        elif len(rows) == self.global_batch_size:
            rows = rows[self.rows.start : self.rows.stop]
        self._check_shape((self.global_batch_size if len(rows) == len(self.rows) else len(rows), rows.shape[1]))
        for i, positions in enumerate(rows.reshape(len(self.rows), -1, 3).tolist()):
            for streams, (epoch, doc_index, token_offset) in zip(self._streams, positions, strict=True):
                streams[i].seek(epoch, doc_index, token_offset)
        if self.mix is not None:
            self._check_source_ids(state.get("source_ids"))
            self._source_rows = state["source_rows"].clone()
        self._step = int(state["step"])
        self._saved_without_ids = False  # saved from now on

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each source has fed (to every rank together) since the run began: name -> count."""
        return {name: int(count) * self.seq_len for name, count in zip(self.source_names, self._source_rows)}

    def check_saved_shapes(self, shapes: Mapping[str, torch.Size]) -> None:
        """Refuse a checkpoint whose `rows` (shape in `shapes`) were saved with another G or
        another number of sources.

        `CheckpointManager` calls it before loading (DCP would fail on the shape with a
        traceback-worthy error): another G is another data order, so it is a user error.
        """
        saved = shapes.get("rows")
        if saved is not None:
            if "split" not in shapes:  # saved before rows were ranges of the corpus
                raise DataConfigError(
                    "checkpoint.folder", "", "the checkpoint's data positions count documents j, j + G, ... of each "
                    "row, the row split of torchmoe before 2026-12-02; rows are now contiguous ranges of the corpus, "
                    "so those positions cannot be continued",
                    'set checkpoint.exclude_from_loading = ["dataloader"] (every batch row starts again at its '
                    "first document), or start a new run in another job.dump_folder",
                )  # fmt: skip
            self._check_shape(tuple(saved))
            self._saved_without_ids = self.mix is not None and "source_ids" not in shapes

    def _check_source_ids(self, saved: torch.Tensor | None) -> None:
        """Refuse a mixture checkpoint whose sources were others, or in another order (their
        positions would be read from each other's corpora); `saved` None: saved before the
        identities were (taken as they are)."""
        if saved is None or torch.equal(saved, self._source_ids):
            return
        moved = [i for i in range(len(self._source_ids)) if saved[i] != self._source_ids[i]]
        names = ", ".join(f"{i} ({self.source_names[i]})" for i in moved)
        raise DataConfigError(
            "training.dataset_mix", ", ".join(self.source_names),
            f"the checkpoint was saved with other sources at position {names}: each source's position is "
            "kept by its place in the list, so a source renamed, repointed or moved would continue another's",
            "resume with the mix the run was saved with (the same names, datasets and paths, in the same order); "
            'or set checkpoint.exclude_from_loading = ["dataloader"] (every source starts again at its first '
            "document)",
        )  # fmt: skip

    def _check_shape(self, saved: tuple[int, int]) -> None:
        if saved[0] != self.global_batch_size:
            raise DataConfigError(
                "training.global_batch_size", self.global_batch_size,
                f"the checkpoint was saved with global_batch_size {saved[0]}; each batch row reads "
                "its own range of the corpus, so the data position of one cannot continue in the other",
                f"resume with training.global_batch_size = {saved[0]}, or start a new run in another "
                "job.dump_folder (checkpoint.initial_load_path can start it from the weights)",
            )  # fmt: skip
        if saved[1] != 3 * len(self._streams):
            raise DataConfigError(
                "training.dataset_mix", len(self._streams),
                f"the checkpoint was saved with {saved[1] // 3} data source(s), this run has {len(self._streams)}; "
                "each source keeps its own position",
                "resume with the sources it was saved with; or set checkpoint.exclude_from_loading = "
                '["dataloader"] (every source starts again at its first document)',
            )  # fmt: skip


def _source_id(name: str, source: tuple[str, str] | None) -> int:
    """A signed 64-bit identity of a mixture source: its name, dataset and path."""
    text = "\0".join([name, *(source or ("", ""))]).encode("utf-8", errors="surrogateescape")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def validation_data(training: Training, validation: Validation) -> Training:
    """The `[training]` data settings of the validation batches: `validation`'s dataset, split,
    rows and length, one batch per step (no accumulation); BOS and the text field stay the
    training's."""
    return dataclasses.replace(training, dataset=validation.dataset, dataset_path=validation.dataset_path,
                               dataset_mix=[], dataset_split=validation.dataset_split, local_batch_size=validation.local_batch_size,
                               global_batch_size=-1, seq_len=validation.seq_len)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The documents a `[training]` section names, with what `DataLoader` says of them: one
    source, or a mixture's (`documents`, `sources`, `mix` and `names` as its arguments). Built
    once, a corpus makes any number of loaders: its files' indexes are found when the first one
    is made (by one rank, `file_index`) and kept."""

    documents: Documents | list[Documents]
    sources: tuple[str, str] | list[tuple[str, str]]
    mix: MixSchedule | None = None
    names: list[str] = dataclasses.field(default_factory=list)


def build_corpus(training: Training, *, key: str = "training.dataset_path",
                 index_cache: Path | None = None) -> Corpus:
    """The corpus of `training` (one source, or its `dataset_mix`); `key` names the dataset's path
    in messages (``validation.dataset_path`` for the validation data); `index_cache` keeps the
    data files' document indexes between runs (`FileDocuments`)."""
    mix = source_settings(training)
    if not mix:
        corpus = Corpus(build_documents(training, key=key, index_cache=index_cache, check_digests=False),
                        _source(training, key))
    else:
        corpus = Corpus([build_documents(alone, key=KEY, index_cache=index_cache, check_digests=False)
                         for _, alone in mix],
                        [(KEY, source.entry) for source, _ in mix],
                        MixSchedule([source.weight for source, _ in mix], training.seed) if len(mix) > 1 else None,
                        [source.name for source, _ in mix])
    _check_digests_together(corpus.documents if isinstance(corpus.documents, list) else [corpus.documents])
    return corpus


def _check_digests_together(sources: list[Documents]) -> None:
    """The token shards among `sources` checked against their manifests' digests, each rank of
    a process group hashing a share of their files (alone: all of them), and the first fault
    found raised on every rank. Collective under a process group when a source is token shards
    (every rank has the same sources)."""
    shards = [docs for docs in sources if isinstance(docs, TokenShards)]
    if not shards:
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    fault: DataConfigError | None = None
    try:
        for docs in shards:
            docs.check_digests(rank, world)
    except DataConfigError as err:
        fault = err
    if world > 1:
        faults: list[DataConfigError | None] = [None] * world
        dist.all_gather_object(faults, fault)
        fault = next((f for f in faults if f is not None), None)
    if fault is not None:
        raise fault


def build_dataloader(
    training: Training,
    tokenizer: Tokenizer,
    *,
    dp_rank: int = 0,
    dp_degree: int = 1,
    batch_mesh: DeviceMesh | None = None,
    repeat: bool = True,
    key: str = "training.dataset_path",
    index_cache: Path | None = None,
    corpus: Corpus | None = None,
) -> DataLoader:
    """The loader the `[training]` section describes; `global_batch_size = -1` means
    `local_batch_size * dp_degree` (no gradient accumulation). `repeat` as in `DataLoader`;
    `corpus` the one `build_corpus(training, key=key, index_cache=index_cache)` gives, when it
    was built before (under a process group: building one is collective)."""
    global_batch_size = training.global_batch_size
    if global_batch_size == -1:
        global_batch_size = training.local_batch_size * dp_degree
    corpus = corpus or build_corpus(training, key=key, index_cache=index_cache)
    return DataLoader(
        corpus.documents,
        tokenizer,
        seq_len=training.seq_len,
        global_batch_size=global_batch_size,
        local_batch_size=training.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        batch_mesh=batch_mesh,
        add_bos=training.add_bos,
        repeat=repeat,
        source=corpus.sources,
        mix=corpus.mix,
        source_names=corpus.names,
    )


def _source(training: Training, key: str) -> tuple[str, str]:
    """The setting that names the documents of `training` and its value: the dataset's path
    (`key`), or the dataset itself where it has none (python_docs, the c4 of the hub)."""
    if training.dataset_path:
        return key, training.dataset_path
    return key.replace("dataset_path", "dataset"), training.dataset
