"""The run's log: each record goes to `metrics.jsonl`, the Ray dashboard and the driver's poll at the same
moment, so the three never disagree; the ETA and `summary.json` are made from it.

Records are written by the one owner of the run: once the run's lease (etrain/core/lease.py) has
been taken over by another driver, not one more line is written and the job stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path

from etrain.control.control import JobError
from etrain.control.dashboard import Dashboard
from etrain.core.config import Config
from etrain.core.lease import Keeper, Lease
from etrain.core.records import Record, append_jsonl, eta_s, read_jsonl, summarize, truncate_after, write_json

logger = logging.getLogger(__name__)

PACE_STEPS = 20  # the ETA's pace: the last this many steps


class RunLog:
    def __init__(self, run_dir: Path, cfg: Config, started_at: float, lease: Lease):
        self.run_dir, self.cfg, self.started_at = run_dir, cfg, started_at
        self.keeper = Keeper(lease)  # renewed where the records are written: a frozen driver keeps the run
        self.dashboard = Dashboard(run_dir.name, cfg.parallel)
        self.records_written = 0
        self.first_step_at: float | None = None
        self.latest: dict[str, dict] = {}  # the last record of each kind (status shows them)
        self._events: list[dict] = []  # for the driver's next poll
        self._commits: deque = deque(maxlen=PACE_STEPS)
        # the last train records, for status's communication advice: DiLoCo's bytes come once a window, so two
        self.recent: deque = deque(maxlen=max(PACE_STEPS, 2 * cfg.window))
        self._lock = threading.Lock()

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
                self.recent.append(data)
                self.first_step_at = self.first_step_at or data["time"]
        self.records_written += 1

    def poll(self) -> list[dict]:
        """The records written since the last poll."""
        with self._lock:
            events, self._events = self._events, []
        return events

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

    def summary(self) -> dict:
        summary = summarize(self.run_dir / "metrics.jsonl", self.cfg, self.started_at, self.first_step_at)
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def close(self) -> None:
        self.keeper.stop()
