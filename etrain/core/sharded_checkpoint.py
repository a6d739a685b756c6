"""A sharded run's state as torch DCP files: each rank writes the shards it holds and reads what it needs, so no
rank ever holds the whole model; a state saved at one layout loads at any other (DCP reshards at load).

The files sit in the step directory's `dcp/` beside `extra.pt` (schedule and scaler) and go through the
checkpoint's commit like any part (etrain/core/checkpoint.py): written first, each with its sha256 in `commit.json`,
verified before a load. DCP's `.metadata` is a pickle: it is read with an unpickler that builds exactly the classes
DCP writes there (ALLOWED), then checked to index tensors in this directory's files alone; and the planner every load
here uses refuses DCP's one read that unpickles (an entry of bytes), so no file from storage can run code.
"""

from __future__ import annotations

import pickle
import posixpath
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import Future

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from etrain.core.checkpoint import DCP, CheckpointError, file_digest, refusal
from etrain.core.storage import STORAGE_ERRORS

METADATA = ".metadata"


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tied: bool = False) -> dict:
    """What DCP saves and loads in place: weights and optimizer state by the whole model's parameter names, each
    tensor as this rank holds it (a DTensor's shard), so that any layout names every tensor alike. `tied`: the
    head is a pipeline's last-stage copy of the tied embedding, whose optimizer state is the embedding's."""
    optim = {optim_name(name, tied): optimizer.state[p] for name, p in model.named_parameters() if p in optimizer.state}
    return {"model": model.state_dict(), "optim": optim}


def optim_name(name: str, tied: bool) -> str:
    """The name a parameter's optimizer state goes by: a pipeline's last-stage copy of the tied embedding (`tied`)
    goes by the embedding's."""
    return "embed.weight" if tied and name == "head.weight" else name


def stager() -> DefaultStager:
    """Host buffers a rank's saves copy its tensors into, kept from one save to the next, so that a save blocks
    training for the copy alone, not for allocating (and first touching) as much memory as the rank's part again:
    measured on bench/sharded.py's model at shard=2, 0.18-0.21 s blocked instead of 1.0-1.2 s. The price: a copy of
    the part stays in host memory between saves. Pinned where there is a GPU (a faster copy from it). Close it when
    its group goes; one save at a time uses it."""
    pinned = torch.cuda.is_available()
    return DefaultStager(StagingOptions(pinned, False, False, False))


def save(state: dict, uri: str, group, staging: DefaultStager | None = None) -> Future:
    """Write `state` under `uri` with the ranks of `group` (one file per rank, and the metadata by its first): the
    tensors are copied to host memory (`staging`'s buffers, or new ones) before this returns, the files written in
    the background."""
    return dcp.async_save(state, storage_writer=_writer(uri), process_group=group, async_stager=staging)


def written(uri: str, group_rank: int) -> dict[str, dict]:
    """The files this rank wrote under `uri` (its `__R_*.distcp`, and the metadata on the first rank), each with its
    size and sha256 for the commit, named from the step directory (`dcp/...`)."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)
    mine = [p for p in fs.ls(root, detail=False) if posixpath.basename(p).startswith(f"__{group_rank}_")]
    if group_rank == 0:
        mine.append(posixpath.join(root, METADATA))
    return {posixpath.join(DCP, posixpath.basename(p)): file_digest(fs, p) for p in mine}


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, uri: str, tied: bool = False) -> None:
    """Take the checkpoint under `uri` into this rank's part, in place: each rank reads the slices it holds. One
    with no optimizer state (a run's first save, before its first step) leaves the optimizer as a fresh run's: no
    state, made at the next step (a rollback to it once asked for the moments the live optimizer held)."""
    reader = _reader(uri)
    saved = reader.read_metadata().state_dict_metadata
    held = _optimizer_held(saved)
    if not held:
        optimizer.state.clear()
        _load({"model": model.state_dict()}, reader)
        return
    trainable = {optim_name(name, tied) for name, p in model.named_parameters() if p.requires_grad}
    check_optimizer_state(trainable, held, uri)
    for name, p in model.named_parameters():  # AdamW's state is made lazily: room for what the checkpoint holds
        prefix = f"optim.{optim_name(name, tied)}."
        keys = {k.rsplit(".", 1)[1] for k in saved if k.startswith(prefix)}
        if keys and p not in optimizer.state:
            optimizer.state[p] = {k: _like(p, saved[prefix + k]) for k in keys}
    _load(state_dict(model, optimizer, tied), reader)


def load_weights(model: torch.nn.Module, uri: str) -> None:
    """Take the weights of the checkpoint under `uri` into this rank's part, in place (each rank reads the slices it
    holds), and none of its optimizer state: a fine-tuning run's start from a base a layout wrote."""
    _load({"model": model.state_dict()}, _reader(uri))


