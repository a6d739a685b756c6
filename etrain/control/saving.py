"""The coordinator's side of checkpoints: which level is due, the one save in flight, its commit, and where
a resume or a rollback lands.

Workers copy their part of the state to CPU and write it on a thread of their own
(etrain/worker/actor.py `checkpoint_begin`); this object remembers the save until every
writer says it is done, then writes the commit marker (etrain/core/checkpoint.py) and
applies retention. A save whose writer fails or is lost is never committed, so a
reader can only ever find the one before it.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StrictBool, ValidationError

from etrain.control.control import JobError, due
from etrain.control.gather import WorkersLost
from etrain.core import checkpoint
from etrain.core.config import Config
from etrain.core.records import Checkpoint, CheckpointFailed, Record
from etrain.core.storage import STORAGE_ERRORS, describe

logger = logging.getLogger(__name__)


@dataclass
class Save:
    path: str
    meta: dict  # the commit, less its files
    writers: list
    started: float
    stall_s: float  # how long the step loop waited for it
    last_full: float  # the saver's last_full before this save began: where it goes back to if the save fails


Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Norms(BaseModel):
    n: NonNegativeInt = 0
    mean: Finite = 0.0
    m2: Finite = 0.0
    streak: NonNegativeInt = 0


class _Balance(BaseModel):
    balanced: StrictBool
    streak: NonNegativeInt
    speeds: list[Annotated[float, Field(gt=0, allow_inf_nan=False)] | None]


class RunState(BaseModel):
    """The run's state a commit carries and the coordinator takes on a resume or rollback (the guards', the
    stepper's, the balancer's, where the data stands): checked before it is acted on, since whoever can write the
    checkpoint can write this file (etrain/control/guards.py, step.py, ppo_step.py, balance.py read it)."""

    model_config = ConfigDict(strict=True)
    config_hash: str
    cursor: NonNegativeInt
    lr_scale: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=False)] = 1.0
    norms: _Norms = _Norms()
    limit_before: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=False)] | None = None
    judged: int | None = None
    kl_coef: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=False)] | None = None
    balance: _Balance | None = None


@dataclass
class RewindPoint:
    """Where a resume or a rollback lands: a committed checkpoint, or the start when there is none."""

    ckpt: checkpoint.Checkpoint | None
    reason: str
    skipped: list[dict] = field(default_factory=list)  # newer committed checkpoints that failed verification

    @property
    def meta(self) -> dict:
        return self.ckpt.meta if self.ckpt is not None else {"step": 0, "cursor": 0, "level": None}


class Saver:
    def __init__(
        self,
        cfg: Config,
        uri: str,
        record: Callable[[Record], None],
        gather: Callable[..., list],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.uri, self._record, self._gather, self._clock = cfg, uri, record, gather, clock
        self.last_full = clock()  # when the last full save began (the run's start before any): checkpoint.every_s
        self.saving: Save | None = None  # one at a time
        self.base: dict | None = None  # the last full checkpoint this run wrote: directory, step, weight hashes
        self.stall = 0.0  # seconds saves held the step loop up since the last step (its record carries them)
        self.last: dict | None = None  # the newest committed checkpoint this run knows: step, level, path
        self.cursor_log = checkpoint.CursorLog(uri)

    def level(self, step: int) -> str | None:
        """The level due after `step`: full (by steps or by the clock; also a light one without a base to complete
        it), light, or none."""
        ck, window = self.cfg.checkpoint, self.cfg.window
        if not self.cfg.outer_step(step):  # DiLoCo: between outer steps each worker holds a model of its own
            return None
        if due(step, ck.every, self.cfg.train.steps, window):
            return "full"
        if ck.every_s and self._clock() - self.last_full >= ck.every_s:
            return "full"
        if ck.light_every and due(step, ck.light_every, 0, window):
            return "light" if self.base is not None else "full"
        return None

    def begin(self, step: int, workers: list, meta: dict) -> None:
        """Have every member stage and write its part of the state at `step`: what that is, its engine says (rank 0
        the weights, the optimizer and the schedule; under ZeRO-1 each rank its optimizer shard, under top-k its
        residuals, under DiLoCo its inner optimizer; in a layout the first replica's ranks their tensors, with DCP;
        the others nothing).
        The step loop waits only for the staging (and for the previous save, if still in flight); synchronous
        saves and the last step's are waited for.
        WorkersLost if a writer is lost before it staged: the step is saved again once the group has recovered."""
        started = time.perf_counter()
        try:
            self.finish()
            level = self.level(step) or "full"
            try:
                path = checkpoint.prepare(self.uri, step)
            except STORAGE_ERRORS as e:  # storage refuses: training goes on, the last good checkpoint stays the last
                return self._failed(step, describe(e))
            meta = {**meta, "level": level, "step": step}
            before = self.last_full
            if level == "full":
                self.last_full = self._clock()
            if level == "light":
                meta |= {"base": self.base["dir"], "base_step": self.base["step"]}
            background = self.cfg.checkpoint.async_save
            hashes = self.base["hashes"] if level == "light" else None
            try:
                writing = self._gather(
                    [w.checkpoint_begin.remote(path, level, hashes, background) for w in workers], workers, "checkpoint"
                )
            except WorkersLost:  # not saved: due again once the group has recovered
                self.last_full = before
                raise
            writers = [w for w, on in zip(workers, writing) if on]
            self.saving = Save(path, meta, writers, started, time.perf_counter() - started, before)
            if not background or step == self.cfg.train.steps:
                self.finish()
        finally:
            self.stall += time.perf_counter() - started

    def observe(self, saving: list[bool]) -> None:
        """A step's reports of whether each writer is still writing: once none is, commit."""
        if self.saving and not any(saving):
            self.finish()

    def finish(self) -> None:
        """Commit the save in flight once every writer has written its part (waiting for them)."""
        if self.saving is None:
            return
        save, self.saving = self.saving, None
        step = save.meta["step"]
        try:
            results = self._gather(
                [w.checkpoint_wait.remote() for w in save.writers], save.writers, f"checkpoint of step {step}"
            )
        except (WorkersLost, JobError) as e:  # lost writers are found again by the next step
            return self._failed(step, e, save)
        if any(r is None for r in results):
            return self._failed(step, "a writer holds no save in progress (it was replaced)", save)
        files = {name: info for r in results for name, info in r["files"].items()}
        try:
            checkpoint.commit(save.path, save.meta, files)
        except STORAGE_ERRORS as e:  # no marker, no checkpoint: readers still find the one before
            return self._failed(step, describe(e), save)
        if save.meta["level"] == "full":
            self.base = {"dir": posixpath.basename(save.path.rstrip("/")), "step": step, "hashes": results[0]["hashes"]}
        record = Checkpoint(
            step,
            save.meta["level"],
            save.path,
            sum(f["bytes"] for f in files.values()),
            save.stall_s,
            time.perf_counter() - save.started,
        )
        try:
            checkpoint.retain(self.uri, self.cfg.checkpoint.keep, upto=step)
        except STORAGE_ERRORS as e:  # the save stands; older checkpoints stay until a later retention succeeds
            logger.warning("checkpoint at step %d: removing older checkpoints failed: %s", step, describe(e))
            record.retain_error = describe(e)
        self.last = {"step": step, "level": save.meta["level"], "path": save.path}
        self._record(record)

    def rewound(self, point: RewindPoint) -> None:
        """The run went back to `point`: the next save is a full one (a light one needs hashes of a base this run
        wrote), and the checkpoint gone back to is the newest this run has."""
        self.base = None
        if point.ckpt is not None:
            self.last = {"step": point.meta["step"], "level": point.meta["level"], "path": point.ckpt.path}

    def _failed(self, step: int, why, save: Save | None = None) -> None:
        if save is not None:  # the wall-clock cadence counts from the last save that was written
            self.last_full = save.last_full
        logger.warning("checkpoint at step %d was not written: %s", step, why)
        self._record(CheckpointFailed(step, str(why)[:500]))
        if step == self.cfg.train.steps:
            raise JobError(f"the final checkpoint could not be written to {self.uri}: {why}")

    def stepped(self, step: int, cursor: int, batch: int) -> None:
        """The cursor level: the step just committed and the data cursor after it."""
        self.cursor_log.update({"step": step, "cursor": cursor, "batch": batch, "time": time.time()})

    def latest(self, config_hash: str) -> checkpoint.Checkpoint | None:
        """The newest good checkpoint (after committing the one in flight: it holds a good step); newer ones that
        fail verification are named in its `skipped`, and CheckpointsCorrupt when none verifies."""
        self.finish()
        ckpt = checkpoint.load_latest(self.uri, accept=self._reachable)
        if ckpt is not None and "exported_from" in ckpt.meta:
            raise JobError(
                f"{ckpt.path} is an export of {ckpt.meta['exported_from']} (weights only), not a run's checkpoint: "
                "it cannot be resumed; fine-tune from it with `etrain finetune --from`"
            )
        if ckpt is not None and ckpt.meta["config_hash"] != config_hash:
            raise JobError(
                f"checkpoint {ckpt.path} was made by a different model/data/optimizer config; resume with the run's "
                "own config"
            )
        return ckpt

    def _reachable(self, meta: dict) -> str | None:
        """What is wrong with a commit's run state for this run, if anything: each field the coordinator reads of
        it (RunState) of its type and range, and a data cursor its steps could have reached."""
        try:
            RunState.model_validate(meta)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            return f"{field} is {err.get('input')!r}: {err['msg'][0].lower()}{err['msg'][1:]}"
        most = meta["step"] * self.cfg.most_per_step()
        if meta["cursor"] > most:
            return f"cursor is {meta['cursor']}, more than {meta['step']} steps of this run take (at most {most})"
        return None

    def resume_point(self, config_hash: str, restart_if_corrupt: bool = False) -> RewindPoint:
        """Where a resume lands: the newest checkpoint that verifies, or the start when none is committed. When some
        are and none verifies, CheckpointsCorrupt (exit 2), unless `restart_if_corrupt`: then the start."""
        try:
            ckpt = self.latest(config_hash)
        except checkpoint.CheckpointsCorrupt as e:
            if not restart_if_corrupt:
                raise checkpoint.CheckpointsCorrupt(
                    f"{e}; nothing was trained. Restore the files from a copy and resume again, or train the run "
                    "from step 0 with `etrain train --resume RUN --restart-if-corrupt` (the corrupt checkpoints stay "
                    "until newer saves replace them)",
                    e.skipped,
                ) from None
            return RewindPoint(None, "no checkpoint verifies: from the start (--restart-if-corrupt)", e.skipped)
        if ckpt is None:
            return RewindPoint(None, f"no committed checkpoint under {self.uri}: from the start")
        return RewindPoint(ckpt, _newest(ckpt), ckpt.skipped)

    def rollback_point(self, config_hash: str, why: str, resume_hint: str) -> RewindPoint:
        """The last committed checkpoint that verifies, which `why` (a lost ZeRO-1 shard, a non-finite gradient)
        needs."""
        try:
            ckpt = self.latest(config_hash)
        except checkpoint.CheckpointsCorrupt as e:
            raise JobError(f"{why} needs a checkpoint to go back to, and {e}; {resume_hint}") from None
        if ckpt is None:
            raise JobError(
                f"{why} needs a checkpoint to go back to, and there is none under {self.uri} yet; set checkpoint.every "
                f"lower, then {resume_hint}"
            )
        return RewindPoint(ckpt, _newest(ckpt), ckpt.skipped)

    def reached(self) -> int | None:
        """The last step the run committed, from the cursor level."""
        return (checkpoint.read_cursor(self.uri) or {}).get("step")

    def close(self) -> None:
        self.cursor_log.close(self.cfg.timeouts.close_s)


def _newest(ckpt: checkpoint.Checkpoint) -> str:
    """The reason a rewind gives for landing on `ckpt`: the newest committed checkpoint, or the newest that verifies
    and which it skipped."""
    if not ckpt.skipped:
        return "the newest committed checkpoint"
    named = ", ".join(posixpath.basename(s["path"].rstrip("/")) for s in ckpt.skipped)
    return f"the newest checkpoint that verifies ({named} skipped: corrupt)"
