"""Shard format and manifest: the contract between data preparation and training.

A shard is a Parquet file with one column, `tokens`, of fixed-size binary: each
row is one packed sequence of `seq_len + 1` tokens (inputs plus the shifted
target) at the tokenizer's width (uint8 for bytes), uncompressed, so decoding
is a zero-copy view. Chat data's rows (etrain/data/chat.py; the manifest's
`targets` is "answers") are int32, a token the loss does not predict stored as
-t - 1. A second column, `sources`, names the documents each row
was packed from (`path#row`), so a bad sample found in training can be traced
back; readers of tokens never load it.

`manifest.json` beside the shards lists, per split, every shard with its sample
count, byte size and sha256; a sample's global id within a split is its row
position in the concatenation of that split's shards, in manifest order.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections import OrderedDict
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from etrain.core.errors import UsageError

FORMAT = "etrain.shards/1"


class ShardError(UsageError):
    """A manifest or shard is unusable; the message names it and what to do."""


@dataclass
class SplitWriter:
    """Packs token rows into shards of about `shard_bytes` and records them."""

    out: str
    prefix: str  # shard file names: PREFIX-00000.parquet
    row_len: int
    dtype: str
    shard_bytes: int
    storage: dict = field(default_factory=dict)  # fsspec options, e.g. endpoint_url
    shards: list[dict] = field(default_factory=list)
    _rows: list[np.ndarray] = field(default_factory=list)
    _sources: list[list[str]] = field(default_factory=list)
    _pending: int = 0

    def add(self, rows: np.ndarray, sources: list[list[str]]) -> None:
        """`rows` and, for each row, the documents it was packed from."""
        self._rows.append(rows)
        self._sources += sources
        self._pending += rows.nbytes
        if self._pending >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        rows = np.concatenate(self._rows)
        per_shard = max(1, self.shard_bytes // (self.row_len * np.dtype(self.dtype).itemsize))
        for start in range(0, len(rows), per_shard):
            self.shards.append(self._write(rows[start : start + per_shard], self._sources[start : start + per_shard]))
        self._rows, self._sources, self._pending = [], [], 0

    def _write(self, rows: np.ndarray, sources: list[list[str]]) -> dict:
        name = f"{self.prefix}-{len(self.shards):05d}.parquet"
        width = self.row_len * rows.dtype.itemsize
        column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())])
        table = pa.table({"tokens": column, "sources": pa.array(sources, type=pa.list_(pa.string()))})
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="none", row_group_size=4096, use_dictionary=["sources.list.element"])
        data = sink.getvalue()
        with fsspec.open(posixpath.join(self.out, name), "wb", **self.storage) as f:
            f.write(data)
        return {"path": name, "samples": len(rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(
    out: str,
    *,
    seq_len: int,
    dtype: str,
    vocab_size: int,
    tokenizer: str,
    splits: dict[str, list[dict]],
    source: dict,
    storage: dict | None = None,
    targets: str | None = None,
) -> dict:
    """`targets`: what a row's loss counts where not every token (chat data's "answers": etrain/data/chat.py)."""
    manifest = {
        "format": FORMAT,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "token_dtype": dtype,
        "seq_len": seq_len,
        "splits": {
            name: {"samples": sum(s["samples"] for s in shards), "shards": shards} for name, shards in splits.items()
        },
        "source": source,
    } | ({"targets": targets} if targets else {})
    with fsspec.open(posixpath.join(out, "manifest.json"), "w", **(storage or {})) as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(uri: str) -> dict:
    try:
        with fsspec.open(uri, "r") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ShardError(f"manifest {uri} not found; run `etrain prepare` or set data.source=embedded") from None
    except IsADirectoryError:
        raise ShardError(
            f"{uri} is a directory; point data.source at the manifest in it: {uri.rstrip('/')}/manifest.json"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"manifest {uri} is not valid JSON ({e}); re-run `etrain prepare`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ShardError(f"manifest {uri} has format {found!r}, expected {FORMAT!r}")
    return manifest


def training_manifest(uri: str) -> dict:
    """A manifest a run can train on: a train split to learn from and an eval split to measure on, both with samples."""
    manifest = read_manifest(uri)
    splits = manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}
    for split in ("train", "eval"):
        if not (splits.get(split) or {}).get("samples"):
            raise ShardError(
                f"manifest {uri} has no {split!r} split with samples (splits: {sorted(splits) or 'none'}); "
                f"prepare the data with `etrain prepare`, which writes both (data.eval_fraction sets the eval share)"
            )
    return manifest


class ShardReader:
    """Random access to one split's samples by global id, keeping a few decoded shards.

    Every shard is checked against its manifest sha256 when loaded.
    """

    def __init__(self, manifest_uri: str, split: str, cache_shards: int = 3):
        self.manifest = read_manifest(manifest_uri)
        if split not in self.manifest["splits"]:
            raise ShardError(f"manifest {manifest_uri} has no split {split!r} (has {sorted(self.manifest['splits'])})")
        self.root = posixpath.dirname(manifest_uri)
        self.shards = self.manifest["splits"][split]["shards"]
        self.row_len = self.manifest["seq_len"] + 1
        self.dtype = np.dtype(self.manifest["token_dtype"])
        self.starts = np.cumsum([0] + [s["samples"] for s in self.shards])
        self.cache_shards = cache_shards
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Rows for `ids`, in order, shape (len(ids), seq_len + 1)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids must lie in [0, {len(self)})")
        which = np.searchsorted(self.starts, ids, side="right") - 1
        out = np.empty((len(ids), self.row_len), dtype=self.dtype)
        for shard in np.unique(which):
            mask = which == shard
            out[mask] = self._shard(int(shard))[ids[mask] - self.starts[shard]]
        return out

    def _shard(self, index: int) -> np.ndarray:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        rows = load_shard(
            posixpath.join(self.root, self.shards[index]["path"]), self.shards[index], self.row_len, self.dtype
        )
        self._cache[index] = rows
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return rows


def pack_rows(tokens: list[np.ndarray], names: list[str], row_len: int) -> tuple[np.ndarray, list[list[str]]]:
    """Documents' tokens (each ending in EOT) concatenated and cut into rows of `row_len`; the tail
    that fills no row is dropped. Each row comes with the names of the documents it overlaps."""
    stream = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.uint8)
    n = len(stream) // row_len
    ends = np.cumsum([len(t) for t in tokens])  # document i covers [ends[i-1], ends[i])
    first = np.searchsorted(ends, np.arange(n) * row_len, side="right")
    last = np.searchsorted(ends, (np.arange(n) + 1) * row_len - 1, side="right")
    return stream[: n * row_len].reshape(n, row_len), [names[a : b + 1] for a, b in zip(first, last)]


def row_sources(uri: str, rows: np.ndarray) -> list[list[str]] | None:
    """The documents rows of the shard at `uri` were packed from; None for shards written before sources were kept."""
    with fsspec.open(uri, "rb") as f:
        table = pq.read_table(f, columns=None)
    if "sources" not in table.column_names:
        return None
    column = table.column("sources")
    return [column[int(r)].as_py() for r in rows]


def load_shard(uri: str, entry: dict, row_len: int, dtype: np.dtype) -> np.ndarray:
    with fsspec.open(uri, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ShardError(
            f"shard {uri} does not match its manifest sha256; it is corrupt or was replaced: re-run `etrain prepare`"
        )
    return decode(pq.ParquetFile(pa.BufferReader(data)).read(columns=["tokens"]), row_len, dtype)


def decode(table: pa.Table, row_len: int, dtype: np.dtype) -> np.ndarray:
    """A shard's rows as an (n, row_len) array over the table's own buffer (no copy)."""
    column = table.column("tokens").combine_chunks()
    buf = column.buffers()[1]
    width = row_len * dtype.itemsize
    return np.frombuffer(buf, dtype=dtype, count=len(column) * row_len, offset=column.offset * width).reshape(
        len(column), row_len
    )
