import numpy as np
import pytest

from etrain.data import order

LAYOUT = order.Layout(seed=3, sizes=(7, 5, 9, 4, 6), block=2)


def test_epoch_order_is_pure_and_complete():
    a = order.epoch_order(LAYOUT, 1)
    assert np.array_equal(a, order.epoch_order(order.Layout(3, (7, 5, 9, 4, 6), 2), 1))
    assert sorted(a) == list(range(LAYOUT.num_samples))
    assert not np.array_equal(a, order.epoch_order(LAYOUT, 2))
    assert not np.array_equal(a, order.epoch_order(order.Layout(4, LAYOUT.sizes, 2), 1))


@pytest.mark.parametrize("block", [1, 2, 3])
def test_consecutive_positions_touch_at_most_block_shards(block):
    layout = order.Layout(0, (50, 30, 40, 20, 60, 10), block)
    ids = order.epoch_order(layout, 0)
    for group in order.blocks(layout, 0):
        size = sum(layout.sizes[s] for s in group)
        chunk, ids = ids[:size], ids[size:]
        assert set(layout.shard_of(chunk)) == set(group.tolist())


@pytest.mark.parametrize("batch", [1, 7, 16, 33])
def test_take_in_steps_equals_take_at_once(batch):
    steps = 9  # crosses several epoch boundaries (31 samples an epoch)
    stepped = np.concatenate([order.take(LAYOUT, s * batch, batch) for s in range(steps)])
    assert np.array_equal(stepped, order.take(LAYOUT, 0, batch * steps))


def test_each_epoch_visits_every_sample_once():
    n = LAYOUT.num_samples
    ids = order.take(LAYOUT, 0, 3 * n)
    for e in range(3):
        assert sorted(ids[e * n : (e + 1) * n]) == list(range(n))


def test_shards_ahead_follows_the_order():
    layout = order.Layout(1, (10, 10, 10, 10), 1)
    first_use = list(dict.fromkeys(layout.shard_of(order.epoch_order(layout, 0)).tolist()))
    assert order.shards_ahead(layout, 0, 4) == first_use
    assert order.shards_ahead(layout, 15, 2) == first_use[1:3]
    assert order.shards_ahead(layout, 35, 2)[0] == first_use[3]  # then into the next epoch


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("total", [16, 17, 64, 100])
def test_split_covers_batch_exactly_once(world, total):
    ids = order.take(order.Layout(0, (1000,)), 123, total)
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
