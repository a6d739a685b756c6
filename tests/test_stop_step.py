"""A step the coordinator stops (a member of it lost: control/gather.py's `stop`) ends before its next micro-batch,
and a late stop does not end the group's redo of that step, which is another generation's (etrain/worker/engine.py
`stopped`). Generations, steps and where the stop falls are drawn from a printed seed."""

from __future__ import annotations

import random

import pytest
import torch

from etrain.core.config import load_config
from etrain.worker.data_parallel import DataParallel
from etrain.worker.engine import StepStopped
from etrain.worker.injection import Injected


@pytest.fixture
def engine():
    cfg = load_config("tiny", ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
                               "train.global_batch=8", "train.micro_batch=2"])  # fmt: skip
    e = DataParallel(cfg, torch.device("cpu"))
    e.join(0, 1)
    return e


def rows(engine) -> torch.Tensor:
    return torch.randint(0, 256, (8, engine.cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(0))


def micro_batches_run(engine, stop_after: int | None) -> int:
    """The micro-batches that ran a forward; the stop arriving (from the control thread) after `stop_after` of them."""
    ran = []
    forward = engine.model.forward

    def counted(*args, **kwargs):
        ran.append(1)
        if stop_after is not None and len(ran) == stop_after:
            engine.stopped = (engine.generation, engine.stepping)
        return forward(*args, **kwargs)

    engine.model.forward = counted
    try:
        engine.forward_backward(rows(engine), 8, Injected())
    except StepStopped:
        pass
    finally:
        del engine.model.forward
    return len(ran)


def test_a_stopped_step_ends_at_its_next_micro_batch_and_its_redo_runs(engine):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    engine.generation, engine.stepping = rng.randrange(1, 50), rng.randrange(1, 1000)
    stop_after = rng.randrange(1, 4)  # of the 4 micro-batches: the last one's all-reduce is where a lost peer fails
    assert micro_batches_run(engine, stop_after) == stop_after
    with pytest.raises(StepStopped, match=f"step {engine.stepping}"):  # stopped before it began: no micro-batch
        engine.forward_backward(rows(engine), 8, Injected())
    engine.generation += 1  # the recovery's group redoes the step: the stop was the old group's
    assert micro_batches_run(engine, None) == 4
    engine.generation, engine.stepping = engine.generation - 1, engine.stepping + 1  # another step: not stopped
    assert micro_batches_run(engine, None) == 4
