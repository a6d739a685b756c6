"""One owner per run: a lease beside the run's checkpoints, renewed while the run's coordinator lives.

Two drivers on one run (a `--resume` of a run that is still going, from this host or
another) would interleave their records and overwrite each other's checkpoints. The lease
is `lease.json` in the checkpoint root (RUN/checkpoints, or `checkpoint.uri`: the place two
hosts share), naming its owner: host, driver pid, when it was taken and last renewed.

Taking, renewing and taking over are compare-and-swap writes, so two takers never both win:
on S3 a conditional PUT (If-None-Match: * to create, If-Match: the ETag read to replace); on
local disk a version check and a rename under an exclusive flock. Other stores get a plain
write (the lease is then advisory, and says so). A lease is stale when it has not been
renewed for its `ttl_s` (`timeouts.lease_s`), or at once when its owner ran on this host and
its process is gone (a killed driver): a stale lease is taken over with a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import fsspec

from etrain.core.config import ConfigError
from etrain.core.storage import STORAGE_ERRORS, StorageError, describe

logger = logging.getLogger(__name__)

LEASE = "lease.json"


class RunBusy(ConfigError):
    """Another live driver owns the run."""


class LeaseLost(RuntimeError):
    """Another driver took the run over (this one was taken for gone)."""


@dataclass
class Lease:
    path: str  # the lease file's URI
    owner: dict  # host, pid, token, run, started, renewed, ttl_s
    version: str | None = field(default=None)  # what the next swap expects to replace: ETag, or sha256 of the file


def acquire(root: str, run: str, ttl_s: float) -> Lease:
    """The run's lease, or RunBusy naming the live owner. A stale lease is taken over with a warning."""
    path = posixpath.join(root.rstrip("/"), LEASE)
    try:
        return _take(path, run, ttl_s)
    except STORAGE_ERRORS as e:
        raise StorageError(
            f"cannot take the run's lease {path}: {describe(e)}; the checkpoint location (checkpoint.uri, "
            f"default RUN/checkpoints) must be reachable and writable"
        ) from None


def _take(path: str, run: str, ttl_s: float) -> Lease:
    for _ in range(3):  # another taker swapped first: look again
        held, version = _read(path)
        if held is not None and not _stale(held):
            age = time.time() - held["renewed"]
            raise RunBusy(
                f"run {held.get('run', run)!r} is being trained by host {held['host']} pid {held['pid']} "
                f"(its lease {path} was renewed {age:.0f} s ago); stop that driver first, or, if its host is gone, "
                f"wait {max(0.0, held['ttl_s'] - age):.0f} s more for the lease to go stale"
            )
        if held is not None:
            logger.warning(
                "taking over the stale lease of host %s pid %s on run %s (renewed %.0f s ago)",
                held["host"],
                held["pid"],
                run,
                time.time() - held["renewed"],
            )
        now = time.time()
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": uuid.uuid4().hex,
            "run": run,
            "started": now,
            "renewed": now,
            "ttl_s": ttl_s,
        }
        try:
            return Lease(path, owner, _swap(path, owner, version))
        except _Conflict:
            continue
    raise RunBusy(f"run {run!r}: another driver is taking its lease {path} at this moment; try again")


def renew(lease: Lease) -> None:
    """Mark the lease as alive now; LeaseLost if another driver has taken it over since."""
    owner = {**lease.owner, "renewed": time.time()}
    try:
        lease.version = _swap(lease.path, owner, lease.version)
    except _Conflict:
        held, _ = _read(lease.path)
        by = f"host {held['host']} pid {held['pid']}" if held else "nobody (the lease file is gone)"
        raise LeaseLost(
            f"the run's lease {lease.path} is now held by {by}: another driver took the run over while this one was "
            "taken for gone; this driver stops"
        ) from None
    lease.owner = owner


def release(lease: Lease) -> None:
    """Give the run up, if the lease is still ours (best effort: a leftover lease goes stale anyway)."""
    try:
        held, _ = _read(lease.path)
        if held is not None and held.get("token") == lease.owner["token"]:
            fs, p = fsspec.core.url_to_fs(lease.path)
            fs.rm(p)
    except STORAGE_ERRORS as e:
        logger.warning(
            "could not release the run's lease %s: %s (it goes stale in %.0f s)",
            lease.path,
            describe(e),
            lease.owner["ttl_s"],
        )


class Keeper:
    """Renews a lease on a thread of its own, so a long step never lets it go stale.
    `lost` says why the run must stop once another driver has taken it over."""

    def __init__(self, lease: Lease):
        self.lease, self.lost = lease, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        every = self.lease.owner["ttl_s"] / 4
        while not self._stop.wait(every):
            try:
                renew(self.lease)
            except LeaseLost as e:
                self.lost = str(e)
                return
            except STORAGE_ERRORS as e:  # tried again next time; a lease not renewed for ttl_s goes stale
                logger.warning("could not renew the run's lease %s: %s", self.lease.path, describe(e))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale(owner: dict) -> bool:
    if owner["host"] == socket.gethostname() and not pid_alive(owner["pid"]):
        return True
    return time.time() - owner["renewed"] > owner["ttl_s"]


class _Conflict(Exception):
    """The lease changed since it was read."""


def _read(path: str) -> tuple[dict | None, str | None]:
    """The lease and its version (None, None when there is none). The version is read first, so a
    swap based on what was read fails if the lease changed in between."""
    fs, p = fsspec.core.url_to_fs(path)
    fs.invalidate_cache(posixpath.dirname(p))
    try:
        version = fs.info(p).get("ETag") if _is_s3(fs) else None
        body = fs.cat_file(p)
    except FileNotFoundError:
        return None, None
    try:
        owner = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        owner = None
    if not isinstance(owner, dict) or not {"host", "pid", "renewed", "ttl_s"} <= set(owner):
        owner = {"host": "?", "pid": -1, "renewed": 0.0, "ttl_s": 0.0}  # unreadable: stale, taken over
    return owner, version if _is_s3(fs) else hashlib.sha256(body).hexdigest()


def _swap(path: str, owner: dict, version: str | None) -> str | None:
    """Write `owner` if the lease is still at `version` (None: absent); its new version. _Conflict otherwise."""
    fs, p = fsspec.core.url_to_fs(path)
    body = json.dumps(owner, indent=1).encode()
    if _is_s3(fs):
        try:
            out = fs.pipe_file(p, body, mode="create") if version is None else fs.pipe_file(p, body, IfMatch=version)
        except FileExistsError:
            raise _Conflict from None
        except OSError as e:
            if "PreconditionFailed" in repr(e.__cause__) or "pre-condition" in str(e):
                raise _Conflict from None
            raise
        return out["ETag"]
    if _is_local(fs):
        fs.makedirs(posixpath.dirname(p), exist_ok=True)
        directory = os.open(posixpath.dirname(p), os.O_RDONLY)  # the lock: its directory, held for the swap
        try:
            fcntl.flock(directory, fcntl.LOCK_EX)
            current = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
            if current != version:
                raise _Conflict
            tmp = f"{p}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, p)
        finally:
            os.close(directory)
        return hashlib.sha256(body).hexdigest()
    logger.warning("%s has no conditional writes here: the run's lease is advisory", path)
    fs.pipe_file(p, body)
    return hashlib.sha256(body).hexdigest()


def _is_s3(fs) -> bool:
    return bool({"s3", "s3a"} & set(_protocols(fs)))


def _is_local(fs) -> bool:
    return bool({"file", "local"} & set(_protocols(fs)))


def _protocols(fs) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
