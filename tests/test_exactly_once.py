"""Exactly once under any history of resizes and restarts (property test).

The coordinator commits a step by advancing its Position by the step's batch (etrain/control/step.py),
plans who reads what with `order.plan_step` at that cursor, and a restart rewinds the Position to
the last checkpoint's (the steps after it are redone: their updates were lost with the crash).
This drives that code, with the batch of the world size at each step (`Config.batch_at`, under
both batch scalings). Whatever the history, the committed steps must read every sample of an
epoch exactly once, in the same global order.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from etrain.control.step import Position
from etrain.core.config import load_config
from etrain.data import order

events = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 3)),  # steps at the current world size
        st.tuples(st.just("resize"), st.integers(1, 8)),
        st.tuples(st.just("speeds"), st.lists(st.floats(0.2, 5.0), min_size=1, max_size=8)),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    block=st.integers(1, 3),
    batch=st.integers(8, 24),
    linear=st.booleans(),
    checkpoint_every=st.integers(1, 5),
    history=events,
)
def test_every_sample_once_per_epoch(sizes, block, batch, linear, checkpoint_every, history):
    scaling = f"train.batch_scaling={'linear' if linear else 'constant'}"
    cfg = load_config("tiny", [f"train.global_batch={batch - batch % 2 if linear else batch}", scaling])
    layout = order.Layout(seed=7, sizes=tuple(sizes), block=block)
    weights = [1.0, 1.0]
    at, saved = Position(), Position()  # the run, and its last checkpoint
    committed: list[list[np.ndarray]] = []  # per committed step: each worker's ids
    for kind, arg in history:
        if kind == "resize":
            weights = [1.0] * arg
        elif kind == "speeds":
            weights = arg
        elif kind == "restart":
            at = Position(saved.step, saved.cursor)
            del committed[at.step :]  # the crash loses what came after the checkpoint
        else:
            for _ in range(arg):
                step_batch = cfg.batch_at(len(weights))
                if step_batch < len(weights):
                    break
                committed.append(order.plan_step(layout, at.cursor, step_batch, weights))
                at.advance(step_batch)
                if at.step % checkpoint_every == 0:
                    saved = Position(at.step, at.cursor)
    read = np.concatenate([ids for step in committed for ids in step]) if committed else np.empty(0, int)
    assert len(read) == at.cursor
    assert np.array_equal(read, order.take(layout, 0, len(read)))  # same order whatever the world did
    n = layout.num_samples
    for epoch in range(len(read) // n):
        assert sorted(read[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    tail = read[(len(read) // n) * n :]
    assert len(set(tail.tolist())) == len(tail)  # a partial epoch repeats nothing either
