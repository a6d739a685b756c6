import numpy as np
import pytest

from pipelines import order


def test_permutation_is_pure_and_complete():
    a = order.epoch_permutation(3, 1, 100)
    assert np.array_equal(a, order.epoch_permutation(3, 1, 100))
    assert sorted(a) == list(range(100))
    assert not np.array_equal(a, order.epoch_permutation(3, 2, 100))
    assert not np.array_equal(a, order.epoch_permutation(4, 1, 100))


@pytest.mark.parametrize("batch", [1, 7, 16, 33])
def test_take_in_steps_equals_take_at_once(batch):
    n, steps = 50, 9  # crosses several epoch boundaries
    stepped = np.concatenate([order.take(0, n, s * batch, batch) for s in range(steps)])
    assert np.array_equal(stepped, order.take(0, n, 0, batch * steps))


def test_each_epoch_visits_every_sample_once():
    ids = order.take(5, 40, 0, 120)
    for e in range(3):
        assert sorted(ids[e * 40 : (e + 1) * 40]) == list(range(40))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("total", [16, 17, 64, 100])
def test_split_covers_batch_exactly_once(world, total):
    ids = order.take(0, 1000, 123, total)
    parts = order.split(ids, [1.0] * world)
    assert len(parts) == world
    assert np.array_equal(np.concatenate(parts), ids)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("weights", [[1, 2], [1, 1, 2], [0.2, 1, 1, 1], [5, 1]])
def test_split_counts_follow_weights(weights):
    counts = order.split_counts(64, weights)
    assert sum(counts) == 64 and min(counts) >= 1
    exact = [64 * w / sum(weights) for w in weights]
    assert all(abs(c - x) <= 1.5 for c, x in zip(counts, exact))


def test_split_needs_a_sample_per_worker():
    with pytest.raises(ValueError):
        order.split_counts(2, [1, 1, 1])
