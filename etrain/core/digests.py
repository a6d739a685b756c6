"""A Hugging Face directory's weights digest (the identity a fine-tuning run records of its base), hashed once per
change of its files instead of on every start.

The digest is of the tensors (checkpoint.weights_digest), so that a base keeps its identity whatever files hold it;
hashing a 135 M model's 540 MB took the driver two passes and every worker one, about a second each, at every start,
resume and replacement. A local file's fingerprint is its size, inode, mtime and ctime: a rewrite changes the ctime
even when the writer puts the mtime back (it cannot be set from user space), so a changed file is hashed again. The
digest of an unchanged fingerprint is kept in this process and, for local files, in a per-node cache of JSON files
(`$XDG_CACHE_HOME/etrain/digests`, else `~/.cache/etrain/digests`): the driver fills it, and the workers of its node
read it. Files on object storage are fingerprinted by what their store says of them (size, ETag or modified time)
and kept in this process only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import tempfile
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from etrain.core import hf
from etrain.core.checkpoint import weights_digest

HEX = re.compile(r"[0-9a-f]{64}")
SETTLE_S = 2.0
_known: dict[str, str] = {}  # fingerprint -> digest, this process's


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "etrain" / "digests"


def digest(directory: str) -> str:
    """checkpoint.weights_digest(hf.Weights(directory)), hashed only when its files changed since it last was."""
    fs, root = fsspec.core.url_to_fs(str(directory))
    key, settled = fingerprint(fs, root)
    local = isinstance(fs, LocalFileSystem)
    if key in _known:
        return _known[key]
    if local and (kept := _read_kept(key)) is not None:
        _known[key] = kept
        return kept
    value = weights_digest(hf.Weights(directory))
    if settled and fingerprint(fs, root)[0] == key:  # unchanged while it was read: the digest is of these files
        _known[key] = value
        if local:
            _keep(key, value)
    return value


def fingerprint(fs, root: str) -> tuple[str, bool]:
    """What identifies the directory's weight files (the index and the safetensors it names, or model.safetensors)
    as they are now, and whether it is settled: a file changed within SETTLE_S of now may change again within the
    clock's tick (a file's times are coarser than nanoseconds) without changing them, so it is not kept (git's
    "racily clean" entries)."""
    marks, newest = [root], 0
    for name in hf.weight_files(fs, root):
        path = posixpath.join(root, name)
        if isinstance(fs, LocalFileSystem):
            s = os.stat(path)
            marks.append(f"{name}:{s.st_size}:{s.st_ino}:{s.st_mtime_ns}:{s.st_ctime_ns}")
            newest = max(newest, s.st_mtime_ns, s.st_ctime_ns)
        else:
            info = fs.info(path)
            tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
            marks.append(f"{name}:{info.get('size')}:{tag}")
    return "\n".join(map(str, marks)), time.time_ns() - newest > SETTLE_S * 1e9


def _entry(key: str) -> Path:
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _read_kept(key: str) -> str | None:
    """The digest kept for `key` on this node, if its entry is one this module wrote for that key; anything else
    (absent, unreadable, another key, not a digest) is no entry."""
    try:
        entry = json.loads(_entry(key).read_text())
    except (OSError, ValueError):
        return None
    value = entry.get("digest") if isinstance(entry, dict) and entry.get("key") == key else None
    return value if isinstance(value, str) and HEX.fullmatch(value) else None


def _keep(key: str, value: str) -> None:
    """Written whole (a temporary file renamed) or not at all: a cache that cannot be written only costs a hash."""
    with contextlib.suppress(OSError):
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "digest": value}, f)
        os.replace(tmp, _entry(key))
