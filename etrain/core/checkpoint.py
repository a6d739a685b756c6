"""Checkpoints in levels, on local disk or any fsspec URI, visible only once complete.

The levels, each at its own cadence (`checkpoint.*`):
- cursor: the step and data cursor after every step, in `cursor.json` at the root. The RNG needs
  nothing: every random draw is a pure function of (seed, step, rank).
- light: the weights in `checkpoint.light_dtype`, only the tensors whose content hash differs from
  the last full checkpoint's (its `base`), which supplies the rest and the optimizer state.
- full: weights, optimizer (one part per rank under ZeRO-1), scheduler and scaler.

S3 has no atomic rename, so a checkpoint is a directory `step-NNNNNNNN/` whose parts are written
first, by the workers that hold them, and whose `commit.json` (level, step, cursor, config, sha256
of every part) is written last, by the coordinator. Readers trust only a directory with a commit
whose checksums match; anything else is the debris of a crash or a save still in flight.

Parts are written with `torch.save` and read with `torch.load(weights_only=True)`, so storage never
feeds a pickle that builds anything but tensors and plain values. The coordinator verifies each part before it
picks a checkpoint: its sha256, and its pickle read onto the meta device (weights_only, no tensor data read), so a
crafted part is skipped and named like a damaged one instead of failing every worker's load.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec

from etrain.core.errors import UsageError
from etrain.core.storage import STORAGE_ERRORS, describe

logger = logging.getLogger(__name__)

COMMIT = "commit.json"
CURSOR = "cursor.json"
LIGHT = "light.pt"  # a light checkpoint's weights, as handed to the loader beside its base's parts
DCP = "dcp"  # a sharded run's directory of DCP files in a step directory; in the parts handed on, its URI


class CheckpointError(UsageError):
    """A checkpoint that is not what it claims: a part missing or changed, a commit that does not parse or holds
    values no save writes, a metadata file that would build anything but DCP's index. The message names the file."""


class CheckpointsCorrupt(CheckpointError):
    """Committed checkpoints were found and none of them verifies: a resume that went on would start from scratch,
    so it stops instead (exit 2), naming each one with its cause (`skipped`)."""

    def __init__(self, message: str, skipped: list[dict]):
        super().__init__(message)
        self.skipped = skipped

    def __reduce__(self):  # raised in the coordinator, read by the driver
        return type(self), (str(self), self.skipped)


@dataclass
class Checkpoint:
    path: str  # the newest level's directory
    meta: dict  # its commit
    parts: dict[str, bytes]  # verified part files; a light one's weights under LIGHT, the rest from its base; a
    # sharded run's DCP files verified but not read (each rank reads its own): their directory's URI under DCP
    base: str | None = None  # the full checkpoint a light one completes
    skipped: list[dict] = field(default_factory=list)  # newer committed ones that failed verification: path, error


def checkpoint_uri(cfg, run_dir) -> str:
    """Where a run's checkpoints (and its lease and cursor) live: `checkpoint.uri`, or RUN/checkpoints."""
    return cfg.checkpoint.uri or str(Path(run_dir) / "checkpoints")


def serialize(state) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes, name: str = "a checkpoint part", device: str = "cpu"):
    """A part's tensors and plain values; a pickle that holds anything else (weights_only refuses it) or a file that
    is not torch's as one line naming the part (`name`). `device` meta: the pickle alone, no tensor data read."""
    import torch

    try:
        with warnings.catch_warnings():  # a crafted pickle's protocol: the refusal below says all there is
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as e:  # whatever a malformed or crafted file makes the unpickler raise: the file is refused
        raise CheckpointError(f"{name} is not a file of tensors etrain reads: {refusal(e)}") from None


def refusal(error: BaseException) -> str:
    """torch.load's refusal in a line: weights_only's own reason (what the pickle asked for) rather than its
    paragraph of advice, else the error's first line."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        said = " ".join(text.split("WeightsUnpickler error:", 1)[1].split())[:200]
        return f"its pickle asks for what weights_only refuses ({said})"
    return f"{type(error).__name__}: {(text.strip().splitlines() or [''])[0][:300]}"


def read_part(parts: dict[str, bytes], name: str):
    """The part `name` of a checkpoint's verified parts, deserialized."""
    return deserialize(parts[name], name)


