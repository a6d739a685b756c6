"""Kill the driver or the coordinator of a real job at a random step; `--resume` continues exactly.

The job runs as its own driver process (as `etrain train` or `ray job submit` would) on the
session's Ray instance; checkpoints are written in the background, so a kill can land in a save.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import ray

from etrain.control.control import JobError
from etrain.core.checkpoint import checkpoint_uri, load_latest
from etrain.driver.api import NAMESPACE
from etrain.driver.job import new_run_dir, train

from helpers.runs import FAMILIES, FAST, drawn, records, start_driver, wait_for_step

STEPS = ["train.steps=24", "checkpoint.every=6"]

pytestmark = pytest.mark.usefixtures("ray_session")


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


@pytest.fixture(scope="module")
def reference(make_cfg_module, module_family) -> dict[int, float]:
    """The uninterrupted run, of the module's model family (conftest.module_family): exact resume holds for each."""
    cfg = make_cfg_module(*FAST, *STEPS, *FAMILIES[module_family[0]], "run.name=reference")
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return losses(run_dir)


@pytest.mark.parametrize("victim", drawn(["driver", "coordinator"], 1, "killed_job"))
def test_killed_job_resumes_exactly(make_cfg, tmp_path, victim, reference, family):
    rng = random.Random(victim)
    cfg = make_cfg(*FAST, *STEPS, *family, f"run.name={victim}")
    run_dir = Path(cfg.run.root) / cfg.run.name
    driver = start_driver(cfg, tmp_path)
    wait_for_step(run_dir, rng.randint(7, 17), driver)
    time.sleep(rng.uniform(0, 0.2))  # anywhere in a step, or in a save's background write
    if victim == "driver":
        driver.send_signal(signal.SIGKILL)
    else:
        ray.kill(ray.get_actor(f"etrain:{victim}", namespace=NAMESPACE))
    assert driver.wait(timeout=60) != 0
    if victim == "coordinator":  # the driver names it in one line, with no traceback (issue 15, defect 8)
        err = driver.stderr.read()
        assert driver.returncode == 1 and "Traceback" not in err, err
        assert "etrain: training failed: the job's coordinator died" in err and f"--resume {run_dir}" in err
    crashed_at = max(losses(run_dir))
    assert crashed_at < 24

    summary = train(cfg, run_dir, resume=True, progress=False)
    assert summary["steps"] == 24
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, 25))
    assert resumed == reference  # bitwise, across the crash
    resume = records(run_dir, "resume")[0]
    # the cursor level lags by a write at most
    assert resume["step"] in (6, 12, 18) and resume["step"] <= resume["reached_step"] <= crashed_at


def test_interrupted_before_any_checkpoint_resumes_from_the_start_once(make_cfg, tmp_path, reference, family):
    """Issue 15, defects 3 and 8: Ctrl-C ends the driver with one line and exit 130; a resume with no
    committed checkpoint starts from step 0, moves the steps it redoes aside and says why."""
    cfg = make_cfg(*FAST, *STEPS, *family, "checkpoint.every=0", "run.name=interrupted")
    run_dir = Path(cfg.run.root) / cfg.run.name
    driver = start_driver(cfg, tmp_path)
    wait_for_step(run_dir, 5, driver)
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=60) == 130
    err = driver.stderr.read()
    assert "Traceback" not in err and f"etrain: interrupted; resume with `etrain train --resume {run_dir}`" in err, err
    interrupted_at = max(losses(run_dir))

    train(cfg, run_dir, resume=True, progress=False)
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 25))  # no step twice
    assert losses(run_dir) == reference
    resume = records(run_dir, "resume")[0]
    assert (resume["step"], resume["path"]) == (0, None) and "no committed checkpoint" in resume["reason"]
    assert resume["records_redone"] >= interrupted_at and (run_dir / "metrics.redone.jsonl").exists()


