"""Exactly once under any history of resizes and restarts (property test).

The coordinator commits a step by advancing one global cursor; `plan_step` is
all it uses to decide who reads what. A restart rolls the cursor back to the
last checkpoint and the steps after it are redone (their updates were lost with
the crash). Whatever the history, the committed steps must read every sample of
an epoch exactly once, in the same global order.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines import order

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
    checkpoint_every=st.integers(1, 5),
    history=events,
)
def test_every_sample_once_per_epoch(sizes, block, batch, checkpoint_every, history):
    layout = order.Layout(seed=7, sizes=tuple(sizes), block=block)
    weights = [1.0, 1.0]
    committed: list[list[np.ndarray]] = []  # per committed step: each worker's ids
    saved = 0  # steps covered by the last checkpoint
    for kind, arg in history:
        if kind == "resize":
            weights = [1.0] * arg
        elif kind == "speeds":
            weights = arg
        elif kind == "restart":
            del committed[saved:]  # the crash loses what came after the checkpoint
        else:
            for _ in range(arg):
                if batch < len(weights):
                    break
                cursor = len(committed) * batch  # the cursor is a function of committed steps only
                committed.append(order.plan_step(layout, cursor, batch, weights))
                if len(committed) % checkpoint_every == 0:
                    saved = len(committed)
    read = np.concatenate([ids for step in committed for ids in step]) if committed else np.empty(0, int)
    assert np.array_equal(read, order.take(layout, 0, len(read)))  # same order whatever the world did
    n = layout.num_samples
    for epoch in range(len(read) // n):
        assert sorted(read[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    tail = read[(len(read) // n) * n :]
    assert len(set(tail.tolist())) == len(tail)  # a partial epoch repeats nothing either
