"""The coordinator's side of checkpoints: which level is due, the one save in flight, its commit.

Workers copy their part of the state to CPU and write it on a thread of their own
(actors/worker.py `checkpoint_begin`); this object remembers the save until every
writer says it is done, then writes the commit marker (app/checkpoint.py) and
applies retention. A save whose writer fails or is lost is never committed, so a
reader can only ever find the one before it.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from actors.control import JobError
from app.core import checkpoint
from app.core.config import Config
from app.core.storage import STORAGE_ERRORS, describe

log = logging.getLogger(__name__)


@dataclass
class Save:
    path: str
    meta: dict  # the commit, less its files
    writers: list
    started: float
    stall_s: float  # how long the step loop waited for it


class Saver:
    def __init__(self, cfg: Config, uri: str, record: Callable[[dict], None]):
        self.cfg, self.uri, self._record = cfg, uri, record
        self.saving: Save | None = None  # one at a time
        self.base: dict | None = None  # the last full checkpoint this run wrote: directory, step, weight hashes
        self.cursor_log = checkpoint.CursorLog(uri)

    def level(self, step: int) -> str | None:
        """The level due after `step`: full (also a light one without a base to complete it), light, or none."""
        ck = self.cfg.checkpoint
        if step == self.cfg.train.steps or (ck.every > 0 and step % ck.every == 0):
            return "full"
        if ck.light_every and step % ck.light_every == 0:
            return "light" if self.base is not None else "full"
        return None

    def begin(self, step: int, workers: list, sharded: bool, meta: dict, gather: Callable[[list, str], list | None]) -> bool:
        """Have the writers stage and write their parts of the state at `step`: every rank its optimizer
        shard under ZeRO-1 (full saves), else rank 0 alone. The step loop waits only for the staging (and
        for the previous save, if still in flight); synchronous saves and the last step's are waited for.
        False if a writer was lost (`gather` gives None): the step is saved again once the group has recovered."""
        started = time.perf_counter()
        self.finish()
        level = self.level(step) or "full"
        writers = workers if sharded and level == "full" else workers[:1]
        try:
            path = checkpoint.prepare(self.uri, step)
        except STORAGE_ERRORS as e:  # storage refuses: training goes on, the last good checkpoint stays the last
            self._failed(step, describe(e))
            return True
        meta = {**meta, "level": level, "step": step}
        if level == "light":
            meta |= {"base": self.base["dir"], "base_step": self.base["step"]}
        background = self.cfg.checkpoint.async_save
        hashes = self.base["hashes"] if level == "light" else None
        if gather([w.checkpoint_begin.remote(path, level, hashes, background) for w in writers], "checkpoint") is None:
            log.warning("checkpoint at step %d: a writer was lost before it staged its part; saving again after recovery", step)
            return False
        self.saving = Save(path, meta, writers, started, time.perf_counter() - started)
        if not background or step == self.cfg.train.steps:
            self.finish()
        return True

    def observe(self, results: list[dict]) -> None:
        """A step's results: once no writer is still writing, commit."""
        if self.saving and not any(r["saving"] for r in results):
            self.finish()

    def finish(self) -> None:
        """Commit the save in flight once every writer has written its part (waiting for them)."""
        if self.saving is None:
            return
        save, self.saving = self.saving, None
        step = save.meta["step"]
        try:
            results = ray.get([w.checkpoint_wait.remote() for w in save.writers], timeout=self.cfg.timeouts.step_s)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:
            return self._failed(step, getattr(e, "cause", None) or e)
        if any(r is None for r in results):
            return self._failed(step, "a writer holds no save in progress (it was replaced)")
        files = {name: info for r in results for name, info in r["files"].items()}
        try:
            checkpoint.commit(save.path, save.meta, files)
        except STORAGE_ERRORS as e:  # no marker, no checkpoint: readers still find the one before
            return self._failed(step, describe(e))
        if save.meta["level"] == "full":
            self.base = {"dir": posixpath.basename(save.path.rstrip("/")), "step": step, "hashes": results[0]["hashes"]}
        record = {
            "kind": "checkpoint",
            "level": save.meta["level"],
            "step": step,
            "path": save.path,
            "bytes": sum(f["bytes"] for f in files.values()),
            "stall_s": save.stall_s,
            "save_s": time.perf_counter() - save.started,
            "time": time.time(),
        }
        try:
            checkpoint.retain(self.uri, self.cfg.checkpoint.keep)
        except STORAGE_ERRORS as e:  # the save stands; older checkpoints stay until a later retention succeeds
            log.warning("checkpoint at step %d: removing older checkpoints failed: %s", step, describe(e))
            record["retain_error"] = describe(e)
        self._record(record)

    def _failed(self, step: int, why) -> None:
        log.warning("checkpoint at step %d was not written: %s", step, why)
        self._record({"kind": "checkpoint_failed", "step": step, "error": str(why)[:500], "time": time.time()})
        if step == self.cfg.train.steps:
            raise JobError(f"the final checkpoint could not be written to {self.uri}: {why}")

    def stepped(self, record: dict) -> None:
        """The cursor level: the step just committed and the data cursor after it."""
        self.cursor_log.update(record)

    def latest(self, config_hash: str) -> checkpoint.Checkpoint | None:
        """The newest good checkpoint (after committing the one in flight: it holds a good step)."""
        self.finish()
        ckpt = checkpoint.load_latest(self.uri)
        if ckpt is not None and ckpt.meta["config_hash"] != config_hash:
            raise JobError(f"checkpoint {ckpt.path} was made by a different model/data/optimizer config; resume with the run's own config")
        return ckpt

    def reached(self) -> int | None:
        """The last step the run committed, from the cursor level."""
        return (checkpoint.read_cursor(self.uri) or {}).get("step")

    def close(self) -> None:
        self.cursor_log.close()