def tensor_hash(tensor) -> str:
    """Content hash of a CPU tensor's bytes: what a light save compares with its base."""
    import torch

    return hashlib.sha256(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()


def light_weights(weights: dict, hashes: dict[str, str], base_hashes: dict[str, str], dtype: str) -> dict:
    """A light checkpoint's tensors: those whose hash differs from the base's, floats in `dtype`."""
    import torch

    compact = getattr(torch, dtype)
    return {
        k: v.to(compact) if v.is_floating_point() else v for k, v in weights.items() if hashes[k] != base_hashes.get(k)
    }


class _Hashing(io.RawIOBase):
    """Streams `torch.save` output to storage while hashing it: one pass, no second copy in memory."""

    def __init__(self, out, progress=None):
        self.out, self.sha, self.size, self.progress = out, hashlib.sha256(), 0, progress

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        self.out.write(b)
        if self.progress is not None:
            self.progress.update(len(b))
        return len(b)


def write_part(path: str, name: str, obj) -> dict:
    """One part of a checkpoint at `path` (a step directory URI); its size and sha256 for the commit."""
    import torch
    from tqdm import tqdm

    # A bar only for a write that takes more than a few seconds (a large model, slow object storage).
    with (
        tqdm(
            desc=f"writing {posixpath.basename(path.rstrip('/'))}/{name}",
            unit="B",
            unit_scale=True,
            delay=5,
            mininterval=5,
            total=_tensor_bytes(obj) or None,
            leave=False,
        ) as bar,
        fsspec.open(posixpath.join(path, name), "wb") as f,
    ):
        out = _Hashing(f, bar)
        torch.save(obj, out)
    return {"bytes": out.size, "sha256": out.sha.hexdigest()}


def _tensor_bytes(obj) -> int:
    """The tensors' share of a part's size: the bar's total (a fair estimate; torch.save adds little)."""
    import torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def prepare(uri: str, step: int) -> str:
    """The directory for a checkpoint at `step`, emptied of an earlier uncommitted or corrupt attempt."""
    fs, root = fsspec.core.url_to_fs(uri)
    path = posixpath.join(root, f"step-{step:08d}")
    if fs.exists(path):
        fs.rm(path, recursive=True)  # a committed one that verified would have been resumed from instead
    fs.makedirs(path, exist_ok=True)
    return fs.unstrip_protocol(path)


def commit(path: str, meta: dict, files: dict[str, dict]) -> None:
    """The commit marker, written last."""
    fs, p = fsspec.core.url_to_fs(path)
    _put_whole(fs, posixpath.join(p, COMMIT), json.dumps({**meta, "files": files}, indent=1).encode())


def save(uri: str, step: int, parts: dict[str, object], meta: dict, keep: int) -> str:
    """A synchronous save in one process: every part, then the commit, then retention."""
    path = prepare(uri, step)
    files = {name: write_part(path, name, obj) for name, obj in parts.items()}
    commit(path, {"level": "full", **meta, "step": step}, files)
    retain(uri, keep, upto=step)
    return path


def load_latest(uri: str, accept: Callable[[dict], str | None] | None = None) -> Checkpoint | None:
    """The newest committed checkpoint whose parts verify (a light one with its base), and that `accept` (a commit's
    check against the run, returning what is wrong) takes; each newer one skipped is logged and kept in its
    `skipped`. None when nothing is committed; CheckpointsCorrupt when something is and none verifies."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)  # listings are cached per process; another process wrote these
    skipped = []
    for path in reversed(_step_dirs(fs, root)):
        try:
            meta = _read_commit(fs, path)
            if meta is None:  # no commit: a save in flight, or the debris of a crash
                continue
            if accept is not None and (wrong := accept(meta)):
                raise CheckpointError(f"{COMMIT}: {wrong}")
            ckpt = _load(fs, path, meta)
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", fs.unstrip_protocol(path), e)
            skipped.append({"path": fs.unstrip_protocol(path), "error": str(e)})
            continue
        ckpt.skipped = skipped
        return ckpt
    if skipped:
        names = "; ".join(f"{posixpath.basename(s['path'])}: {s['error']}" for s in skipped)
        raise CheckpointsCorrupt(f"no checkpoint under {uri} verifies ({names})", skipped)
    return None


def newest_meta(uri: str) -> dict | None:
    """The newest commit marker's contents, unverified (one small read, no parts): how far a run got, what it is."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)
    for path in reversed(_step_dirs(fs, root)):
        if (meta := _quiet_commit(fs, path)) is not None:
            return meta
    return None


def load_at(uri: str) -> Checkpoint:
    """The committed checkpoint in the step directory `uri`, verified; CheckpointError if it is not one."""
    fs, path = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(posixpath.dirname(path.rstrip("/")))
    meta = _read_commit(fs, path)
    if meta is None:
        raise CheckpointError(f"{uri} holds no committed checkpoint ({COMMIT} missing or unreadable)")
    return _load(fs, path, meta)


def dcp_dir(uri: str) -> str | None:
    """The DCP directory of the committed checkpoint at `uri` (a layout wrote it), or None (a whole model's files):
    its commit is read, its files are not (a caller that reads slices of them has had them verified)."""
    fs, path = fsspec.core.url_to_fs(uri)
    meta = _read_commit(fs, path)
    if meta is None:
        raise CheckpointError(f"{uri} holds no committed checkpoint ({COMMIT} missing or unreadable)")
    if any(name.startswith(DCP + "/") for name in meta["files"]):
        return fs.unstrip_protocol(posixpath.join(path, DCP))
    return None


def _load(fs, path: str, meta: dict) -> Checkpoint:
    if meta["level"] == "full":
        return Checkpoint(fs.unstrip_protocol(path), meta, _read_parts(fs, path, meta))
    base = posixpath.join(posixpath.dirname(path.rstrip("/")), meta["base"])
    try:
        base_meta = _read_commit(fs, base)
    except CheckpointError as e:
        raise CheckpointError(f"its base {meta['base']}: {e}") from None
    if base_meta is None:
        raise CheckpointError(f"its base {meta['base']} is gone or uncommitted")
    parts = _read_parts(fs, base, base_meta) | {LIGHT: _read_parts(fs, path, meta)["model.pt"]}
    return Checkpoint(fs.unstrip_protocol(path), meta, parts, base=fs.unstrip_protocol(base))


def model_weights(parts: dict[str, bytes]) -> dict:
    """A checkpoint's model weights: its model.pt, with a light checkpoint's changed tensors over its base's; a
    sharded run's gathered from its DCP files (the one place a sharded model is whole: export, a base)."""
    if DCP in parts:
        from etrain.core.sharded_checkpoint import whole_state

        return whole_state(parts[DCP].decode())["model"]
    model = read_part(parts, "model.pt")
    if LIGHT in parts:
        model |= {k: v.to(model[k].dtype) for k, v in read_part(parts, LIGHT).items()}
    return model


def weights_digest(state: dict) -> str:
    """sha256 over the weights' names and contents: the identity of a fine-tuning run's base, whatever file holds it."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(f"{name}:{tensor_hash(state[name].detach().cpu())};".encode())
    return h.hexdigest()


def retain(uri: str, keep: int, upto: int | None = None) -> None:
    """The last `keep` full checkpoints and the light ones after the newest; debris older than that goes. `upto`:
    the step just saved; directories of later steps (a run that went back past them: corrupt ones it skipped, or
    its own future) are neither counted nor removed, so a skipped one never pushes a good one out."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)
    dirs = [p for p in _step_dirs(fs, root) if upto is None or _step_of(p) <= upto]
    metas = {p: _quiet_commit(fs, p) for p in dirs}
    fulls = [p for p in dirs if metas[p] and metas[p]["level"] == "full"]
    lights = [
        p for p in dirs if metas[p] and metas[p]["level"] == "light" and fulls and _step_of(p) > _step_of(fulls[-1])
    ]
    kept = set(fulls[-keep:]) | set(lights[-keep:])
    newest = max(map(_step_of, kept), default=None)
    for p in dirs:
        in_flight = metas[p] is None and (newest is None or _step_of(p) > newest)
        if p not in kept and not in_flight:
            fs.rm(p, recursive=True)


def write_cursor(uri: str, record: dict) -> None:
    fs, root = fsspec.core.url_to_fs(uri)
    _put_whole(fs, posixpath.join(root, CURSOR), json.dumps(record).encode())


def read_cursor(uri: str) -> dict | None:
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        return json.loads(fs.cat_file(posixpath.join(root, CURSOR)))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class CursorLog:
    """The cursor level: the newest step's cursor, written by a background thread (the newest
    wins), so a slow object store never stalls a step."""

    def __init__(self, uri: str):
        self.uri, self._latest, self._closed = uri, None, False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="cursor-log", daemon=True)
        self._thread.start()

    def update(self, record: dict) -> None:
        with self._wake:
            self._latest = record
            self._wake.notify()

    def close(self, timeout: float = 30) -> None:
        """Write the last record (waiting up to `timeout` for it), then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._latest is not None or self._closed)
                record, self._latest = self._latest, None
                if record is None:
                    return
            try:
                write_cursor(self.uri, record)
            except STORAGE_ERRORS as e:  # the next step's record tries again
                logger.warning("could not write the data cursor to %s: %s", self.uri, describe(e))


def _put_whole(fs, target: str, body: bytes) -> None:
    """A file readers see whole or not at all: one PUT on object stores, a rename on local disk."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        fs.pipe_file(target, body)
        return
    fs.makedirs(posixpath.dirname(target), exist_ok=True)
    fs.pipe_file(target + ".tmp", body)
    fs.mv(target + ".tmp", target)


