"""Running a real job from a test, and reading what it recorded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray

from etrain.cli import main
from etrain.core.records import read_jsonl
from etrain.driver import api
from etrain.driver.job import new_run_dir, train

ROOT = Path(__file__).resolve().parents[2]

# Short timeouts so a broken path fails fast; no evaluations or checkpoints unless a test asks. A fixed
# (equal) split, so runs compare bitwise: speed-based splits depend on timing (tests/test_comm.py has them).
# Collection's draws (`drawn`): conftest prints the seed in the session's header
SESSION_SEED = int(os.environ.get("ETRAIN_TEST_SEED") or random.SystemRandom().randrange(2**32))


def drawn(cases: list, k: int, test: str) -> list:
    """`k` of a parametrized test's `cases`, drawn from the session's seed and the test's name: a run pays for k of
    them, and every case is met over runs (the engine tests without Ray hold every layout in every run)."""
    return random.Random(f"{SESSION_SEED}:{test}").sample(cases, k)


# the tiny preset's shape in each model family: what conftest.module_family draws from
FAMILIES = {"gpt": [], "llama": ["model.family=llama", "model.n_kv_head=2", "model.tie_weights=false"]}
FAST = [
    "cluster.warm_pool=1",
    "train.eval_every=0",
    "checkpoint.every=0",
    "timeouts.collective_s=5",
    "timeouts.step_s=15",
    "timeouts.join_s=60",
    "train.deterministic=true",
]


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == kind]


def run(make_cfg, name: str, *overrides: str) -> Path:
    cfg = make_cfg(*FAST, f"run.name={name}", *overrides)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return run_dir


def run_scaled(make_cfg, name: str, sizes: tuple[int, ...], *overrides: str) -> Path:
    """A run that `etrain scale` resizes to each of `sizes` in turn, as soon as a pool worker is ready."""
    cfg = make_cfg(*FAST, f"run.name={name}", *overrides)
    run_dir = new_run_dir(cfg)

    def drive():
        coordinator = api.coordinator(str(run_dir), wait_s=120)
        while ray.get(coordinator.status.remote())["warm_pool_ready"] < 1:
            time.sleep(0.1)
        for workers in sizes:
            assert main(["scale", str(run_dir), "--workers", str(workers)]) == 0
            while ([{}] + records(run_dir, "train"))[-1].get("world_size") != workers:
                time.sleep(0.02)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    train(cfg, run_dir, progress=False)
    thread.join(timeout=5)
    assert not thread.is_alive(), f"{name}: the run ended before it was resized to each of {sizes}"
    return run_dir


def interruptible() -> None:
    """A child's Ctrl-C as at a terminal (Popen's preexec_fn): a shell's background job (`nohup ... &`, some CI
    runners) starts with SIGINT ignored, a Python child inherits that, and a SIGINT to it never interrupts it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_driver(cfg, tmp_path: Path, *args: str) -> subprocess.Popen:
    """`etrain train` as its own driver process (as a user or `ray job submit` runs it) on the session's Ray."""
    config = tmp_path / f"{cfg.run.name}.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    code = "import sys; from etrain.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "train", "--config", str(config), "--no-progress", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )


def wait_for_step(run_dir: Path, step: int, driver: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() or not any(r["step"] >= step for r in records(run_dir, "train")):
        assert driver.poll() is None, f"the driver ended before step {step}: {driver.stderr.read()}"
        assert time.time() < deadline, f"no step {step} within 120 s"
        time.sleep(0.05)


def wait_until(what: str, predicate, timeout: float = 120, every: float = 0.05):
    """`predicate()`'s first true value, polled every `every` seconds; an assertion error after `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def etrain_lines(err: str) -> str:
    """What etrain itself wrote to stderr in this process. The test session's Ray forwards its actors' output
    with a "(Name pid=...)" prefix (another test's cache stopping late, say); etrain connects with log_to_driver
    off, so a user never sees those lines."""
    return "\n".join(line for line in err.splitlines() if not line.startswith("\x1b[36m("))
