"""Checkpoints on local disk or any fsspec URI, visible only once complete.

S3 has no atomic rename, so a checkpoint is a directory `step-NNNNNNNN/` whose
data is written first and whose `commit.json` (step, cursor, config, sha256 of
every file) is written last. Readers trust only directories with a commit whose
checksums match; anything else is debris from a crash.

This module moves bytes only; workers serialise their state with `torch.save`
and load it with `torch.load(weights_only=True)` (`serialize`/`deserialize`),
so the coordinator never imports torch and storage never feeds a pickle.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
from dataclasses import dataclass

import fsspec

log = logging.getLogger(__name__)

COMMIT = "commit.json"
STATE = "state.pt"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoint:
    path: str
    meta: dict
    state: bytes


def serialize(state: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def save(uri: str, step: int, data: bytes, meta: dict, keep: int) -> str:
    fs, root = fsspec.core.url_to_fs(uri)
    path = posixpath.join(root, f"step-{step:08d}")
    if fs.exists(path):
        fs.rm(path, recursive=True)  # uncommitted or corrupt, else we would have resumed from it
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(posixpath.join(path, STATE), data)
    commit = {**meta, "step": step, "files": {STATE: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    fs.pipe_file(posixpath.join(path, COMMIT), json.dumps(commit, indent=1).encode())
    _retain(fs, root, keep)
    return path


def load_latest(uri: str) -> Checkpoint | None:
    """The newest committed checkpoint whose bytes verify; older ones if the newest is bad."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)  # listings are cached per process; another process wrote these
    for path in reversed(_step_dirs(fs, root)):
        meta = _read_commit(fs, path)
        if meta is None:
            continue
        try:
            return Checkpoint(path, meta, _read_state(fs, path, meta))
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s; falling back to an earlier one", path, e)
    return None


def _read_state(fs, path: str, meta: dict) -> bytes:
    expected = meta["files"][STATE]
    try:
        data = fs.cat_file(posixpath.join(path, STATE))
    except FileNotFoundError:
        raise CheckpointError(f"{STATE} is missing") from None
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{STATE} does not match its sha256 (corrupt)")
    return data


def _read_commit(fs, path: str) -> dict | None:
    try:
        meta = json.loads(fs.cat_file(posixpath.join(path, COMMIT)))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("skipping checkpoint %s: unreadable %s", path, COMMIT)
        return None
    return meta if isinstance(meta, dict) and STATE in meta.get("files", {}) else None


def _step_dirs(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    names = [p.rstrip("/") for p in fs.ls(root, detail=False)]
    return sorted(p for p in names if posixpath.basename(p).startswith("step-"))


def _retain(fs, root: str, keep: int) -> None:
    dirs = _step_dirs(fs, root)
    committed = [p for p in dirs if fs.exists(posixpath.join(p, COMMIT))]
    newest = committed[-1] if committed else None
    for p in dirs:
        stale = p in committed[:-keep] or (p not in committed and newest is not None and p < newest)
        if stale:
            fs.rm(p, recursive=True)
