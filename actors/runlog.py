"""The run's log: each record goes to `metrics.jsonl`, the Ray dashboard and the driver's poll at the same
moment, so the three never disagree; `status.json`, the ETA and `summary.json` are made from it.

Records are written by the one owner of the run: once the run's lease (app/core/lease.py) has
been taken over by another driver, not one more line is written and the job stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from actors.control import JobError, State
from actors.dashboard import Dashboard
from app.core.config import Config
from app.core.lease import Keeper, Lease
from app.core.records import Record, append_jsonl, eta_s, read_jsonl, summarize, truncate_after, write_json

log = logging.getLogger(__name__)

PACE_STEPS = 20  # the ETA's pace: the last this many steps
STATUS_S = 1.0  # status.json is rewritten at most this often while records come, and at most this late after one
HEARTBEAT_S = 5.0  # and at least this often between records (a long evaluation): `etrain status` sees it alive


class RunLog:
    def __init__(self, run_dir: Path, cfg: Config, started_at: float, lease: Lease, status: Callable[[], dict]):
        self.run_dir, self.cfg, self.started_at, self.status = run_dir, cfg, started_at, status
        self.keeper = Keeper(lease)  # renewed where the records are written: a frozen driver keeps the run
        self.dashboard = Dashboard(run_dir.name, cfg.parallel.ranks)
        self.phase, self.failure = State.STARTING, None  # why the job failed, once it has
        self.first_step_at: float | None = None
        self.latest: dict[str, dict] = {}  # the last record of each kind (status shows them)
        self._events: list[dict] = []  # for the driver's next poll
        self._commits: deque = deque(maxlen=PACE_STEPS)
        self._lock = threading.Lock()
        self._status_due = 0.0
        self._written_at = 0.0
        self._behind = False  # a record came since status.json was written
        self._stopped = threading.Event()
        self._writing = threading.Lock()

    def start(self) -> None:
        """status.json from now on: at once, within STATUS_S of every record, and every HEARTBEAT_S between them."""
        self.write_status()
        threading.Thread(target=self._heartbeat, name="status", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stopped.wait(STATUS_S):
            if not self._behind and time.monotonic() < self._written_at + HEARTBEAT_S:
                continue
            try:
                self.write_status()
            except Exception as e:  # read while the loop changes it: the next beat, or the next record, writes it
                log.debug("status.json not written this beat: %s", e)

    def record(self, record: Record) -> None:
        if self.keeper.lost:  # another driver owns the run now
            raise JobError(self.keeper.lost)
        data = record.as_dict()
        append_jsonl(self.run_dir / "metrics.jsonl", data)
        self.dashboard.publish(data)
        with self._lock:
            self._events.append(data)
            self.latest[data["kind"]] = data
            if data["kind"] == "train":
                self._commits.append(time.monotonic())
                self.first_step_at = self.first_step_at or data["time"]
        self._behind = True
        if time.monotonic() >= self._status_due:
            self.write_status()

    def poll(self) -> tuple[str, list[dict]]:
        """The phase and the records written since the last poll."""
        with self._lock:
            events, self._events = self._events, []
        return self.phase.value, events

    def eta(self, steps_left: int) -> float | None:
        with self._lock:
            return eta_s(list(self._commits), steps_left)

    def recorded(self, kind: str, step: int) -> bool:
        """Whether metrics.jsonl holds a record of `kind` at `step` (from this session or an earlier one)."""
        return any(r["kind"] == kind and r["step"] == step for r in read_jsonl(self.run_dir / "metrics.jsonl"))

    def history(self, kind: str) -> list[dict]:
        """Every record of `kind` the run has written, those of steps a resume or rollback redid included."""
        files = ("metrics.redone.jsonl", "metrics.jsonl")
        return [r for name in files for r in read_jsonl(self.run_dir / name) if r["kind"] == kind]

    def rewind(self, step: int) -> int:
        """The records of the steps after `step` go aside (metrics.redone.jsonl): they are redone. How many."""
        return truncate_after(self.run_dir / "metrics.jsonl", step)

    def write_status(self) -> None:
        """status.json: what `etrain status RUN` reads without Ray, also after the job has ended."""
        if self.keeper.lost:  # the run's new owner writes it
            return
        with self._writing:  # the heartbeat's and the loop's: one at a time, each with the state as it is then
            self._behind = False
            write_json(self.run_dir / "status.json", {**self.status(), "updated": time.time()})
            self._written_at = time.monotonic()
        self._status_due = self._written_at + STATUS_S

    def summary(self) -> dict:
        summary = summarize(self.run_dir / "metrics.jsonl", self.cfg, self.started_at, self.first_step_at)
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def close(self) -> None:
        self._stopped.set()
        self.keeper.stop()
