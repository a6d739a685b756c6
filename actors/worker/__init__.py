"""The training worker (actor.py) and its engines, one per mode of training (engine.py)."""

from actors.worker.actor import TrainWorker, assemble, spawn, step_seed

__all__ = ["TrainWorker", "assemble", "spawn", "step_seed"]