class SavedWeights(Mapping):
    """The model weights of the checkpoint under `uri` by name, each read when it is asked for: a base's shapes and
    digest without the whole model in memory (one tensor at a time). `keep` says which names count."""

    def __init__(self, uri: str, keep=lambda name: True):
        self._reader = _reader(uri)
        saved = self._reader.read_metadata().state_dict_metadata
        self._meta = {
            k.removeprefix("model."): m for k, m in saved.items() if k.startswith("model.") and keep(k[len("model.") :])
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        meta = self._meta[name]
        one = {f"model.{name}": torch.empty(meta.size, dtype=meta.properties.dtype)}
        _load(one, self._reader)
        return one[f"model.{name}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)

    def shapes(self) -> dict[str, torch.Size]:
        return {name: torch.Size(meta.size) for name, meta in self._meta.items()}


def whole_state(uri: str) -> dict:
    """The whole model's weights and optimizer state by name, as plain tensors: what export, a data-parallel run's
    base and a data-parallel resume take. Only these hold the whole model."""
    reader = _reader(uri)
    saved = reader.read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items() if hasattr(m, "size")}
    _load(flat, reader)
    state: dict = {"model": {}, "optim": {}}
    for key, t in flat.items():
        section, _, rest = key.partition(".")
        if section == "model":
            state["model"][rest] = t
        else:
            name, _, k = rest.rpartition(".")
            state["optim"].setdefault(name, {})[k] = t
    return state


def check_optimizer_state(trainable: set[str], held: set[str], uri: str) -> None:
    """A checkpoint with optimizer state holds it for every trainable parameter (`held`: those it has; none at all:
    a run's first save, before its first step): a part missing would start those moments afresh, and the run leave
    its trajectory unnoticed. Both loads hold to it: a layout's rank, and a whole model's worker."""
    if held and (missing := sorted(trainable - held)):
        raise CheckpointError(
            f"{uri} holds no optimizer state for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: "
            "resuming from it would start their moments afresh; move this checkpoint's step directory aside and "
            "resume from the one before it"
        )


def _optimizer_held(saved: dict) -> set[str]:
    """The parameters (by optim_name) whose optimizer state a checkpoint's metadata holds."""
    return {k.removeprefix("optim.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.")}


def _like(p: torch.Tensor, meta) -> torch.Tensor:
    """An empty tensor for a saved optimizer entry beside `p`: a moment shaped and placed as `p`, a step count a
    scalar."""
    if tuple(meta.size) == tuple(p.shape):
        return torch.zeros_like(p)
    return torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)


def _writer(uri: str):
    return FileSystemWriter(_path(uri)) if _local(uri) else FsspecWriter(uri)


def _reader(uri: str):
    return _SafeFileSystemReader(_path(uri)) if _local(uri) else _SafeFsspecReader(uri)


def _local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _path(uri: str) -> str:
    return uri.removeprefix("file://")


# Exactly the classes and values torch's DCP writes into a `.metadata` (torch 2.13), by module and name: a pickle
# from storage that names anything else, a dotted path through one of these modules included, is refused before it
# is built. BytesStorageMetadata is left out on purpose: DCP reads such an entry with torch.load(weights_only=False).
_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    (_METADATA, "Metadata"),
    (_METADATA, "TensorStorageMetadata"),
    (_METADATA, "TensorProperties"),
    (_METADATA, "ChunkStorageMetadata"),
    (_METADATA, "MetadataIndex"),
    (_METADATA, "StorageMeta"),
    (_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # the checkpoint id DCP keeps
} | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
_FILE = re.compile(r"__\d+_\d+\.distcp")  # the only files a metadata may point a read at, beside itself


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which a checkpoint's metadata never does")