def test_a_worker_lost_beyond_recovery_then_resume_continues_bitwise(make_cfg, reference, family):
    """docs/training.md, "Determinism and resume": a job whose worker dies with no recovery left
    (cluster.max_recoveries=0) fails; `--resume` continues from its last checkpoint, and every step's loss equals
    the uninterrupted run's."""
    cfg = make_cfg(
        *FAST, *STEPS, *family, "run.name=worker-killed", "cluster.max_recoveries=0",
        "faults=[{rank: 1, step: 14, kind: kill}]",
    )  # fmt: skip
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    assert max(losses(run_dir)) == 13
    # the fault is not met again
    train(make_cfg(*FAST, *STEPS, *family, "run.name=worker-killed"), run_dir, resume=True, progress=False)
    assert losses(run_dir) == reference
    assert records(run_dir, "resume")[0]["step"] == 12


def test_a_topk_run_resumes_bitwise_with_its_residuals(make_cfg):
    """Top-k's unsent gradient is part of the state: every rank writes its residuals into full checkpoints and a
    resume at the same size gives each its own back, so the resumed losses equal the uninterrupted run's bit for bit
    (without them the first compressed steps after the resume send less, and the losses part)."""
    topk = [*FAST, *STEPS, "comm.compression=topk", "comm.compress_start=2"]
    ref_dir = new_run_dir(ref := make_cfg(*topk, "run.name=topk-reference"))
    train(ref, ref_dir, progress=False)
    fault = "faults=[{rank: 1, step: 14, kind: kill}]"
    cfg = make_cfg(*topk, "run.name=topk-killed", "cluster.max_recoveries=0", fault)
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    saved = load_latest(checkpoint_uri(cfg, run_dir))
    assert saved.meta["step"] == 12 and {"residual-000.pt", "residual-001.pt"} <= set(saved.parts)
    train(make_cfg(*topk, "run.name=topk-killed"), run_dir, resume=True, progress=False)
    assert losses(run_dir) == losses(ref_dir)


def test_a_resume_names_each_corrupt_checkpoint_and_never_trains_from_scratch_in_silence(make_cfg, capsys, rng):
    """Issue 41, defect 3, through the CLI: a part of the newest checkpoint truncated (a drawn part, of a data-
    parallel run or a sharded one's DCP files) is named on the terminal and in the resume record, and the run goes
    on from the one before. With every checkpoint corrupt, `--resume` stops with exit 2 naming each and trains
    nothing; `--restart-if-corrupt` trains it from step 0."""
    from etrain.cli import main

    layout = rng.choice([[], ["parallel.shard=2"]])
    cfg = make_cfg(*FAST, "train.steps=8", "checkpoint.every=4", "run.name=corrupt", *layout)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    ckpts = run_dir / "checkpoints"
    newest = ckpts / "step-00000008"
    part = rng.choice(sorted(p for p in newest.rglob("*") if p.is_file() and p.name != "commit.json"))
    print(f"layout {layout or 'data parallel'}: {part.relative_to(newest)} truncated")
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    resume = ["train", "--resume", str(run_dir), "--no-progress"]
    capsys.readouterr()
    assert main([*resume, "--set", "train.steps=10"]) == 0
    err = capsys.readouterr().err
    named = f"{part.relative_to(newest)} does not match its sha256 (corrupt)"
    assert f"warning: skipped checkpoint file://{newest}: {named}" in err, err
    record = records(run_dir, "resume")[-1]
    assert record["step"] == 4 and record["skipped"] == [{"path": f"file://{newest}", "error": named}]
    assert "step-00000008 skipped" in record["reason"]

    for commit in ckpts.glob("step-*/commit.json"):  # now every checkpoint fails verification
        commit.write_text(commit.read_text()[:-2])  # cut short: it no longer parses
    trained = len(records(run_dir, "train"))
    assert main([*resume, "--set", "train.steps=12"]) == 2
    err = capsys.readouterr().err
    assert "etrain: error: no checkpoint under" in err and "--restart-if-corrupt" in err and "Traceback" not in err
    assert all(d.name in err for d in ckpts.glob("step-*"))
    assert len(records(run_dir, "train")) == trained  # nothing trained
    assert main([*resume, "--set", "train.steps=12", "--restart-if-corrupt"]) == 0
    restarted = records(run_dir, "resume")[-1]
    assert restarted["step"] == 0 and restarted["path"] is None and len(restarted["skipped"]) >= 2
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 13))
