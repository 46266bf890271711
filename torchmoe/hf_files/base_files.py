"""What a Hugging Face export keeps of the folder its run started from, so that it loads and
serves as that folder did: every field of its config.json that training did not change (the
special token ids, `router_aux_loss_coef`, a release's own fields), its generation_config.json
(the end-of-turn ids `generate` stops at, sampling defaults), and files the run saved beside
its base (`BASE_FILES`).

    keep_base_files(out_dir, base)   # after the weights and their config.json are written

The export's config.json is the base's with the fields torchmoe writes for the model on top
(`models/<family>/hf.py`'s `hf_config_from_args`: the architecture, which is the base's, and the
dtype written), less what no longer holds: a quantization the written weights do not have
(gpt-oss's MXFP4 release), and the older spelling of the dtype (transformers 4's `torch_dtype`,
which readers of that version take for the weights' dtype) given the dtype written. A Llama 4
base of the multimodal model contributes its text model's fields. A run from random weights or a
DCP folder has no base: its export is torchmoe's config.json alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchmoe.config.files.file_writes import write_file
from torchmoe.weights.weight_files import read_json_object

__all__ = ["BASE_FILES", "keep_base_files", "merged_config"]

BASE_FILES = ("config.json", "generation_config.json")
"""A Hugging Face folder's files beside its weights that describe the model (not the tokenizer's:
`tokenizer_files.TOKENIZER_FILES`)."""

# A base's older spelling of a field the export writes anew -> that field: given its value.
_RESPELLED = {"torch_dtype": "dtype"}
# Fields of a base that describe its files, not the model: the written weights are not quantized.
_DROPPED = ("quantization_config",)
# A multimodal wrapper's fields its text model's generation needs (Llama 4's nest the rest).
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def merged_config(base: dict, written: dict) -> dict:
    """`written` (torchmoe's config.json of the exported model) on top of the base's fields (those
    of its text model, for a multimodal wrapper of another model_type)."""
    text = base.get("text_config")
    if base.get("model_type") != written.get("model_type") and isinstance(text, dict):
        base = {**{k: base[k] for k in _TOKEN_IDS if k in base}, **text}
    kept = {k: written.get(_RESPELLED.get(k, k), v) for k, v in base.items() if k not in _DROPPED}
    return {**kept, **written}


def keep_base_files(out_dir: Path, base: Path | None) -> list[str]:
    """Give the export in `out_dir` the fields and files of `base` (the folder whose config.json
    the model was built from: `folder_model.base_config_folder`; None: nothing to keep):
    config.json merged (`merged_config`), generation_config.json copied as it is. Returns the
    names of the files taken from `base`. An adapter export (no config.json) keeps nothing: its
    base is the model it loads on.

    Raises:
        ConfigError: a file of `base` cannot be read (naming ``checkpoint.initial_load_path``).
        OSError: a file cannot be written.
    """
    if base is None or not (out_dir / "config.json").is_file():
        return []
    fix = "restore the Hugging Face folder the run started from"
    key = "checkpoint.initial_load_path"
    written = json.loads((out_dir / "config.json").read_text())
    merged = merged_config(read_json_object(key, base, "config.json", fix), written)
    write_file(out_dir / "config.json", json.dumps(merged, indent=2) + "\n")
    kept = ["config.json"]
    if (base / "generation_config.json").is_file():
        read_json_object(key, base, "generation_config.json", fix)  # JSON, as transformers reads it
        write_file(out_dir / "generation_config.json", (base / "generation_config.json").read_bytes())
        kept.append("generation_config.json")
    return kept
