"""status.json: where the run stands, for `etrain status RUN` without Ray and after the job has ended. The
coordinator assembles it (`Coordinator.status`); this thread writes it within STATUS_S of a record and every
HEARTBEAT_S between records (a long evaluation), so a live run never reads as a dead one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from etrain.control.runlog import RunLog
from etrain.core.records import write_json

logger = logging.getLogger(__name__)

STATUS_S = 1.0  # status.json is at most this late after a record
HEARTBEAT_S = 5.0  # and rewritten at least this often between records


class StatusFile:
    def __init__(self, run_dir: Path, status: Callable[[], dict], log: RunLog):
        self.path, self.status, self.log = run_dir / "status.json", status, log
        self._written = (-1, 0.0)  # (records written then, when)
        self._stopped = threading.Event()
        self._writing = threading.Lock()

    def start(self) -> None:
        self.write()
        threading.Thread(target=self._beat, name="status", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(STATUS_S):
            count, at = self._written
            if count == self.log.records_written and time.monotonic() < at + HEARTBEAT_S:
                continue
            try:
                self.write()
            except Exception as e:  # read while the loop changes it: the next beat writes it
                logger.debug("status.json not written this beat: %s", e)

    def write(self) -> None:
        if self.log.keeper.lost:  # the run's new owner writes it
            return
        with self._writing:  # the beat's and the loop's last: one at a time, each with the state as it is then
            count = self.log.records_written
            write_json(self.path, {**self.status(), "updated": time.time()})
            self._written = (count, time.monotonic())

    def close(self) -> None:
        self._stopped.set()
