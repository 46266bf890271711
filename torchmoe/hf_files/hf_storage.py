"""Hugging Face safetensors in and out through DCP: every rank reads and writes only its shards.

    state = get_model_state_dict(model)               # sharded DTensors (or plain tensors)
    fix = "pass a Hugging Face Llama 4 folder"         # key and fix: for the ConfigError of a bad folder
    args = read_hf_args(hf_dir, key="HF_DIR", fix=fix)             # from its config.json
    load_hf_weights(state, hf_dir, args, key="HF_DIR", fix=fix)    # in place, collective
    save_hf_weights(state, args, "outputs/hf")         # config.json + HF shards, collective

torch's `HuggingFaceStorageReader` reads the slices of each safetensors tensor that a rank's
local shards cover, and `HuggingFaceStorageWriter` writes each rank's shards to files of its
own, which every rank then helps consolidate into Hugging Face's layout
(`_torch_private.consolidate_safetensors`). No rank ever holds more than its shards.

What torch does not know is each family's name and layout mapping (`models/registry.py`,
`models.hf_slices`): Llama 4 stores its routed experts transposed, w1 / w3 as the two halves of
one fused ``gate_up_proj``; Qwen3-MoE stores one tensor per expert. The planners below present
each of our tensors to DCP in Hugging Face orientation (a view of the tensor, so loading writes
straight into the parameters) and move its chunks to their place in the stored tensor (w3's half
starts at column `hidden`), or split them into one chunk per expert's tensor. A rank whose w1
and w3 shards are both column slices of one ``gate_up_proj`` (MoE tensor parallelism) writes
them to two files, since one safetensors file holds one entry per name.

Without a process group everything runs in this process (`no_dist`), with the same code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import shutil
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.futures import Future

# checkpoint's import also silences DCP's warning on every single-process call.
from torchmoe import _torch_private as private
from torchmoe.arch.model_args import ModelArgs
from torchmoe.checkpoints.checkpoint_state import dist_on as _dist_on
from torchmoe.config.errors import ConfigError
from torchmoe.config.files.file_kinds import check_regular, is_plain_name
from torchmoe.config.files.file_writes import write_file
from torchmoe.config.wording import counted
from torchmoe.distributed.one_reader import one_reads
from torchmoe.distributed.process_groups import device_backend
from torchmoe.hf_files import mxfp4
from torchmoe.models.decoder.model import Transformer
from torchmoe.models.hf_config_spec import HFConfigValueError, HFConversionError, show_json
from torchmoe.models.hf_slices import HFSlice
from torchmoe.models.registry import hf_mapping, hf_mapping_for_config, hf_slices
from torchmoe.nn.shards import local_shard
from torchmoe.weights.dcp_unpickling import KnownMetadata, SafeLoadPlanner
from torchmoe.weights.finite import refuse_bad_values, require_finite
from torchmoe.weights.weight_files import UnreadableWeights, read_json_object, reading

__all__ = ["DEFAULT_SHARD_BYTES", "ExpertBiasDrop", "dropped_bias_max", "holds_expert_bias", "load_hf_weights",
           "read_hf_args", "require_hf_form", "save_hf_weights"]

DEFAULT_SHARD_BYTES = 5 * 1024**3
# Each rank's own files while a save is in progress; removed once consolidated.
_SHARDS_DIR = ".rank-shards"


def _hf_views(state: Mapping[str, torch.Tensor], args: ModelArgs) -> tuple[dict[str, torch.Tensor],
                                                                          dict[str, HFSlice]]:
    """Our entries that Hugging Face stores, as views in its orientation, and their slices."""
    slices = hf_slices(state, args)
    return {name: s.view(state[name]) for name, s in slices.items()}, slices


def _full_model_slices(args: ModelArgs) -> list[HFSlice]:
    """The slices of a whole model of `args` (all stages, whatever this rank holds), in order."""
    with torch.device("meta"):
        model = Transformer(args)
    return list(hf_slices(model.state_dict(), args).values())


# ---- loading ---------------------------------------------------------------------------------


class _HFLoadPlanner(SafeLoadPlanner):
    """Reads each of our tensors (a view in HF orientation) from its slice of the stored tensor.

    DCP plans against a virtual metadata in which every one of our tensors is stored whole
    under its own name; each read item is then pointed at the stored tensor, its offsets
    moved by the slice's offset, or split into one item per expert of a per-expert slice (its
    destination is then expert e's matrix of our tensor: `transform_tensor`).

    Args:
        slices: ours -> where it is stored.
        stored: HF name -> the name it has in the files (multimodal checkpoints prefix it).
    """

    def __init__(self, slices: dict[str, HFSlice], stored: dict[str, str]) -> None:
        super().__init__(allow_partial_load=False)
        self.slices = slices
        self.stored = stored

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        virtual = {}
        for name, s in self.slices.items():
            stored_md = metadata.state_dict_metadata[self.stored[next(iter(s.stored()))]]
            size = torch.Size(state_dict[name].shape)
            virtual[name] = TensorStorageMetadata(stored_md.properties, size,
                                                  [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
        super().set_up_planner(state_dict, Metadata(virtual), is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[out for item in plan.items for out in self._to_stored(item)])

    def _to_stored(self, item: ReadItem) -> list[ReadItem]:
        s = self.slices[item.dest_index.fqn]
        offsets = list(item.storage_offsets)
        # A Hugging Face file stores each tensor whole: its one chunk starts at 0 (checked on load).
        if not s.per_expert:
            offsets[-1] += s.offset
            return [dataclasses.replace(item, storage_index=MetadataIndex(self.stored[s.hf_name], [0] * len(offsets)),
                                        storage_offsets=torch.Size(offsets))]
        # Expert e's rows of the item: its 2-D block of expert e's tensor. The lengths are the
        # block's (2-D); the destination keeps its 3-D offsets, whose first is the local expert.
        first, dest = offsets[0], list(item.dest_offsets)
        return [dataclasses.replace(item, storage_index=MetadataIndex(self.stored[s.hf_name.format(e=first + j)],
                                                                      [0, 0]),
                                    storage_offsets=torch.Size(offsets[1:]), lengths=torch.Size(item.lengths[1:]),
                                    dest_offsets=torch.Size([dest[0] + j, *dest[1:]]))
                for j in range(item.lengths[0])]

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        if len(read_item.dest_offsets) == len(read_item.lengths) + 1:  # one expert's block (`_to_stored`)
            one = dataclasses.replace(read_item, dest_offsets=torch.Size(read_item.dest_offsets[1:]))
            return super().transform_tensor(one, tensor[read_item.dest_offsets[0]])
        return super().transform_tensor(read_item, tensor)


def _stored_names(metadata: Metadata, slices: dict[str, HFSlice],
                  args: ModelArgs) -> tuple[dict[str, str], set[str]]:
    """(HF name -> stored name for every tensor `slices` needs, the HF names stored MXFP4-packed),
    after checking the checkpoint holds exactly a model of `args` (vision tensors and a tied
    model's head aside), in floating point or as MXFP4 blocks and scales (`hf_files.mxfp4`).

    Raises:
        HFConversionError: a tensor is missing, unexpected, split over files, of another shape, or
            stored as integers (other than MXFP4's).
    """
    entries = metadata.state_dict_metadata
    mapping = hf_mapping(args)
    stored = {text: key for key in entries if (text := mapping.text_tensor_name(key, args)) is not None}
    expected = {name for s in _full_model_slices(args) for name in s.stored()}
    packed = {name for name in expected - set(stored) if all(p in stored for p in mxfp4.packed_names(name))}
    missing = sorted(expected - set(stored) - packed)
    if missing:
        raise HFConversionError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    packed_parts = {p for name in packed for p in mxfp4.packed_names(name)}
    extra = sorted(set(stored) - expected - packed_parts - ({"lm_head.weight"} if args.tie_word_embeddings else set()))
    if extra:
        raise HFConversionError(f"the checkpoint holds {len(extra)} tensors this model has no place for, "
                                f"e.g. {extra[:3]}")
    for name, size in ((name, size) for s in slices.values() for name, size in s.stored().items()):
        parts = mxfp4.packed_names(name) if name in packed else (name,)
        for part in parts:
            if len(entries[stored[part]].chunks) != 1:
                raise HFConversionError(f"{part} is split over {len(entries[stored[part]].chunks)} files: not a "
                                        "Hugging Face checkpoint (a sharded DCP export must be consolidated first)")
        if name in packed:
            mxfp4.check_packed(name, size, *((tuple(entries[stored[p]].size), entries[stored[p]].properties.dtype)
                                             for p in parts))
            continue
        md = entries[stored[name]]
        if tuple(md.size) != size:
            raise HFConversionError(f"{name} has shape {tuple(md.size)}, expected {size}")
        if not md.properties.dtype.is_floating_point:  # a cast would load nonsense (quantized weights?)
            raise HFConversionError(f"{name} is stored as {str(md.properties.dtype).removeprefix('torch.')}, "
                                    "not as floating-point weights (nor as MXFP4 blocks and scales)")
    return stored, packed


def _stored_files(metadata: Metadata, names: set[str]) -> dict[str, Path]:
    """The file of each stored name in `names` (as the files' headers, read into `metadata`, say)."""
    return {index.fqn: Path(info.relative_path) for index, info in metadata.storage_data.items() if index.fqn in names}


class _KnownHFReader(KnownMetadata, HuggingFaceStorageReader):
    """torch's `HuggingFaceStorageReader`, handed the metadata rank 0 read from every file's header."""


def _read_hf_metadata(hf_dir: Path, key: str, fix: str) -> Metadata:
    """The DCP metadata of the Hugging Face folder `hf_dir` (every safetensors file's header),
    each file checked first (`_check_files`).

    Raises:
        UnreadableWeights: a file is missing, a folder, unreadable or damaged.
    """
    _check_files(hf_dir, key, fix)
    with reading(key, hf_dir, fix, what="a *.safetensors file"):
        return HuggingFaceStorageReader(str(hf_dir)).read_metadata()


_INDEX = "model.safetensors.index.json"


def _check_files(hf_dir: Path, key: str, fix: str) -> None:
    """Every safetensors file of `hf_dir` is a file with a readable header, and every file that
    model.safetensors.index.json lists is there: each fault named with its file.

    Raises:
        UnreadableWeights: a file is missing, a folder, unreadable or damaged.
    """
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UnreadableWeights(key, str(hf_dir), "holds no *.safetensors files", fix)
    for file in files:
        with reading(key, hf_dir, fix, what=file.name):
            if file.is_dir():  # safetensors would report only "No such device"
                raise IsADirectoryError(21, "Is a directory", str(file))
            check_regular(file)  # not a named pipe, whose open below would hang (a link: the hub's cache)
            with safe_open(file, framework="pt"):  # parses (and checks) the header, reads no data
                pass
    if (hf_dir / _INDEX).exists():
        weight_map = read_json_object(key, hf_dir, _INDEX, fix).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnreadableWeights(key, str(hf_dir), f"{_INDEX} has no \"weight_map\" object", fix)
        outside = sorted({str(f) for f in weight_map.values() if not is_plain_name(str(f))})
        if outside:  # transformers writes plain names: the loader reads only the folder's own files
            raise UnreadableWeights(key, str(hf_dir), f"{_INDEX} lists files outside the folder, e.g. "
                                    f"{outside[:3]}: it was altered or crafted", fix)
        absent = sorted({f for f in weight_map.values() if not (hf_dir / str(f)).is_file()})
        if absent:
            verb = "is" if len(absent) == 1 else "are"
            raise UnreadableWeights(key, str(hf_dir), f"{_INDEX} lists {counted(len(absent), 'file')} that {verb} not "
                                    f"there, e.g. {absent[:3]}: an incomplete download?", fix)


def require_hf_form(key: str, value: object, args: ModelArgs, flavor: str, fix: str) -> None:
    """Before anything is trained or written: the family's Hugging Face model can express `args`
    (flavor `flavor`), which the setting `key` = `value` would write as a Hugging Face folder.

    Raises:
        ConfigError: it cannot (DeepSeek-V3's softmax-scored flavors: its Hugging Face router is
            sigmoid-only), naming the flavor and why.
    """
    try:
        hf_mapping(args).hf_config_from_args(args, torch.float32)
    except HFConversionError as err:
        raise ConfigError(key, value, f"the {flavor} flavor has no Hugging Face form: {err}", fix) from None


def read_hf_args(hf_dir: str | os.PathLike, *, key: str, fix: str) -> ModelArgs:
    """The `ModelArgs` of the config.json of the Hugging Face folder `hf_dir` (the value of `key`).

    Raises:
        ConfigError: config.json is missing, unreadable, not a JSON object, holds a value of the
            wrong type or range (`check_hf_config`: the fix names the field and what it must
            be), or is not a config of a family torchmoe trains that this model can represent
            (the family is config.json's ``model_type``: `models.registry`).
    """
    hf_dir = Path(hf_dir)
    config = read_json_object(key, hf_dir, "config.json", fix)
    try:
        args = hf_mapping_for_config(config).args_from_hf_config(config)
    except HFConfigValueError as err:  # a value to correct: the fix says to what
        raise ConfigError(key, str(hf_dir), f"its config.json sets \"{err.field}\": {show_json(err.value)}, "
                          f"{err.problem}", f"set \"{err.field}\" in {hf_dir / 'config.json'} to {err.expected}") from None
    except HFConversionError as err:
        raise ConfigError(key, str(hf_dir), f"its config.json cannot be used: {err}", fix) from None
    return args.replace(mtp_layers=_stored_mtp_layers(hf_dir, args, key, fix)) if args.mtp_layers else args


def _stored_mtp_layers(hf_dir: Path, args: ModelArgs, key: str, fix: str) -> int:
    """How many of the multi-token prediction layers config.json announces the files hold (each
    one's input projection stored): transformers writes ``num_nextn_predict_layers = 1`` into
    checkpoints of its causal LM, which has no place for them."""
    with reading(key, hf_dir, fix, what="a *.safetensors file"):
        if (hf_dir / _INDEX).exists():
            names = set(read_json_object(key, hf_dir, _INDEX, fix).get("weight_map") or {})
        else:
            names = set()
            for file in sorted(hf_dir.glob("*.safetensors")):
                with safe_open(file, framework="pt") as f:
                    names.update(f.keys())
    mapping, held = hf_mapping(args), 0
    for i in args.mtp_layer_ids:
        if mapping.hf_slice(f"mtp.{i}.eh_proj.weight", (args.dim, 2 * args.dim)).hf_name not in names:
            break
        held += 1
    return held


def load_hf_weights(state: Mapping[str, torch.Tensor], hf_dir: str | os.PathLike, args: ModelArgs, *,
                    key: str, fix: str) -> None:
    """Copy the weights of a Hugging Face folder of the family of `args` into the tensors of
    `state` in place, each rank reading only the slices its (DTensor) shards cover, cast to their
    dtype. Collective under a process group. Router buffers are left as they are.

    Args:
        state: our model state dict on this rank (e.g. `get_model_state_dict(model)`: sharded
            DTensors sharing the parameters' storage; under PP only this rank's stages).
        hf_dir: a checkpoint of the family (``*.safetensors``; Llama 4's text or multimodal).
        args: the whole model's architecture (to check the checkpoint holds all of it).
        key, fix: how the user named `hf_dir` (``HF_DIR``, ``checkpoint.initial_load_path``) and
            what to do about a folder that does not load, for the `ConfigError`.

    Raises:
        ConfigError: a file is missing, unreadable or damaged, the checkpoint is not a model of
            `args` in floating point, or its weights hold NaN, inf or values beyond
            `finite.WEIGHT_BOUND` (named as the files name them).
    """
    hf_dir = Path(hf_dir)
    # Rank 0 reads every file's header, once: on a shared file system each rank opening every
    # file of the folder (three times: checked, then read by this function and by DCP) is a storm.
    metadata = one_reads(lambda: _read_hf_metadata(hf_dir, key, fix))
    with reading(key, hf_dir, fix, what="a *.safetensors file"):  # HFConversionError is a fault too
        reader = _KnownHFReader(hf_dir, metadata)
        views, slices = _hf_views(state, args)
        stored, packed = _stored_names(metadata, slices, args)
        # MXFP4-packed tensors (gpt-oss's released experts) are read and dequantised by this rank
        # itself (`hf_files.mxfp4`); DCP reads every other tensor.
        unpacked = {name: s for name, s in slices.items() if s.hf_name not in packed}
        dcp.load({name: views[name] for name in unpacked}, storage_reader=reader,
                 planner=_HFLoadPlanner(unpacked, stored), no_dist=not _dist_on())
        if packed:
            files = _stored_files(metadata, {stored[p] for name in packed for p in mxfp4.packed_names(name)})
            for name, s in slices.items():
                if s.hf_name in packed:
                    mxfp4.load_packed(views[name], [(files[stored[p]], stored[p])
                                                    for p in mxfp4.packed_names(s.hf_name)])
    refuse_bad_values(views, key=key, path=hf_dir, names={
        name: f"{s.label()} (MXFP4 blocks and scales)" if s.hf_name in packed else stored.get(s.hf_name, s.label())
        for name, s in slices.items()})


# ---- saving ----------------------------------------------------------------------------------


class _HFSavePlanner(DefaultSavePlanner):
    """Writes each of our tensors (a view in HF orientation) as chunks of its stored tensor:
    every write item is renamed to the HF name with its offsets moved by the slice's offset, or
    split into one item per expert of a per-expert slice. The entries named in `copies` are
    written from copies of their tensors (safetensors refuses two names over one memory)."""

    def __init__(self, slices: dict[str, HFSlice], copies: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.slices, self.copies = slices, copies
        # (stored name, offsets) -> our item, and the expert of its chunk (None: the whole chunk).
        self._ours: dict[tuple[str, tuple[int, ...]], tuple[MetadataIndex, int | None]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[out for item in plan.items for out in self._to_stored(item)])
        return self.plan

    def _to_stored(self, item: WriteItem) -> list[WriteItem]:
        s = self.slices[item.index.fqn]
        chunk = item.tensor_data.chunk
        offsets = list(chunk.offsets)
        if s.per_expert:  # expert e's rows of the chunk: a 2-D chunk of expert e's tensor
            pieces = [(s.hf_name.format(e=offsets[0] + j), offsets[1:], chunk.sizes[1:], s.size[1:], j)
                      for j in range(chunk.sizes[0])]
        else:
            offsets[-1] += s.offset
            pieces = [(s.hf_name, offsets, chunk.sizes, s.size, None)]
        items = []
        for name, at, sizes, size, expert in pieces:
            self._ours[(name, tuple(at))] = (item.index, expert)
            data = TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(at), torch.Size(sizes)),
                                   properties=item.tensor_data.properties, size=torch.Size(size))
            # SHARD: a stored tensor may receive several chunks (w1's and w3's) from one rank.
            items.append(WriteItem(index=MetadataIndex(name, at), type=WriteItemType.SHARD, tensor_data=data))
        return items

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        ours, expert = self._ours[(write_item.index.fqn, tuple(write_item.index.offset))]
        data = super().resolve_data(dataclasses.replace(write_item, index=ours))
        if ours.fqn in self.copies:
            return data.clone()
        # The views of transposed experts are strided; safetensors writes contiguous memory.
        return (data if expert is None else data[expert]).contiguous()


class _RankShardWriter(HuggingFaceStorageWriter):
    """torch's distributed HF writer, except that a rank's second chunk of one tensor goes to a
    file of its own (one safetensors file holds one entry per name; DCP's file naming would
    put both in one file and keep only the last)."""

    def write_data(self, plan: SavePlan, planner: _HFSavePlanner) -> Future:
        if not plan.items:
            return super().write_data(plan, planner)
        file_index = plan.storage_data["fqn_to_index_mapping"]
        shard = plan.storage_data["shard_index"]
        n_files = max(file_index.values())
        files: dict[tuple[int, int], list[WriteItem]] = {}
        copies: Counter[str] = Counter()
        for item in plan.items:
            files.setdefault((file_index[item.index.fqn], copies[item.index.fqn]), []).append(item)
            copies[item.index.fqn] += 1
        file_queue: queue.Queue = queue.Queue()
        for (index, copy), items in files.items():
            name = f"shard-{shard:05d}-{copy}-model-{index:05d}-of-{n_files:05d}.safetensors"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return private.hf_writer_write_files(self, planner, file_queue)


def _file_index(dtype: torch.dtype, max_shard_bytes: int, args: ModelArgs) -> dict[str, int]:
    """HF name -> output file (1-based): the whole model's tensors in order, a new file whenever
    the current one would exceed `max_shard_bytes`. The same on every rank, whatever it holds."""
    index: dict[str, int] = {}
    file, used = 1, 0
    slices = [*_full_model_slices(args), *(copy for _, copy in hf_mapping(args).hf_copies(args))]
    for name, shape in ((name, shape) for s in slices for name, shape in s.stored().items()):
        if name in index:  # w3's half of a fused tensor, after w1's
            continue
        size = math.prod(shape) * dtype.itemsize
        if used and used + size > max_shard_bytes:
            file, used = file + 1, 0
        index[name] = file
        used += size
    return index


@dataclasses.dataclass(frozen=True)
class ExpertBiasDrop:
    """Whether a Hugging Face export may leave out a non-zero aux-loss-free expert bias, which the
    Hugging Face models of Llama 4, Qwen3-MoE and gpt-oss have no place for (the folder then selects
    other experts than the model trained, so its loss differs), and the setting that decides it.

    Attributes:
        allowed: the user asked for that lossy export by name.
        key: the setting that asks for it (``checkpoint.hf_drop_expert_bias``, ``--drop-expert-bias``,
            `torchmoe.hf.save_model`'s ``drop_expert_bias``).
        fix: what a refusal suggests: asking for it, or keeping a model without the bias.
    """

    allowed: bool = False
    key: str = "drop_expert_bias"
    fix: str = ("pass drop_expert_bias=True to write the model without its expert bias (it then selects other "
                "experts), or train with model.load_balance_coeff = 0")


def holds_expert_bias(args: ModelArgs) -> bool:
    """The family's Hugging Face model has a place for the expert bias (DeepSeek-V3's
    ``e_score_correction_bias``), or the model has no MoE layer to hold one."""
    layer = min(args.moe_layer_ids, default=None)
    if layer is None:
        return True
    return hf_mapping(args).hf_slice(f"layers.{layer}.moe.expert_bias", (args.num_experts,)) is not None


def dropped_bias_max(state: Mapping[str, torch.Tensor], args: ModelArgs, group: dist.ProcessGroup | None) -> float:
    """The largest |expert_bias| of `state` that a Hugging Face folder of the family of `args`
    would leave out (0 when it holds the bias, or the bias is zero); collective under a process
    group: every rank gets the whole model's value."""
    mapping = hf_mapping(args)
    dropped = {name: t for name, t in state.items()
               if name.endswith("expert_bias") and mapping.hf_slice(name, t.shape) is None}
    return _max_abs_expert_bias(dropped, group)


def _max_abs_expert_bias(state: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None) -> float:
    """The largest |expert_bias| over the whole model (the biases of all ranks' stages)."""
    # Local shards: the all-reduce over every rank covers what each holds (DTensor shards or stages).
    maxima = [local.abs().max().float().cpu() for name, t in state.items() if name.endswith("expert_bias")
              if (local := local_shard(t)).numel()]
    local = torch.stack(maxima).max() if maxima else torch.zeros(())
    if _dist_on():
        # A host tensor where the group's backend carries them (gloo), else on the current GPU (NCCL).
        if not device_backend("cpu", group):
            local = local.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return float(local)


def save_hf_weights(state: Mapping[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike, *,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, process_group: dist.ProcessGroup | None = None,
                    bias_drop: ExpertBiasDrop = ExpertBiasDrop()) -> None:
    """Write `state` as a Hugging Face folder of the family of `args` (``Llama4ForCausalLM``,
    ``Qwen3MoeForCausalLM``: `models.registry`): config.json,
    ``model-0000i-of-0000n.safetensors`` files of at most `max_shard_bytes` and
    model.safetensors.index.json. Each rank writes only its shards, then consolidates some of
    the output files. Collective under a process group; parameters keep their dtype.

    The folder is the model `state` holds, or nothing is written: a non-zero aux-loss-free
    expert bias that the family's Hugging Face model has no place for (Llama 4, Qwen3-MoE,
    gpt-oss; the folder would select other experts) is refused unless `bias_drop` allows leaving
    it out, which then warns.

    Args:
        state: our model state dict on this rank (sharded DTensors or plain tensors).
        args: the model's architecture (config.json, and the file split of the whole model).
        process_group: for the collectives (the default group when None); a training run passes
            its checkpoint group, whose timeout waits for the slowest rank's write.
        bias_drop: whether the caller's user asked for the export without such a bias, by which setting.

    Raises:
        NonFiniteValues: (on every rank, before anything is written) a tensor holds NaN or inf.
        ConfigError: (on every rank, before anything is written) naming `bias_drop.key`: the
            bias is non-zero, has no place there, and `bias_drop` does not allow leaving it out.
    """
    out_dir = Path(out_dir)
    shards = out_dir / _SHARDS_DIR
    rank = dist.get_rank() if _dist_on() else 0
    require_finite(state, group=process_group)
    mapping = hf_mapping(args)
    bias_max = dropped_bias_max(state, args, process_group)
    if bias_max > 0 and not bias_drop.allowed:
        raise ConfigError(bias_drop.key, False, f"the model's expert_bias (max |bias| {bias_max:.3g}) has no place in "
                          f"Hugging Face {mapping.title}: the folder would select other experts than the model "
                          "does, and its loss would differ", bias_drop.fix)
    if bias_max > 0 and rank == 0:
        warnings.warn(f"expert_bias (max |bias| {bias_max:.3g}) is not representable in Hugging Face "
                      f"{mapping.title} and is dropped ({bias_drop.key}): expert selection there ignores it",
                      stacklevel=2)
    views, slices = _hf_views(state, args)
    copies = {f"{ours} as {copy.hf_name}": (ours, copy) for ours, copy in mapping.hf_copies(args) if ours in state}
    for key, (ours, copy) in copies.items():  # the family's second places of a tensor
        views[key], slices[key] = copy.view(state[ours]), copy
    dtype = next(iter(views.values())).dtype  # every parameter has the same (every pp stage has some)
    index = _file_index(dtype, max_shard_bytes, args)
    writer = _RankShardWriter(str(shards), fqn_to_index_mapping=index, save_distributed=True)
    dcp.save(views, storage_writer=writer, planner=_HFSavePlanner(slices, frozenset(copies)),
             process_group=process_group,
             no_dist=not _dist_on())
    # Each rank writes some of the output files.
    private.consolidate_safetensors(str(shards), str(out_dir), index, every_rank=_dist_on(), process_group=process_group)
    if rank == 0:
        shutil.rmtree(shards)
        if max(index.values()) == 1:  # Hugging Face's name for a single file, which needs no index
            os.replace(out_dir / "model-00001-of-00001.safetensors", out_dir / "model.safetensors")
            (out_dir / "model.safetensors.index.json").unlink()
        config = mapping.hf_config_from_args(args, dtype)
        write_file(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    if _dist_on():
        dist.barrier(group=process_group)

