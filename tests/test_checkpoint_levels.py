"""Checkpoint levels on a real run: cadences, light bytes, and a resume from a light checkpoint."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from etrain.control.control import JobError
from etrain.core import checkpoint
from etrain.core.storage import StorageError
from etrain.driver.job import new_run_dir, train

from helpers.faults import immutable
from helpers.runs import FAST, records

pytestmark = pytest.mark.usefixtures("ray_session")


def test_levels_follow_their_cadences_and_a_light_resume_says_where_its_optimizer_came_from(make_cfg, capsys):
    levels = ["checkpoint.light_every=3", "checkpoint.every=9", "cluster.max_recoveries=0", "cluster.warm_pool=0"]
    cfg = make_cfg(*FAST, *levels, "run.name=levels", "train.steps=16", "faults=[{kind: kill, step: 14, rank: 1}]")
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    saves = records(run_dir, "checkpoint")
    # No base at step 3: the first save is a full one.
    assert [(r["step"], r["level"]) for r in saves] == [(3, "full"), (6, "light"), (9, "full"), (12, "light")]
    full, light = saves[2]["bytes"], saves[3]["bytes"]
    assert light <= 0.2 * full, f"light {light} B vs full {full} B"
    ck = checkpoint.load_latest(str(run_dir / "checkpoints"))
    written = checkpoint.deserialize(ck.parts[checkpoint.LIGHT])
    base = checkpoint.deserialize(ck.parts["model.pt"])
    assert {str(t.dtype) for t in written.values()} == {"torch.bfloat16"}
    assert set(written) == set(base)  # every parameter of this model trains: all changed since the base

    resumed = make_cfg(*FAST, *levels, "run.name=levels", "train.steps=16")
    summary = train(resumed, run_dir, resume=True, progress=False)
    assert summary["steps"] == 16
    event = records(run_dir, "resume")[0]
    assert (event["step"], event["level"]) == (12, "light") and event["base"].endswith("step-00000009")
    said = capsys.readouterr().err
    assert "resumed at step 12" in said and "light checkpoint" in said and "step-00000009" in said
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 17))


def test_a_wall_clock_cadence_saves_between_the_step_cadences_saves(make_cfg):
    """checkpoint.every_s: with no step cadence (every=0, the final save only), a run that lasts several
    every_s saves on the way; a save is due once every_s has passed since the last one began."""
    every_s = 0.3
    slowed = "faults=[{rank: 0, step: 1, kind: slow, factor: 4}]"  # so that even a fast machine takes a while
    clock = ["train.steps=30", "checkpoint.every=0", f"checkpoint.every_s={every_s}"]
    cfg = make_cfg(*FAST, "run.name=clock", *clock, slowed)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    steps = {r["step"]: r["time"] for r in records(run_dir, "train")}
    late = [s for s in steps if steps[s] - steps[1] > 2 * every_s]  # the last save began by then
    assert late, "the run was too short to need a save by the clock"
    saves = [r["step"] for r in records(run_dir, "checkpoint")]
    assert saves[-1] == 30 and len(saves) >= 2 and saves[0] <= late[0], (saves, late[0])


def test_a_checkpoint_that_cannot_be_written_is_recorded_and_only_the_final_one_fails_the_job(make_cfg, tmp_path):
    """Storage that refuses once the run is going: each save is recorded as failed and training goes on;
    only the final save fails the job. (Storage unwritable from the start stops it at once: the lease.)"""
    (tmp_path / "blocked").write_text("a file where the checkpoint directory should be")
    blocked = make_cfg(*FAST, "run.name=blocked", f"checkpoint.uri={tmp_path / 'blocked' / 'ck'}")
    with pytest.raises(StorageError, match=f"cannot take the run's lease {tmp_path / 'blocked' / 'ck'}"):
        train(blocked, new_run_dir(blocked), progress=False)

    # Slowed steps (rank 0 computes 5x as long) leave time to lock the checkpoint root after step 1.
    cfg = make_cfg(
        *FAST,
        "run.name=refused",
        "train.steps=12",
        "checkpoint.every=4",
        "faults=[{rank: 0, step: 1, kind: slow, factor: 5}]",
    )
    run_dir = new_run_dir(cfg)
    root = run_dir / "checkpoints"

    def lock_after_the_first_step():
        while not (run_dir / "metrics.jsonl").exists() or not records(run_dir, "train"):
            time.sleep(0.01)
        locked.enter_context(immutable(root))

    with contextlib.ExitStack() as locked:
        thread = threading.Thread(target=lock_after_the_first_step, daemon=True)
        thread.start()
        with pytest.raises(JobError, match="final checkpoint could not be written"):
            train(cfg, run_dir, progress=False)
        thread.join()
    assert [r["step"] for r in records(run_dir, "checkpoint_failed")] == [4, 8, 12]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 13))  # went on past the failed saves
