"""Training-stability guards: a non-finite gradient rolls the run back with the lr halved; a gradient-norm
outlier's update is skipped and its samples quarantined."""

from __future__ import annotations

import json
import math
import random

import pytest

from etrain.control.control import JobError
from etrain.control.guards import Guards, NormWatch
from etrain.core.config import TrainConfig
from etrain.core.optim import lr_factor
from etrain.driver.job import train

from helpers.runs import FAST, records, run

ray_test = pytest.mark.usefixtures("ray_session")


def test_the_outlier_limit_is_mean_plus_sigmas_after_warmup():
    watch = NormWatch()
    for norm in (1.0, 2.0, 3.0):
        watch.add(norm)
    assert watch.limit(3.0, warmup=4) == math.inf
    watch.add(2.0)
    assert watch.limit(3.0, warmup=4) == pytest.approx(2.0 + 3 * math.sqrt(2 / 3))  # sample std of 1, 2, 3, 2
    assert watch.limit(0.0, warmup=4) == math.inf  # disabled
    assert NormWatch(**watch.state()) == watch  # travels in checkpoints
    assert [watch.reject(patience=3) for _ in range(3)] == [False, False, True]  # a new regime: start over
    assert watch.limit(3.0, warmup=4) == math.inf and watch.n == 0


def test_a_step_is_judged_alike_whether_its_predecessors_norm_is_in_or_not():
    """Step n's limit comes from the norms of the steps before n − 1: the coordinator sends n before n − 1's norm
    is in (control/step.py); sent after it, n gets the same limit, and so does a run resumed from a checkpoint."""
    rng = random.Random(seed := random.randrange(2**32))
    print("seed", seed)
    guards = Guards(TrainConfig(outlier_warmup=3))
    for n in range(1, 40):
        ahead = guards.limit(n)  # sent while step n − 1 was in flight
        if n > 1:
            norm = rng.uniform(1.0, 2.0) * (50 if rng.random() < 0.1 else 1)
            guards.reject(n - 1) if norm > guards.limit(n - 1) else guards.accept(n - 1, norm)
        assert guards.limit(n) == ahead, n
        resumed = Guards(TrainConfig(outlier_warmup=3))
        resumed.load({**guards.state(), "step": n - 1}, resume=True)
        assert resumed.limit(n) == ahead, n
    assert math.isfinite(guards.limit(40))


@ray_test
def test_a_gradient_spike_is_skipped_and_its_samples_quarantined(make_cfg):
    run_dir = run(make_cfg, "spike", "train.steps=30", "faults=[{rank: 0, step: 25, kind: spike, factor: 1000}]")
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [r["step"] for r in steps if r["skipped"]] == [25]
    [outlier] = records(run_dir, "outlier")
    assert outlier["grad_norm"] > outlier["limit"] and outlier["batch"] == 16
    [logged] = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert logged["step"] == 25 and len(logged["sources"]) == 16
    assert all(s["shard"].endswith(".parquet") and s["row"] >= 0 for s in logged["sources"])
    # traced to the source files
    assert all(s["documents"] and all(d.startswith("stdlib/") for d in s["documents"]) for s in logged["sources"])
    assert abs(steps[25]["loss"] - steps[23]["loss"]) < 0.5  # the spike's update never happened


@ray_test
def test_a_nan_rolls_back_to_the_checkpoint_with_the_lr_halved(make_cfg):
    run_dir = run(make_cfg, "nan", "train.steps=16", "checkpoint.every=5", "faults=[{rank: 1, step: 8, kind: nan}]")
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 17))  # steps 6-7 redone; their first records moved aside
    assert all(math.isfinite(r["loss"]) for r in steps)
    [event] = records(run_dir, "nan_rollback")
    assert (event["step"], event["to_step"], event["lr_scale"]) == (8, 5, 0.5)
    optim = make_cfg().optim
    for r in steps:
        scale = 1.0 if r["step"] <= 5 else 0.5
        assert r["lr"] == pytest.approx(optim.lr * lr_factor(r["step"] - 1, optim, 16) * scale)
    # The halved lr travels with the checkpoints: a resumed run keeps it.
    train(make_cfg(*FAST, "run.name=nan", "train.steps=20"), run_dir, resume=True, progress=False)
    resumed = records(run_dir, "train")[16:]
    assert [r["step"] for r in resumed] == [17, 18, 19, 20]
    assert all(r["lr"] == pytest.approx(optim.lr * lr_factor(r["step"] - 1, optim, 20) * 0.5) for r in resumed)


@ray_test
def test_nan_after_nan_fails_the_job_once_rollbacks_run_out(make_cfg):
    nans = "faults=[{rank: 0, step: 5, kind: nan}, {rank: 0, step: 6, kind: nan}]"
    with pytest.raises(JobError, match="max_nan_rollbacks"):
        run(make_cfg, "nan-twice", "train.steps=12", "checkpoint.every=4", "train.max_nan_rollbacks=1", nans)
