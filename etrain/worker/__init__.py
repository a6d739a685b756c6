"""The training worker (actor.py) and its engines, one per mode of training (engine.py).

The actor's names are imported on first use: the engines and a step's compute (compute.py) run without Ray
(bench/gpu.py), and importing them must not bring it."""

__all__ = ["TrainWorker", "assemble", "spawn", "step_seed"]


def __getattr__(name: str):
    if name in __all__:
        from etrain.worker import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'etrain.worker' has no attribute {name!r}")
