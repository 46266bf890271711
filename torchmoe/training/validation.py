"""The validation loss: the model as it is over the `[validation]` batches, without gradients."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig
from torchmoe.data.dataloader import DataLoader, build_corpus, build_dataloader, validation_data
from torchmoe.data.errors import CorpusEnd
from torchmoe.data.micro_batches import IGNORE
from torchmoe.distributed.mesh import ParallelMesh
from torchmoe.training.objective import Objective, loss_weight
from torchmoe.training.placement import PlaceColumns


class ValidationLoss(NamedTuple):
    """The validation loss (`Validation.loss`) and what its mean covers."""

    loss: float
    batches: int
    targets: int
    """The tokens the mean is over (every token of text data; chat data's targets), all ranks'."""
    documents: int | None
    """The documents holding them (chat data's conversations), all ranks'; None for text data,
    whose documents are not told apart."""


class Validation:
    """The validation data of a run, opened at the start, and its loss (`loss`).

    With `validation.enable` the data is opened now, under the start's timeout: a new corpus's
    index is built (by rank 0) before the first validation, whose collectives run under the
    training's. Without it (`torchmoe eval`), each `loss` opens it.

    Args:
        cfg: the job (`[validation]`, and `[training]` whose data settings validation shares).
        tokenizer: the run's tokenizer.
        dp_rank, dp_degree, batch_mesh: this rank's rows of each batch (as training's).
        index_cache: where the data files' indexes are kept.
    """

    def __init__(self, cfg: JobConfig, tokenizer, *, dp_rank: int, dp_degree: int, batch_mesh, index_cache: Path
                 ) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.dp_rank, self.dp_degree, self.batch_mesh = dp_rank, dp_degree, batch_mesh
        self.corpus = None
        if cfg.validation.enable:
            self.corpus = build_corpus(validation_data(cfg.training, cfg.validation), key="validation.dataset_path",
                                       index_cache=index_cache)
            self.loader()

    def loader(self) -> DataLoader:
        """A loader of the validation data from its start (one pass), over the corpus opened at the
        start if it was."""
        return build_dataloader(validation_data(self.cfg.training, self.cfg.validation), self.tokenizer,
                                dp_rank=self.dp_rank, dp_degree=self.dp_degree, batch_mesh=self.batch_mesh,
                                repeat=False, corpus=self.corpus)

    @torch.no_grad()
    def loss(self, model: nn.Module, moe_layers: list[nn.Module], columns: PlaceColumns, objective: Objective,
             mesh: ParallelMesh | None, device: torch.device) -> ValidationLoss:
        """The mean token loss of `model` as it is over the validation batches, and what it covers:
        `steps` batches, or with -1 every complete batch of one pass over the data, the same
        batches each time. Runs the training layout's forward (each micro-batch placed by
        `columns`, its loss `objective.summed`) in eval mode, without gradients; the routed-token
        counts of `moe_layers` that the next bias update reads are left as they were.

        Every rank draws its rows of each batch; they agree before each forward whether one ran
        out of data (one flag in an all-reduce), so all stop at the same batch. The mean is over
        the batches' targets (labels not ignored: all of them but with chat data), counted on the
        host with each micro-batch over whole rows and summed over the data-parallel ranks, as
        are the documents holding them (`targeted_documents`).

        Raises:
            ConfigError: less than one batch of data, or batches without a target (chat data
                whose assistant turns the rows read cut off or lack): a mean over no token.
        """
        val = self.cfg.validation
        loader = self.loader()
        counts = [moe.tokens_per_expert.clone() for moe in moe_layers]
        # In eval mode: LoRA's dropout off (it drew masks, and consumed the training's RNG), and
        # nothing observed for QK-Clip; back in the mode it was in afterwards.
        was_training = model.training
        model.train(False)
        weight = loss_weight(mesh)
        total = torch.zeros((), device=device)
        batches, targets, documents, told = 0, 0, 0, False
        while val.steps == -1 or batches < val.steps:
            try:
                micro_batches, ended = loader.next_batch(), 0.0
            except CorpusEnd:
                micro_batches, ended = [], 1.0
            flag = torch.tensor(ended, device=device)
            if mesh is not None:
                dist.all_reduce(flag)
            if flag.item():
                break
            for batch in micro_batches:
                targets += batch.supervised
                if batch.starts is not None:
                    documents += targeted_documents(batch[1], batch.starts)
                    told = True
                inputs, labels, segments, real = columns(*batch, batch.starts, batch.real)
                with loss_parallel() if objective.tp_mesh is not None else nullcontext():
                    loss = objective.summed(model(inputs, segments, real=real), labels)
                total += weight * (loss.full_tensor() if isinstance(loss, DTensor) else loss)
            batches += 1
        model.train(was_training)
        for moe, saved in zip(moe_layers, counts):
            moe.tokens_per_expert.copy_(saved)
        count = torch.tensor([targets, documents], dtype=torch.int64, device=device)
        if mesh is not None:
            dist.all_reduce(total)
            dist.all_reduce(count, group=mesh["batch"].get_group())
        if not batches:
            raise ConfigError("validation.dataset", val.dataset, "holds less than one batch "
                              f"({loader.global_batch_size} rows of {val.seq_len + 1} tokens)",
                              "use more validation data, or a smaller validation.local_batch_size / seq_len")
        targets, documents = count.tolist()
        if not targets:  # a mean over no token: not a loss of 0 (a perplexity of 1)
            raise ConfigError("validation.dataset_path", val.dataset_path, f"its {batches} batch(es) evaluated hold no "
                              "target token (chat conversations whose assistant turns are cut off or missing in the "
                              "rows read), so they have no mean loss",
                              "evaluate more batches (validation.steps -1: one whole pass; eval --batches -1), a "
                              "longer validation.seq_len, or conversations with assistant turns")
        return ValidationLoss(total.item() / targets, batches, targets, documents if told else None)


def targeted_documents(labels: torch.Tensor, starts: torch.Tensor) -> int:
    """How many documents of a micro-batch hold a target: labels and starts (B, S) int64 on the
    host, a document being a row's positions of one start (`MicroBatch.starts`; a chat row's
    conversations are whole in it)."""
    rows, cols = (labels != IGNORE).nonzero(as_tuple=True)
    return int(torch.unique(rows * labels.shape[1] + starts[rows, cols]).numel())
