"""One spec per training mode, looked up once from the config by both sides of a run: the worker builds the mode's
engine, the coordinator its stepper, and both act on the spec's policies. Besides the config's own validation, this
is the one place that reads which mode a run trains in (comm.mode, ppo.reward, the layout): a new mode
is one more spec here, one engine (etrain/worker/) and, if its steps differ, one stepper (etrain/control/).

Engines and steppers are named by import path, and loaded by the side that runs them: the coordinator never
imports a worker's engine (nor torch with it), the worker never the coordinator's stepper.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    engine: str  # the worker's engine, "module:Class" (etrain/worker/)
    stepper: str  # the coordinator's stepper, "module:Class" (etrain/control/): what one step is, and evaluations
    own_loop: bool = False  # the stepper drives the run itself (no step barrier: parameter-server mode)
    judged: bool = True  # the outlier guard judges each step by the group's gradient norm (DiLoCo's are each its own)
    sends_ahead: bool = False  # step n + 1 may go to the workers before step n's reports are back
    splits_by_speed: bool = False  # a step's samples are split by each member's measured speed (one rank a replica)
    resizable: bool = True  # `etrain scale` and the autoscaler may change its members
    rolls_back: str | None = None  # why any lost member sends the run back to its checkpoint (None: only when no
    # whole replica is left)
    start_checkpoint: bool = False  # saves one at the start: something to go back to before the first save
    placed_state: bool = False  # a member's state is its place's part of a replica (a layout's rank): it moves once
    # the new group has formed (from a twin, or the checkpoint), not before, as a whole model's does

    def load_engine(self) -> type:
        return _load(self.engine)

    def load_stepper(self) -> type:
        return _load(self.stepper)


WORKER, STEPS = "etrain.worker", "etrain.control.step:Stepper"
MODES = {
    mode.name: mode
    for mode in (
        Mode(
            "data_parallel", "etrain.worker.data_parallel:DataParallel", STEPS, sends_ahead=True, splits_by_speed=True
        ),
        Mode("laid_out", f"{WORKER}.laid_out:LaidOut", STEPS, start_checkpoint=True, placed_state=True),
        Mode("diloco", f"{WORKER}.diloco:Diloco", STEPS, judged=False, splits_by_speed=True),
        Mode(
            "ppo",
            f"{WORKER}.rollout:Rollouts",
            "etrain.control.ppo_step:PPOStepper",
            rolls_back="a worker lost in a PPO step",
            start_checkpoint=True,
        ),
        Mode(
            "param_server",
            f"{WORKER}.param_server:ParamServer",
            "etrain.control.ps_mode:PSTraining",
            own_loop=True,
            resizable=False,
        ),
    )
}


def mode_of(cfg) -> Mode:
    """The mode `cfg` trains in (the config's validation has refused the combinations no mode takes)."""
    if cfg.comm.mode == "ps":
        return MODES["param_server"]
    if cfg.ppo.reward:
        return MODES["ppo"]
    if cfg.parallel.ranks > 1:
        return MODES["laid_out"]
    if cfg.comm.mode == "diloco":
        return MODES["diloco"]
    return MODES["data_parallel"]  # ZeRO-1 (comm.zero) is an option of the data-parallel engines, as compression is


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
