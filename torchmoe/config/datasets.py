"""The dataset kinds a job trains on (`training.dataset`, or each source of `training.dataset_mix`),
and the default of `training.document_masking` they decide.

    python -c "from torchmoe.config import load_job_config as j; \\
        print(j(['--training.dataset', 'chat', '--training.dataset_path', 'c.jsonl']).training.document_masking)"

A kind whose rows are separate examples (chat conversations; preference pairs when they come)
packs several into a batch row, and one must not attend to another: such data masks documents by
default. Text for pretraining keeps torchtitan's default (off): its documents are cut to rows
anyway. The default depends on another key, so the loader resolves it once the file and the
flags are read (`loader.load_job_config`): `--help`, the dry run, the planner and the run's
`config.toml` all see the value the run uses, and a key set in the file or by a flag (torchtitan's
``attn_mask_type`` included) is left as it is. A run that trains on examples without masking says
so in its opening lines (`unmasked_examples_note`).
"""

from __future__ import annotations

from torchmoe.config.job_config import Training

__all__ = ["DEPENDENT_DEFAULTS", "EXAMPLE_DATASETS", "default_document_masking", "example_kinds", "split_mix_entry",
           "unmasked_examples_note"]

# Dataset kinds whose rows are separate examples, packed whole (`data.chat.chat`). A preference kind
# joins them when it is added.
EXAMPLE_DATASETS = ("chat",)
# The keys whose default depends on another key, and how (docs/config.md's default column).
DEPENDENT_DEFAULTS = {"training.document_masking": f"true for {' and '.join(EXAMPLE_DATASETS)} data"}


def split_mix_entry(entry: str, index: int) -> tuple[str, str, str, str]:
    """(name, weight text, dataset kind, path) of entry `index` of `training.dataset_mix`, written
    ``[NAME=]WEIGHT:DATASET[:PATH]`` (the path is everything after the second colon, so hub specs
    such as ``allenai/c4:en`` keep theirs); the name ``source<index>`` when none is given. The
    parts are not checked (`data.mixture.parse_mix` does)."""
    name, eq, rest = entry.partition("=")
    if not eq or ":" in name:  # no name given (a path may hold "=")
        name, rest = f"source{index}", entry
    weight, _, spec = rest.partition(":")
    dataset, _, path = spec.partition(":")
    return name, weight, dataset, path


def example_kinds(training: Training) -> list[str]:
    """The kinds among the training data's (`training.dataset`, or every mixture source's) whose
    rows are separate examples, each once, in order."""
    kinds = [split_mix_entry(entry, i)[2] for i, entry in enumerate(training.dataset_mix)] \
        if training.dataset_mix else [training.dataset]
    return [kind for kind in dict.fromkeys(kinds) if kind in EXAMPLE_DATASETS]


def default_document_masking(training: Training) -> bool:
    """`training.document_masking` when neither the job file nor a flag sets it: on for data of
    separate examples, off otherwise."""
    return bool(example_kinds(training))


def unmasked_examples_note(training: Training) -> str | None:
    """The opening line of a run that packs separate examples without document masking (a choice
    made by setting the key false), or None."""
    kinds = example_kinds(training)
    if training.document_masking or not kinds:
        return None
    return (f"training.document_masking = false: every {' and '.join(kinds)} example attends to the examples "
            "packed before it in its batch row (the default for such data is true: each attends to itself only)")