def _read_parts(fs, path: str, meta: dict) -> dict[str, bytes]:
    """The parts, each verified against its sha256; DCP files verified as they stream by, and handed on as their
    directory (the ranks read them)."""
    parts = {}
    for name, expected in meta["files"].items():
        try:
            if name.startswith(DCP + "/"):
                digest, data = file_digest(fs, posixpath.join(path, name))["sha256"], None
            else:
                data = fs.cat_file(posixpath.join(path, name))
                digest = hashlib.sha256(data).hexdigest()
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointError(f"{name} is missing (or not a file)") from None
        if digest != expected["sha256"]:
            raise CheckpointError(f"{name} does not match its sha256 (corrupt)")
        if data is None:
            parts[DCP] = fs.unstrip_protocol(posixpath.join(path, DCP)).encode()
        else:
            deserialize(data, name, device="meta")  # its pickle: a crafted one is refused here, by name
            parts[name] = data
    if DCP in parts:  # its index, read as the ranks will read it: a file that would build anything else is refused
        from etrain.core.sharded_checkpoint import METADATA, read_metadata

        index = f"{DCP}/{METADATA}"
        if index not in meta["files"]:
            raise CheckpointError(f"{COMMIT} lists DCP files but not their index {index}")
        hashed = {posixpath.basename(n) for n in meta["files"] if n.startswith(DCP + "/")}
        with fs.open(posixpath.join(path, index), "rb") as f:
            read_metadata(index, f, hashed)
    return parts


