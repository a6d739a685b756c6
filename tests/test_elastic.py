"""Membership changes on a real local Ray: failures replaced from the warm pool, resizes, no restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from app.cli import main
from app.job import new_run_dir, train
from app.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_session")

FAST = ["cluster.warm_pool=1", "train.eval_every=0", "checkpoint.every=0", "timeouts.collective_s=5", "timeouts.step_s=15", "timeouts.join_s=60"]


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def run(make_cfg, name: str, *overrides: str) -> Path:
    cfg = make_cfg(*FAST, f"run.name={name}", *overrides)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="module")
def reference(make_cfg_module) -> Path:
    return run(make_cfg_module, "reference", "train.steps=60")


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_lost_worker_is_replaced_and_the_step_redone(make_cfg, reference, kind):
    run_dir = run(make_cfg, f"fault-{kind}", "train.steps=60", "faults=[{rank: 1, step: 25, kind: " + kind + "}]")
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))  # nothing lost, nothing repeated
    changes = records(run_dir, "membership")
    assert [(c["reason"], c["world_before"], c["world_after"], c["step"]) for c in changes] == [("recover", 2, 2, 24)]
    assert changes[0]["warm_joiners"] + changes[0]["cold_joiners"] == 1
    assert set(changes[0]["phases"]) == {"detect", "acquire", "migrate", "reform", "first_step"}
    # The failed step was discarded and redone by the new group: the trajectory is the uninterrupted one.
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert {r["step"]: r["loss"] for r in steps} == expected


def test_scale_out_and_in_while_training_keeps_learning(make_cfg, reference):
    cfg = make_cfg(*FAST, "run.name=elastic", "train.steps=60", "faults=[{rank: 0, step: 57}]")
    run_dir = new_run_dir(cfg)

    def drive():
        coordinator = None
        while coordinator is None:
            try:
                coordinator = ray.get_actor("etrain:elastic")
            except ValueError:
                time.sleep(0.05)
        while ray.get(coordinator.status.remote())["warm_pool_ready"] < 1:
            time.sleep(0.1)
        for workers in (3, 2):
            assert main(["scale", str(run_dir), "--workers", str(workers)]) == 0
            while ([{}] + records(run_dir, "train"))[-1].get("world_size") != workers:
                time.sleep(0.02)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    train(cfg, run_dir, progress=False)
    thread.join(timeout=5)
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == list(range(1, 61))
    assert 3 in {r["world_size"] for r in steps} and steps[-1]["world_size"] == 2
    changes = {c["reason"]: c for c in records(run_dir, "membership")}
    assert sorted(changes) == ["recover", "scale-in", "scale-out"]
    assert changes["scale-out"]["warm_joiners"] == 1  # the pool was up: no process start in the join
    # Constant global batch: a different world size changes float reduction order only.
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert all(abs(r["loss"] - expected[r["step"]]) < 1e-3 for r in steps if r.get("loss") is not None)


def test_scale_names_what_is_wrong(make_cfg, capsys):
    assert main(["scale", "no-such-run", "--workers", "2"]) == 2
    assert "no running job 'etrain:no-such-run'" in capsys.readouterr().err
