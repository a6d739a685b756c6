"""Where the last outer step left the run (DiLoCo's windows on the coordinator's side): the position a change of
members between outer steps goes back to. Outside DiLoCo every step is an outer step, and this is the position."""

from __future__ import annotations

from dataclasses import replace

from etrain.control.step import Position
from etrain.core.config import Config


class OuterSteps:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.start = Position()  # the last outer step and the cursor after it

    def stepped(self, at: Position) -> None:
        """The run is at `at` after a step."""
        if self.cfg.outer_step(at.step):
            self.start = replace(at)

    def landed(self, at: Position) -> None:
        """A resume or a rollback put the run at `at`: every worker loaded one state there, which starts a window
        (a checkpoint of another mode may lie between two outer steps of this one)."""
        self.start = replace(at)
