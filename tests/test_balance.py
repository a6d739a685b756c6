"""The straggler balancer's decisions, without Ray."""

import pytest

from etrain.control.balance import Balancer
from etrain.core.config import BalanceConfig
from etrain.data import order


def balancer(**kw) -> Balancer:
    return Balancer(BalanceConfig(**({"patience": 1} | kw)))


def test_equal_shares_while_everyone_is_near_the_mean():
    b = balancer()
    for w, speed in {"a": 100.0, "b": 90.0, "c": 110.0}.items():
        b.observe([w], [10], [10 / speed])
    assert b.weights(["a", "b", "c"]) == [1.0, 1.0, 1.0]
    assert not b.balanced


def test_a_straggler_below_the_threshold_gets_a_share_in_proportion_to_its_speed():
    b = balancer()
    for w, speed in {"a": 100.0, "b": 100.0, "slow": 50.0}.items():
        b.observe([w], [10], [10 / speed])
    weights = b.weights(["a", "b", "slow"])
    assert b.balanced
    assert weights == pytest.approx([1.2, 1.2, 0.6])
    counts = order.split_counts(30, weights)
    assert counts == [12, 12, 6] and sum(counts) == 30  # the global batch is unchanged, only its split


def test_the_threshold_is_strict_and_configurable():
    b = balancer(slow_below=0.5)
    b.observe(["a"], [10], [0.1])
    b.observe(["slow"], [10], [0.2])  # 2x slower: 0.67 of the mean, above 0.5
    assert b.weights(["a", "slow"]) == [1.0, 1.0]


def test_a_recovered_worker_returns_to_an_equal_share():
    b = balancer(ema=1.0)
    b.observe(["a"], [10], [0.1])
    b.observe(["b"], [10], [0.3])
    assert b.weights(["a", "b"]) != [1.0, 1.0]
    b.observe(["b"], [10], [0.1])
    assert b.weights(["a", "b"]) == [1.0, 1.0]
    assert not b.balanced


def test_speeds_are_an_exponential_average():
    b = balancer(ema=0.5)
    b.observe(["a"], [10], [1.0])  # 10/s
    b.observe(["a"], [10], [0.5])  # 20/s
    assert b.speeds["a"] == pytest.approx(15.0)


def test_joiners_start_at_the_mean_and_leavers_are_forgotten():
    b = balancer()
    b.observe(["a"], [10], [0.1])
    b.observe(["slow"], [10], [1.0])
    assert b.weights(["a", "new"]) == [1.0, 1.0]  # a joiner starts at the mean of the measured
    b.forget(["a"])  # "slow" left the group (back to the pool) ...
    # ... and when it joins again it is measured afresh, not split by its old speed
    assert b.weights(["a", "slow"]) == [1.0, 1.0]


def test_disabled_never_rebalances():
    b = balancer(enabled=False)
    b.observe(["a"], [10], [0.1])
    b.observe(["slow"], [10], [1.0])
    assert b.weights(["a", "slow"]) == [1.0, 1.0]


def test_nothing_measured_yet_means_equal_shares():
    b = balancer()
    b.observe(["a"], [0], [0.0])  # a worker with no sample this step tells nothing
    assert b.weights(["a", "b"]) == [1.0, 1.0]


def test_the_split_changes_only_after_patience_steps_in_a_row():
    b = balancer(patience=3, ema=1.0)
    b.observe(["a"], [10], [0.1])
    b.observe(["b"], [10], [0.3])
    assert [b.weights(["a", "b"]) == [1.0, 1.0] for _ in range(3)] == [True, True, False]
    b.observe(["b"], [10], [0.1])  # one good step back does not undo it ...
    b.weights(["a", "b"])
    b.observe(["b"], [10], [0.3])  # ... and the next slow one resets the count
    assert b.weights(["a", "b"]) != [1.0, 1.0] and b.balanced
    b.observe(["b"], [10], [0.1])
    assert [(b.weights(["a", "b"]), b.balanced)[1] for _ in range(3)] == [True, True, False]
