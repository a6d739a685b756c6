"""The embedded default corpus: the running Python's standard-library sources.

Real text that every machine has, so `etrain train` works with no data given.
Built once per (Python version, data and sequence settings) into
`data.cache_dir`, then reused. A build goes to a temporary local directory and
is then renamed into place (local) or uploaded with the manifest last (a URI
such as s3://, which every node of a cluster can read), so a crash never
leaves a half-written corpus that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shutil
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path

import fsspec
import numpy as np
from tqdm import tqdm

from etrain.core.config import Config
from etrain.data import tokenizer
from etrain.data.shards import SplitWriter, pack_rows, write_manifest


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def ensure_corpus(cfg: Config) -> str:
    """Path of the corpus' manifest.json, building the corpus if it is not there yet."""
    params = {
        "python": sys.version.split()[0],
        "corpus_bytes": cfg.data.corpus_bytes,
        "eval_fraction": cfg.data.eval_fraction,
        "shard_bytes": cfg.data.shard_bytes,
        "seq_len": cfg.model.seq_len,
        "tokenizer": "bytes",
        "sources": True,  # rows name their documents (corpora built before that are rebuilt)
    }
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    if "://" in cfg.data.cache_dir:
        return _ensure_remote(posixpath.join(cfg.data.cache_dir, f"embedded-{key}"), params)
    out = Path(cfg.data.cache_dir).expanduser() / f"embedded-{key}"
    if not (out / "manifest.json").is_file():
        tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            build(tmp, params)
            tmp.rename(out)
        except OSError:
            if not (out / "manifest.json").is_file():  # not a lost race with another builder
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out / "manifest.json")


def _ensure_remote(out: str, params: dict) -> str:
    fs, root = fsspec.core.url_to_fs(out)
    manifest = posixpath.join(out, "manifest.json")
    if not fs.exists(posixpath.join(root, "manifest.json")):
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp), params)
            shards = [p for p in Path(tmp).iterdir() if p.name != "manifest.json"]
            for p in shards:
                fs.put_file(str(p), posixpath.join(root, p.name))
            fs.put_file(str(Path(tmp) / "manifest.json"), posixpath.join(root, "manifest.json"))
    return manifest


def build(out: Path, params: dict) -> dict:
    row_len = params["seq_len"] + 1
    writers = {s: SplitWriter(str(out), s, row_len, "uint8", params["shard_bytes"]) for s in ("train", "eval")}
    streams: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
    names: dict[str, list[str]] = {"train": [], "eval": []}
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    bar = tqdm(desc="building the embedded corpus", total=params["corpus_bytes"], unit="B", unit_scale=True, delay=2)
    for path in stdlib_files():
        if total >= params["corpus_bytes"]:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few stdlib test files are deliberately not UTF-8
        split = "eval" if _held_out(path.name, params["eval_fraction"]) else "train"
        tokens = tokenizer.encode(text)
        streams[split].append(np.append(tokens, np.uint8(tokenizer.EOT)))
        names[split].append(f"stdlib/{path.relative_to(root)}#0")
        total += len(tokens)
        bar.update(len(tokens))
    bar.close()
    for split, docs in streams.items():
        writers[split].add(*pack_rows(docs, names[split], row_len))
        writers[split].flush()
    source = {
        "kind": "embedded-stdlib",
        "documents": {s: len(n) for s, n in names.items()},
        "raw_bytes": total,
        **params,
    }
    return write_manifest(
        str(out),
        seq_len=params["seq_len"],
        dtype="uint8",
        vocab_size=tokenizer.VOCAB_SIZE,
        tokenizer="bytes",
        splits={s: w.shards for s, w in writers.items()},
        source=source,
    )


def _held_out(name: str, fraction: float) -> bool:
    """Split by file name hash: stable across machines and corpus sizes."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2**32 < fraction
