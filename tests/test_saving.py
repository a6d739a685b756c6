"""The coordinator's side of checkpoints without Ray: which level is due when, and where a resume lands."""

from __future__ import annotations

import json

import pytest

from etrain.control.control import JobError
from etrain.control.saving import Saver
from etrain.core import checkpoint
from etrain.core.config import load_config


def saver(tmp_path, *overrides: str) -> Saver:
    cfg = load_config("tiny", list(overrides))
    return Saver(cfg, str(tmp_path / "ck"), record=lambda r: None, gather=None)


def test_levels_follow_their_cadences(tmp_path):
    s = saver(tmp_path, "train.steps=16", "checkpoint.every=9", "checkpoint.light_every=3")
    assert [s.level(step) for step in (1, 3)] == [None, "full"]  # a light one needs a full base first
    s.base = {"dir": "step-00000003", "step": 3, "hashes": {}}
    assert [s.level(step) for step in (6, 9, 12, 15, 16)] == [
        "light",
        "full",
        "light",
        "light",
        "full",
    ]  # the last step: full
    s.close()


def test_a_full_checkpoint_is_due_by_the_clock_as_well_as_by_steps(tmp_path):
    now = [100.0]
    cfg = load_config("tiny", ["train.steps=100", "checkpoint.every=50", "checkpoint.every_s=60"])
    s = Saver(cfg, str(tmp_path / "ck"), record=lambda r: None, gather=None, clock=lambda: now[0])
    assert [s.level(7), s.level(50)] == [None, "full"]
    now[0] = 159.9
    assert s.level(8) is None
    now[0] = 160.0  # a minute since the run began, and no save since
    assert s.level(9) == "full"
    s.last_full = 160.0  # what `begin` sets when a full save begins
    assert s.level(10) is None
    s.close()


def test_no_checkpoint_means_the_start_and_a_rollback_needs_one(tmp_path):
    s = saver(tmp_path)
    point = s.resume_point(load_config("tiny").hash())
    assert (
        point.ckpt is None
        and point.meta == {"step": 0, "cursor": 0, "level": None}
        and "no committed checkpoint" in point.reason
    )
    with pytest.raises(JobError, match="a non-finite gradient needs a checkpoint to go back to"):
        s.rollback_point(load_config("tiny").hash(), "a non-finite gradient", "resume with X")
    checkpoint.save(
        str(tmp_path / "ck"), 4, {"model.pt": {}}, {"cursor": 64, "config_hash": load_config("tiny").hash()}, keep=3
    )
    point = s.resume_point(load_config("tiny").hash())
    assert (point.meta["step"], point.meta["cursor"]) == (4, 64)
    with pytest.raises(JobError, match="different model/data/optimizer config"):
        s.resume_point(load_config("tiny", ["optim.lr=1e-4"]).hash())
    s.close()


def test_a_resume_names_what_it_skipped_and_stops_when_nothing_verifies(tmp_path):
    """Issue 41, defects 3 and 7: a resume lands on the newest checkpoint that verifies and names the newer ones it
    skipped, with their causes (its record carries them); a commit whose cursor is more than its steps could take
    is one of them. With none that verifies it stops (a usage error, exit 2) unless told to start over."""
    s = saver(tmp_path)
    cfg_hash, uri = load_config("tiny").hash(), str(tmp_path / "ck")
    for step in (4, 8):
        checkpoint.save(uri, step, {"model.pt": {}}, {"cursor": 16 * step, "config_hash": cfg_hash}, keep=3)
    commit = tmp_path / "ck" / "step-00000008" / checkpoint.COMMIT
    commit.write_text(json.dumps(json.loads(commit.read_text()) | {"cursor": 10**18}))
    point = s.resume_point(cfg_hash)
    assert point.meta["step"] == 4 and "step-00000008 skipped" in point.reason
    (skipped,) = point.skipped
    assert skipped["error"] == f"commit.json: cursor is {10**18}, more than 8 steps of this run take (at most 128)"
    assert s.rollback_point(cfg_hash, "a lost shard", "resume").skipped == point.skipped

    (tmp_path / "ck" / "step-00000004" / "model.pt").write_bytes(b"changed")
    with pytest.raises(checkpoint.CheckpointsCorrupt, match="--restart-if-corrupt") as refused:
        s.resume_point(cfg_hash)
    assert "step-00000004: model.pt does not match its sha256" in str(refused.value)
    point = s.resume_point(cfg_hash, restart_if_corrupt=True)
    assert point.ckpt is None and point.meta["step"] == 0 and len(point.skipped) == 2
    with pytest.raises(JobError, match="a lost shard needs a checkpoint to go back to, and no checkpoint under"):
        s.rollback_point(cfg_hash, "a lost shard", "resume")
    s.close()
