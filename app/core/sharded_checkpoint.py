"""A sharded run's state as torch DCP files: each rank writes the shards it holds and reads what it needs, so no
rank ever holds the whole model; a state saved at one layout loads at any other (DCP reshards at load).

The files sit in the step directory's `dcp/` beside `extra.pt` (schedule and scaler) and go through the
checkpoint's commit like any part (app/core/checkpoint.py): written first, each with its sha256 in `commit.json`,
verified before a load. DCP's `.metadata` is a pickle: it is read with an unpickler that builds only DCP's own
metadata classes and torch's sizes and dtypes, never an arbitrary object.
"""

from __future__ import annotations

import pickle
import posixpath
from collections.abc import Iterator, Mapping
from concurrent.futures import Future

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from app.core.checkpoint import DCP, file_digest

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
    """Take the checkpoint under `uri` into this rank's part, in place: each rank reads the slices it holds."""
    reader = _reader(uri)
    saved = reader.read_metadata().state_dict_metadata
    for name, p in model.named_parameters():  # AdamW's state is made lazily: room for what the checkpoint holds
        prefix = f"optim.{optim_name(name, tied)}."
        keys = {k.rsplit(".", 1)[1] for k in saved if k.startswith(prefix)}
        if keys and p not in optimizer.state:
            optimizer.state[p] = {k: _like(p, saved[prefix + k]) for k in keys}
    dcp.load(state_dict(model, optimizer, tied), storage_reader=reader, no_dist=True)


def load_weights(model: torch.nn.Module, uri: str) -> None:
    """Take the weights of the checkpoint under `uri` into this rank's part, in place (each rank reads the slices it
    holds), and none of its optimizer state: a fine-tuning run's start from a base a layout wrote."""
    dcp.load({"model": model.state_dict()}, storage_reader=_reader(uri), no_dist=True)


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
        dcp.load(one, storage_reader=self._reader, no_dist=True)
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
    dcp.load(flat, storage_reader=reader, no_dist=True)
    state: dict = {"model": {}, "optim": {}}
    for key, t in flat.items():
        section, _, rest = key.partition(".")
        if section == "model":
            state["model"][rest] = t
        else:
            name, _, k = rest.rpartition(".")
            state["optim"].setdefault(name, {})[k] = t
    return state


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


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's sizes, dtypes, layouts and memory formats, paths and plain containers:
    nothing else a `.metadata` from storage may build."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    BUILTINS = {"set", "frozenset", "slice", "tuple", "list", "dict"}
    OTHERS = {
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),  # the checkpoint id DCP keeps
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str):
        if module in self.MODULES:
            return super().find_class(module, name)
        if (module, name) in self.OTHERS:
            return super().find_class(module, name)
        if module == "builtins" and name in self.BUILTINS:
            return super().find_class(module, name)
        if module == "torch":
            found = getattr(torch, name, None)
            if name == "Size" or isinstance(found, torch.dtype | torch.layout | torch.memory_format):
                return found
        raise pickle.UnpicklingError(f"a DCP .metadata may not build {module}.{name}: not a checkpoint's metadata")


def _read_metadata(reader, *args, **kwargs):
    path = reader._get_metadata_path(kwargs.get("rank"))
    with reader.fs.create_stream(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if getattr(metadata, "storage_meta", None) is None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class _SafeFileSystemReader(FileSystemReader):
    read_metadata = _read_metadata


class _SafeFsspecReader(FsspecReader):
    read_metadata = _read_metadata
