"""Hugging Face model directories in and out: `config.json` onto our model section by the family whose format
reads its architecture (etrain/core/models/<family>/: its names and config.json both ways), weights by name from
`*.safetensors` (one file or an index of shards), and the same written back so that
`transformers.AutoModelForCausalLM.from_pretrained` loads it. A directory is read on local disk or any fsspec URI
(s3://...), a tensor at a time with ranged reads of its file; never a hub download. Written on local disk."""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError
from safetensors.torch import save_file

from etrain.core.config import ConfigError, ModelConfig
from etrain.core.models import FAMILIES, HFFormat, by_architecture
from etrain.core.storage import STORAGE_ERRORS

INDEX = "model.safetensors.index.json"


def read_config(directory: str | Path) -> ModelConfig:
    """The model of a Hugging Face directory, from its config.json; ConfigError naming what is not supported.

    A sliding window (Mistral's) shorter than max_position_embeddings becomes the model's `seq_len`: within the
    window, sliding-window attention is full causal attention, so the model is exact there and a run may not go
    beyond it."""
    fs, root = fsspec.core.url_to_fs(str(directory))
    path = posixpath.join(root, "config.json")
    try:
        cfg = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise ConfigError(f"{directory} is not a Hugging Face model directory: it has no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    try:
        return _model(cfg, path)
    except KeyError as e:
        raise ConfigError(f"{path} has no {e.args[0]!r}, which a {architecture(cfg, path)} config holds") from None
    except ValidationError as e:
        why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise ConfigError(f"{path} does not describe a model this trainer builds ({why})") from None


def architecture(cfg: dict, path: str) -> str:
    """config.json's architecture (or, without `architectures`, the one of its model_type): ConfigError unless a
    family reads it."""
    known = [arch for spec in FAMILIES.values() if spec.hf for arch in spec.hf.architectures]
    by_type = {arch.removesuffix("ForCausalLM").lower(): arch for arch in known}
    named = cfg.get("architectures") or [by_type.get(cfg.get("model_type"), f"of model_type {cfg.get('model_type')}")]
    if named[0] not in known:
        raise ConfigError(f"{path}: architecture {named[0]} is not supported; supported: {', '.join(sorted(known))}")
    return named[0]


def _model(cfg: dict, path: str) -> ModelConfig:
    arch = architecture(cfg, path)
    return by_architecture(arch).hf.read_config(cfg, path, arch)


def format_of(directory: str | Path) -> HFFormat:
    """The Hugging Face format of a model directory: its family's, by its config.json."""
    return read_config(directory).spec.hf


DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    """One safetensors file on any fsspec filesystem, read a tensor at a time: its header (8 bytes of length, then
    JSON naming each tensor's dtype, shape and byte range), then only the bytes of the tensor asked for."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        size = fs.size(path)
        length = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")  # ranged reads: never the whole file
        if not 0 < length <= size - 8:
            raise ConfigError(f"{path} is not a safetensors file (its header's length says {length} bytes)")
        try:
            header = json.loads(fs.cat_file(path, start=8, end=8 + length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{path} is not a safetensors file: its header is not an object of tensors")
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if not _entry(entry):
                raise ConfigError(
                    f"{path}: tensor {name}'s header entry is not a dtype, shape and byte range: {entry!r}"
                )
        self.start, self.size, self.entries = 8 + length, size, header
        self.read_bytes = 0  # of tensors, since opened
        self._mapped: np.memmap | None = None  # a local file, mapped copy-on-write at its first tensor read

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.entries[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin = self._checked(name)
        return self._read(dtype, shape, begin)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (dim 0): one contiguous range of its bytes, read alone."""
        dtype, shape, begin = self._checked(name)
        row = shape[1:].numel() * dtype.itemsize
        return self._read(dtype, torch.Size((stop - start, *shape[1:])), begin + start * row)

    def _checked(self, name: str) -> tuple[torch.dtype, torch.Size, int]:
        """A tensor's dtype, shape and first byte, its entry held to the file: ConfigError naming what is wrong."""
        entry = self.entries[name]
        dtype, shape = DTYPES.get(entry["dtype"]), torch.Size(entry["shape"])
        begin, end = entry["data_offsets"]
        if dtype is None:
            raise ConfigError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, which is not read here")
        if end - begin != shape.numel() * dtype.itemsize or self.start + end > self.size:
            raise ConfigError(f"{self.path}: tensor {name}'s bytes do not match its shape {tuple(shape)}: cut short?")
        return dtype, shape, begin

    def _read(self, dtype: torch.dtype, shape: torch.Size, begin: int) -> torch.Tensor:
        if shape.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        first, end = self.start + begin, self.start + begin + shape.numel() * dtype.itemsize
        self.read_bytes += end - first
        if isinstance(self.fs, LocalFileSystem):  # the page cache's copy, shared by the node's workers until written
            self._mapped = self._mapped if self._mapped is not None else np.memmap(self.path, mode="c")
            return torch.frombuffer(self._mapped[first:end], dtype=dtype).reshape(shape)
        data = self.fs.cat_file(self.path, start=first, end=end)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _entry(entry) -> bool:
    """A header entry as safetensors writes it: a dtype name, a shape of counts, and two byte offsets in order."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    counts = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    span = isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
    return counts and span and 0 <= offsets[0] <= offsets[1]


def files(directory: str | Path) -> dict[str, SafetensorsFile]:
    """Each tensor's file: from the index of a sharded directory, or the one model.safetensors."""
    fs, root = fsspec.core.url_to_fs(str(directory))
    if fs.isfile(posixpath.join(root, INDEX)):
        index = _index(fs, posixpath.join(root, INDEX))
        opened = {file: SafetensorsFile(fs, posixpath.join(root, file)) for file in set(index.values())}
        return {name: opened[file] for name, file in index.items()}
    single = posixpath.join(root, "model.safetensors")
    if not fs.isfile(single):
        raise ConfigError(f"{directory} holds no model.safetensors and no {INDEX}")
    opened = SafetensorsFile(fs, single)
    return dict.fromkeys(opened.keys(), opened)


def weight_files(fs, root: str) -> list[str]:
    """The names of the files that hold a directory's weights: its index and the shards it names, or the one
    model.safetensors."""
    index = posixpath.join(root, INDEX)
    return [INDEX, *sorted(set(_index(fs, index).values()))] if fs.isfile(index) else ["model.safetensors"]


def _index(fs, path: str) -> dict[str, str]:
    """An index's weight map (tensor -> its file beside the index); ConfigError naming the index otherwise."""
    try:
        index = json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{path} has no weight_map of tensors to their files")
    for name, file in weight_map.items():
        if not (isinstance(file, str) and re.fullmatch(r"[\w.-]+\.safetensors", file)):
            raise ConfigError(f"{path}: tensor {name} is in {file!r}, not a .safetensors file beside the index")
    return weight_map


def check_against(weights: Weights, shapes: dict[str, torch.Size], directory: str) -> None:
    """The directory holds every tensor the model needs, each of its shape: else ConfigError naming the tensor by
    the file's name and the file (not our internal name)."""
    held = weights.shapes()
    for name, shape in shapes.items():
        if name not in held:
            theirs = weights.format.their_name(name)
            raise ConfigError(f"{directory} holds no tensor {theirs}, which its config.json's model needs")
        if held[name] != shape:
            file, theirs = weights.where(name)
            raise ConfigError(
                f"{file}: tensor {theirs} has shape {tuple(held[name])}, its config.json's model needs {tuple(shape)}"
            )


def is_model_dir(source: str) -> bool:
    """A Hugging Face model directory (local or at an fsspec URI): config.json beside model.safetensors or its
    index. Another URI that cannot be read is not one (the caller's own reading names its error)."""
    try:
        fs, root = fsspec.core.url_to_fs(str(source))
        return fs.isfile(posixpath.join(root, "config.json")) and any(
            fs.isfile(posixpath.join(root, name)) for name in ("model.safetensors", INDEX)
        )
    except (*STORAGE_ERRORS, ValueError):
        return False


class Weights(Mapping):
    """A Hugging Face directory's weights by our names, each read when asked for (only that tensor's bytes of its
    file): a base's shapes and digest without the whole model in memory."""

    def __init__(self, directory: str | Path, format: HFFormat | None = None):
        """`format`: the family's, where config.json names another head on its trunk (a reward model's)."""
        self.format = format or format_of(directory)
        named = ((self.format.our_name(theirs), theirs, f) for theirs, f in files(directory).items())
        self._files = {ours: (f, theirs) for ours, theirs, f in named if ours}
        self.tied = "head.weight" not in self._files and "embed.weight" in self._files
        if self.tied:  # the head is the embedding
            self._files["head.weight"] = self._files["embed.weight"]

    def __getitem__(self, name: str) -> torch.Tensor:
        file, theirs = self._files[name]
        return file.tensor(theirs)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor alone: what a rank holding them reads (layout_state.load_full)."""
        file, theirs = self._files[name]
        return file.rows(theirs, start, stop)

    def read_bytes(self) -> int:
        return sum(file.read_bytes for file in {id(f): f for f, _ in self._files.values()}.values())

    def where(self, name: str) -> tuple[str, str]:
        """The file and the name in it of our tensor `name`."""
        file, theirs = self._files[name]
        return file.path, theirs

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def shapes(self) -> dict[str, torch.Size]:
        return {name: file.shape(theirs) for name, (file, theirs) in self._files.items()}


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face directory by our names (a tied head as the embedding)."""
    weights = Weights(directory)
    whole = {name: weights[name] for name in weights if name != "head.weight" or not weights.tied}
    if weights.tied:  # the head is the embedding: read once
        whole["head.weight"] = whole["embed.weight"]
    return whole


def write(model_state: dict[str, torch.Tensor], args: ModelConfig, out: str | Path, shard_bytes: int = 2 << 30) -> None:
    """A Hugging Face directory of `model_state` (our names): config.json, model-0000N-of-0000M.safetensors in
    shards of at most `shard_bytes` (a tensor larger than that alone in its own), and their index."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if args.spec.hf is None:
        raise ConfigError(f"model.family={args.family} has no Hugging Face format (etrain/core/models/{args.family}/)")
    tensors = {args.spec.hf.their_name(n): t.detach().contiguous() for n, t in model_state.items()}
    if args.tie_weights:
        tensors.pop("lm_head.weight", None)  # transformers ties it back from the embedding
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        (out / file).chmod(0o666 & ~_umask())  # safetensors makes its file private (0600): as its neighbours instead
        weight_map |= {name: file for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(args.spec.hf.write_config(args) | {"dtype": dtype}, indent=2))


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back): what plain file writes leave off."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
