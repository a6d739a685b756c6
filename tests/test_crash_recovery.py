"""Kill the driver or the coordinator of a real job at a random step; `--resume` continues exactly.

The job runs as its own driver process (as `etrain train` or `ray job submit` would) on the
session's Ray instance; checkpoints are written in the background, so a kill can land in a save.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from runs import FAST, records

from app.api import NAMESPACE
from app.job import new_run_dir, train

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["train.steps=24", "checkpoint.every=6"]

pytestmark = pytest.mark.usefixtures("ray_session")


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def start_driver(cfg, tmp_path: Path) -> subprocess.Popen:
    config = tmp_path / f"{cfg.run.name}.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    code = "import sys; from app.cli import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, "train", "--config", str(config), "--no-progress"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir: Path, step: int, driver: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() or not any(r["step"] >= step for r in records(run_dir, "train")):
        assert driver.poll() is None, f"the driver ended before step {step}: {driver.stderr.read()}"
        assert time.time() < deadline, f"no step {step} within 120 s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(make_cfg_module) -> dict[int, float]:
    cfg = make_cfg_module(*FAST, *STEPS, "run.name=reference")
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return losses(run_dir)


@pytest.mark.parametrize("victim", ["driver", "coordinator"])
def test_killed_job_resumes_exactly(make_cfg, tmp_path, victim, reference):
    rng = random.Random(victim)
    cfg = make_cfg(*FAST, *STEPS, f"run.name={victim}")
    run_dir = Path(cfg.run.root) / cfg.run.name
    driver = start_driver(cfg, tmp_path)
    wait_for_step(run_dir, rng.randint(7, 17), driver)
    time.sleep(rng.uniform(0, 0.2))  # anywhere in a step, or in a save's background write
    if victim == "driver":
        driver.send_signal(signal.SIGKILL)
    else:
        ray.kill(ray.get_actor(f"etrain:{victim}", namespace=NAMESPACE))
    assert driver.wait(timeout=60) != 0
    crashed_at = max(losses(run_dir))
    assert crashed_at < 24

    summary = train(cfg, run_dir, resume=True, progress=False)
    assert summary["steps"] == 24
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, 25))
    assert resumed == reference  # bitwise, across the crash
    resume = records(run_dir, "resume")[0]
    assert resume["step"] in (6, 12, 18) and resume["step"] <= resume["reached_step"] <= crashed_at  # the cursor level lags by a write at most
