"""What the driver shows while a job runs: a bar in a terminal or a notebook, one line per interval elsewhere.

A bar redrawn in place is right where a person watches; in `ray job logs` or a file every redraw
is a line, and a bar's ETA, taken from its own refreshes, says nothing true. So off a terminal the
progress is a plain line every `every` seconds with the step, loss, throughput and an ETA at the pace
of the recent steps. Events (evaluations, membership changes, warnings) are lines in both. All of it
goes to stderr: stdout carries only the summary, which scripts parse.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from etrain.core.records import eta_s

PACE_STEPS = 20  # the ETA's pace: the last this many steps


def in_notebook() -> bool:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return type(shell).__name__ == "ZMQInteractiveShell"


class Progress:
    def __init__(self, total: int, enabled: bool = True, every: float = 30.0):
        self.total, self.enabled, self.every = total, enabled, every
        self.bar = None
        if enabled and (sys.stderr.isatty() or in_notebook()):
            from tqdm.auto import tqdm  # a widget in a notebook: one output that updates, not a line per refresh

            self.bar = tqdm(total=total, unit="step", desc="starting", dynamic_ncols=True, file=sys.stderr)
        self.commits: deque = deque(maxlen=PACE_STEPS)  # when the last steps committed
        self.started = time.monotonic()
        self.next_line = self.started + every
        self.last: dict | None = None
        self.printed: int | None = None  # the step of the last line printed
        self._phase = "starting"

    def phase(self, phase: str) -> None:
        if phase != self._phase and self.bar is not None:
            self.bar.set_description(phase, refresh=False)
        self._phase = phase

    def step(self, record: dict) -> None:
        """A committed step's train record."""
        self.commits.append(time.monotonic())
        self.last = record
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)
            if record.get("loss") is not None:
                self.bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    world=record["world_size"],
                    refresh=False,
                )
        elif self.enabled and time.monotonic() >= self.next_line:
            self._line()

    def rewind(self, step: int) -> None:
        """A resume or rollback: the count goes back to `step`."""
        self.commits.clear()
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def event(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.last is not None and self.last["step"] != self.printed:
            self._line()  # the last step's line, unless an interval's line just said it

    def _line(self) -> None:
        from tqdm import tqdm

        r = self.last
        eta = eta_s(list(self.commits), self.total - r["step"])
        loss = f"loss {r['loss']:.4f}  " if r.get("loss") is not None else ""
        speed = f"tokens/s {r['tokens_per_s']:,.0f}  " if r.get("tokens_per_s") else ""
        print(
            f"step {r['step']}/{self.total} ({r['step'] / self.total:.0%})  {loss}{speed}workers {r['world_size']}  "
            f"elapsed {tqdm.format_interval(time.monotonic() - self.started)}  ETA "
            f"{tqdm.format_interval(eta) if eta is not None else '-'}",
            file=sys.stderr,
            flush=True,
        )
        self.next_line = time.monotonic() + self.every
        self.printed = r["step"]