def file_digest(fs, path: str) -> dict:
    """A file's size and sha256, read in chunks: a shard of a large model is never in memory whole."""
    sha, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _read_commit(fs, path: str) -> dict | None:
    """A step directory's commit, checked to be one a save writes; None when it has none (a save in flight, or the
    debris of a crash); CheckpointError naming what is wrong when it has one that is not."""
    try:
        body = fs.cat_file(posixpath.join(path, COMMIT))
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{COMMIT} does not parse as JSON ({e})") from None
    if why := _not_a_commit(meta, posixpath.basename(path.rstrip("/"))):
        raise CheckpointError(f"{COMMIT}: {why}")
    return meta


def _quiet_commit(fs, path: str) -> dict | None:
    """A step directory's commit, or None when it has none or a corrupt one (a look at how far a run got)."""
    try:
        return _read_commit(fs, path)
    except CheckpointError:
        return None


_PART = re.compile(r"(dcp/)?(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]*)")  # a part: in its step directory, or its dcp/
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STEP_DIR = re.compile(r"step-\d{8,}")


def _not_a_commit(meta, directory: str) -> str | None:
    """What makes `meta` something no save writes, or None: the fields a load acts on, each of its type and range,
    and the step the one its directory is named for."""
    if not isinstance(meta, dict):
        return f"holds a {type(meta).__name__}, not an object"
    if meta.get("level") not in ("full", "light"):
        return f"level is {meta.get('level')!r}, not full or light"
    if not _count(meta.get("step")):
        return f"step is {meta.get('step')!r}, not a step number"
    if _STEP_DIR.fullmatch(directory) and f"step-{meta['step']:08d}" != directory:  # one copied aside may be renamed
        return f"step is {meta['step']!r}, not the step of its directory {directory}"
    if "cursor" in meta and not _count(meta["cursor"]):
        return f"cursor is {meta['cursor']!r}, not a whole number of samples >= 0"
    if meta["level"] == "light" and not (
        isinstance(meta.get("base"), str) and _STEP_DIR.fullmatch(meta["base"]) and _count(meta.get("base_step"))
    ):
        return f"base is {meta.get('base')!r}, not a step directory beside it"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a mapping of its parts"
    for name, info in files.items():
        if not _PART.fullmatch(name) or name == DCP:
            return f"names a part {name!r}, which is not a file of its step directory"
        if not (isinstance(info, dict) and _count(info.get("bytes")) and _SHA256.fullmatch(str(info.get("sha256")))):
            return f"part {name} has no size and sha256"
    return None


def _count(value) -> bool:
    """A whole number >= 0 (a JSON bool is not one)."""
    return type(value) is int and value >= 0


def _step_dirs(fs, root: str) -> list[str]:
    """The step directories under `root`, oldest step first (by number: step-100000000 after step-99999999)."""
    if not fs.exists(root):
        return []
    names = [p.rstrip("/") for p in fs.ls(root, detail=False)]
    return sorted((p for p in names if _STEP_DIR.fullmatch(posixpath.basename(p))), key=_step_of)


def _step_of(path: str) -> int:
    return int(posixpath.basename(path)[len("step-") :])