def read_metadata(path: str, stream, files: set[str] | None = None) -> Metadata:
    """DCP's metadata from `stream` (the file `path`), built from ALLOWED alone and checked to describe tensors in
    this directory's `.distcp` files (`files`, when the commit says which) and nothing else; CheckpointError naming
    the file otherwise."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except Exception as e:  # a refused class, or any malformed pickle: the file is not a checkpoint's metadata
        raise CheckpointError(f"{path} is not a DCP metadata file this version reads: {e}") from None
    if why := _not_tensor_metadata(metadata, files):
        raise CheckpointError(f"{path} is not a DCP metadata file this version reads: {why}")
    return metadata


def _not_tensor_metadata(metadata, files: set[str] | None) -> str | None:
    """What makes `metadata` something other than the index of a save of tensors, or None: its classes and types,
    the files its reads point at, and each tensor no larger than the bytes stored for it (a crafted size would
    have a reader allocate it)."""
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        return f"it holds a {type(metadata).__name__}, not a Metadata"
    if not (metadata.storage_meta is None or type(metadata.storage_meta) is StorageMeta):
        return "its storage_meta is not DCP's"
    if not isinstance(metadata.storage_data, dict):
        return "its storage index is not a mapping"
    stored: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or not isinstance(index.fqn, str):
            return "its storage index holds something other than DCP's index entries"
        if not (isinstance(info.relative_path, str) and _FILE.fullmatch(info.relative_path)):
            return f"it points a read at {info.relative_path!r}, not one of the checkpoint's .distcp files"
        if files is not None and info.relative_path not in files:
            return f"it points a read at {info.relative_path}, which the checkpoint's commit does not list"
        if not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            return f"its entry for {index.fqn!r} has a negative or non-integer offset or length"
        if info.transform_descriptors:
            return f"its entry for {index.fqn!r} asks for transforms ({info.transform_descriptors}), never written here"
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or type(entry) is not TensorStorageMetadata:
            return f"its entry {key!r} is a {type(entry).__name__}, not a tensor's"
        if why := _not_a_tensor_entry(entry):
            return f"its entry {key!r} {why}"
        if entry.size.numel() * entry.properties.dtype.itemsize > stored.get(key, 0):
            return f"its entry {key!r} claims {tuple(entry.size)}, more than the bytes stored for it"
    return None


def _not_a_tensor_entry(entry: TensorStorageMetadata) -> str | None:
    """What makes a tensor's entry other than DCP writes it: a torch.Size of counts, DCP's properties with a dtype,
    a list of chunks of sizes and offsets."""
    if type(entry.size) is not torch.Size or any(type(n) is not int or n < 0 for n in entry.size):
        return "has a size that is not a torch.Size of counts"
    if type(entry.properties) is not TensorProperties or not isinstance(entry.properties.dtype, torch.dtype):
        return "has no dtype"
    chunks = entry.chunks
    if not isinstance(chunks, list) or any(
        type(c) is not ChunkStorageMetadata or type(c.sizes) is not torch.Size or type(c.offsets) is not torch.Size
        for c in chunks
    ):
        return "has chunks that are not DCP's"
    return None


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, less its one read that unpickles: an entry of bytes (torch.load with weights_only=False).
    read_metadata admits none; this holds even for a reader that did not go through it."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"the checkpoint holds {read_item.dest_index.fqn} as pickled bytes, which etrain never writes"
        )


def _load(state: dict, reader) -> None:
    """DCP's load with the planner above; a file it refuses (a tensor's pickle that is not only tensors, a slice
    of another size) as one line naming the checkpoint, storage's own errors as they are."""
    try:
        dcp.load(state, storage_reader=reader, planner=_TensorsOnly(), no_dist=True)
    except CheckpointException as e:
        cause = next(iter(e.failures.values()), (e, None))[0]
        if isinstance(cause, (CheckpointError, *STORAGE_ERRORS)):
            raise cause from None
        raise CheckpointError(f"the DCP files under {reader.path} could not be read: {refusal(cause)}") from None


def _read_metadata(reader, *args, **kwargs):
    path = reader._get_metadata_path(kwargs.get("rank"))
    with reader.fs.create_stream(path, "rb") as f:
        metadata = read_metadata(str(path), f)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class _SafeFileSystemReader(FileSystemReader):
    read_metadata = _read_metadata


class _SafeFsspecReader(FsspecReader):
    read_metadata = _read_metadata
