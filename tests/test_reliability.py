"""Issue 15's hostile pass, one test per defect found: a run never loses or duplicates its history,
nothing waits forever, every failure is named in one line. (Defect 3 and Ctrl-C are in
test_crash_recovery.py, 9 in test_config.py, 10 and 11 in test_cache.py, 12 in test_tune.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from etrain.cli import main
from etrain.control.control import JobError
from etrain.control.coordinator import Coordinator
from etrain.core import checkpoint, lease
from etrain.core.ports import free_port
from etrain.data.embedded import ensure_corpus
from etrain.driver.job import new_run_dir, train
from etrain.worker import spawn

from helpers.runs import FAST, ROOT, etrain_lines, records, run, start_driver, wait_for_step, wait_until

ray_test = pytest.mark.usefixtures("ray_session")


def world(run_dir: Path) -> int | None:
    steps = records(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else []
    return steps[-1]["world_size"] if steps else None


@ray_test
def test_with_no_warm_pool_a_lost_worker_is_replaced_and_a_scale_request_is_met(make_cfg):
    """Defect 1: with cluster.warm_pool=0 a replacement (and a worker asked for by `etrain scale`) is
    started when needed and joins once ready; it used to be stopped again just before joining."""
    cfg = make_cfg(
        *FAST, "run.name=pool0", "cluster.warm_pool=0", "train.steps=250", "faults=[{rank: 1, step: 5, kind: kill}]"
    )
    run_dir = new_run_dir(cfg)

    def drive():
        wait_until("the replacement", lambda: any(m["reason"] == "scale-out" for m in records(run_dir, "membership")))
        assert main(["scale", str(run_dir), "--workers", "3"]) == 0
        wait_until("the third worker", lambda: world(run_dir) == 3)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    train(cfg, run_dir, progress=False)
    thread.join(timeout=5)
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 251))
    changes = [(m["reason"], m["world_before"], m["world_after"]) for m in records(run_dir, "membership")]
    assert changes == [("recover", 2, 1), ("scale-out", 1, 2), ("scale-out", 2, 3)]
    assert world(run_dir) == 3


@ray_test
def test_resume_of_a_run_that_is_still_training_is_refused(make_cfg, tmp_path, capsys):
    """Defect 2: a second driver on a running run (here `--resume`) is refused with the owner's host, pid
    and the lease's age, before it writes anything; the first goes on undisturbed."""
    cfg = make_cfg(*FAST, "run.name=busy", "train.steps=80")
    run_dir = Path(cfg.run.root) / cfg.run.name
    driver = start_driver(cfg, tmp_path)
    wait_for_step(run_dir, 3, driver)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"pid {driver.pid}" in err and "is being trained by host" in err and "renewed" in err
    assert driver.wait(timeout=120) == 0, driver.stderr.read()
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 81))
    assert not (run_dir / "checkpoints" / lease.LEASE).exists()  # given up at the end


@ray_test
def test_storage_refusing_a_checkpoint_commit_leaves_a_record_and_training_goes_on(make_cfg, s3_bucket, s3_faults):
    """Defect 4: a commit marker (or retention's delete) refused by storage used to kill the job; now the
    save is recorded as failed, the one before stays the latest, and the run goes on to its end."""
    s3_faults.fail("PUT", r"step-00000004/commit\.json")
    s3_faults.fail("POST", r"\?delete")  # retention's bulk delete
    uri = f"{s3_bucket}/ck"
    run_dir = run(
        make_cfg, "commit-refused", "train.steps=8", "checkpoint.every=2", "checkpoint.keep=1", f"checkpoint.uri={uri}"
    )
    failed = records(run_dir, "checkpoint_failed")
    assert [f["step"] for f in failed] == [4] and "PermissionError" in failed[0]["error"]
    saved = records(run_dir, "checkpoint")
    assert [c["step"] for c in saved] == [2, 6, 8]
    assert "retain_error" not in saved[0] and all("PermissionError" in c["retain_error"] for c in saved[1:])
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 9)) and (run_dir / "summary.json").exists()
    assert checkpoint.load_latest(uri).meta["step"] == 8


def etrain(*args: str, env: dict, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from etrain.cli import main; sys.exit(main())", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.time() - started


@ray_test
def test_connecting_to_a_dead_address_or_with_a_refused_token_fails_at_once(tmp_path):
    """Defect 5: `etrain status` against an address where nothing runs waited without end; against a live
    cluster with a wrong token it said "no Ray cluster". Both now end at once, each with its own cause."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    dead, took = etrain("status", env=env | {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"})
    assert dead.returncode == 2 and "no Ray cluster at" in dead.stderr and "Traceback" not in dead.stderr, dead.stderr
    assert took < 30
    live = ray.get_runtime_context().gcs_address
    refused, took = etrain(
        "status", env=env | {"RAY_ADDRESS": live, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    )
    assert (
        refused.returncode == 2
        and "refused this client's token" in refused.stderr
        and "RAY_AUTH_TOKEN" in refused.stderr
    ), refused.stderr
    assert took < 30


@ray_test
def test_a_client_reaches_a_local_run_with_the_token_ray_made_for_it_and_no_raw_ray_lines():
    """Issue 27, defect 6: `etrain scale` (and status) against a run started here with `etrain train` was refused
    with a token error unless RAY_AUTH_MODE=token was exported, and Ray's raw gcs_client.cc line reached the
    terminal. A local run's Ray has token auth on and its token in ~/.ray/auth_token: the client uses it."""
    assert os.environ.get("RAY_AUTH_MODE") == "token"  # the session's Ray wants a token, as a local run's does
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done, _ = etrain("status", env=env | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert done.returncode == 0, done.stderr
    assert "gcs_client" not in done.stderr and "Unauthenticated" not in done.stderr, done.stderr


@ray_test
def test_a_frozen_coordinator_fails_the_driver_after_the_join_timeout(make_cfg):
    """Defect 5: the driver waited for the coordinator's answers without a bound; a coordinator frozen
    (SIGSTOP) now fails the job after timeouts.join_s with a line that says so."""
    cfg = make_cfg(
        *FAST,
        "run.name=frozen",
        "train.steps=2000",
        "timeouts.collective_s=2",
        "timeouts.step_s=4",
        "timeouts.join_s=15",  # the workers' start on a loaded machine fits in it
    )
    run_dir = new_run_dir(cfg)
    frozen = []

    def freeze():
        wait_until("a step", lambda: world(run_dir) is not None and (run_dir / "status.json").exists())
        # This run's coordinator, by the pid it writes: not another run's that is still exiting.
        coordinator = psutil.Process(json.loads((run_dir / "status.json").read_text())["coordinator_pid"])
        coordinator.send_signal(signal.SIGSTOP)
        frozen.append(coordinator)

    thread = threading.Thread(target=freeze, daemon=True)
    thread.start()
    try:
        with pytest.raises(JobError, match="coordinator has not answered for 15 s"):
            train(cfg, run_dir, progress=False)
    finally:
        for p in frozen:
            if p.is_running():
                p.send_signal(signal.SIGCONT)
    assert frozen, "the job failed before its first step, so before the coordinator was frozen"
    assert max(r["step"] for r in records(run_dir, "train")) < 2000


@ray_test
def test_a_step_no_member_finished_is_never_committed(make_cfg):
    """Defect 6: with every member lost in one step, "all survivors finished" held over zero survivors and
    the step was written as committed (a train record without a loss, the cursor past it)."""
    cfg = make_cfg(
        *FAST,
        "run.name=all-lost",
        "cluster.warm_pool=0",
        "train.steps=20",
        "checkpoint.every=0",
        "faults=[{rank: 0, step: 5, kind: kill}, {rank: 1, step: 5, kind: kill}]",
    )
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="every worker lost.* needs a checkpoint to go back to, and there is none"):
        train(cfg, run_dir, progress=False)
    steps = records(run_dir, "train")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(r.get("loss") is not None for r in steps)
    assert checkpoint.read_cursor(str(run_dir / "checkpoints"))["step"] == 4


def test_a_run_directory_in_rays_temporary_directory_is_refused(make_cfg, tmp_path, monkeypatch, capsys):
    """Defect 7: under `ray job submit --working-dir` the default run.root ("runs") lands in Ray's unpacked
    package, deleted with the session; the driver refuses it before writing anything and says what to set."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    package = tmp_path / "ray" / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    assert main(["train", "--config", "tiny", "--set", "run.name=x"]) == 2
    err = capsys.readouterr().err
    assert (
        f"run.root resolves to {package / 'runs' / 'x'}, inside Ray's temporary directory" in err
        and "--set run.root=" in err
    )
    assert not (package / "runs").exists()
    monkeypatch.chdir(tmp_path)
    # relative roots become absolute
    assert new_run_dir(make_cfg("run.root=runs", "run.name=y")) == tmp_path / "runs" / "y"


@pytest.mark.parametrize("case", ["no-eval-split", "directory"])
def test_a_bad_data_source_is_one_line_exit_2(make_cfg, tmp_path, capsys, case):
    """Defect 8: a manifest without an eval split (KeyError in the coordinator) and data.source naming the
    prepared directory (IsADirectoryError) are named before anything starts."""
    source = Path(ensure_corpus(make_cfg()))
    if case == "no-eval-split":
        text = source.read_text().replace('"eval"', '"holdout"')
        source = tmp_path / "manifest.json"
        source.write_text(text)
        expected = "has no 'eval' split with samples"
    else:
        source = source.parent
        expected = f"is a directory; point data.source at the manifest in it: {source}/manifest.json"
    config = tmp_path / "c.yaml"
    config.write_text(make_cfg(f"data.source={source}").to_yaml())
    assert main(["train", "--config", str(config), "--set", f"run.name={case}"]) == 2
    err = etrain_lines(capsys.readouterr().err)
    assert expected in err and "Traceback" not in err


def test_prepare_names_a_bad_storage_option_and_an_unreachable_endpoint(
    tmp_path, s3_bucket, s3_faults, capsys, monkeypatch
):
    """Defect 8: `etrain prepare` with an unknown --storage-option (TypeError) or to an endpoint that does
    not answer (EndpointConnectionError) now ends in one line before any work starts."""
    import s3fs

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would take ~15 s to give up
    s3fs.S3FileSystem.clear_instance_cache()
    src = tmp_path / "doc.txt"
    src.write_text("words " * 50)
    assert main(["prepare", str(src), "--out", f"{s3_bucket}/p", "--storage-option", "bogus=1", "--no-progress"]) == 2
    assert "--storage-option for" in capsys.readouterr().err
    with s3_faults.outage():
        assert main(["prepare", str(src), "--out", f"{s3_bucket}/q", "--no-progress"]) == 1
    err = etrain_lines(capsys.readouterr().err)
    assert f"cannot reach the output {s3_bucket}/q" in err and "Traceback" not in err
    s3fs.S3FileSystem.clear_instance_cache()


@ray_test
def test_a_model_too_big_is_refused_and_a_worker_that_cannot_start_says_why(make_cfg, tmp_path, capsys):
    """Defect 8: a model too big for memory said "2 worker(s) lost while the group first formed; start the
    job again". The driver now refuses it from the estimate; a worker whose constructor fails anyway (a
    GPU's memory is known only there) is reported with its own exception."""
    huge = ("model.d_model=1048576", "train.steps=2")
    config = tmp_path / "huge.yaml"
    config.write_text(make_cfg(*huge).to_yaml())
    assert main(["train", "--config", str(config), "--set", "run.name=huge"]) == 2
    assert "the model needs about" in capsys.readouterr().err

    cfg = make_cfg(*FAST, *huge, "cluster.num_workers=1", "run.name=huge-worker")
    manifest = ensure_corpus(cfg)
    run_dir = new_run_dir(cfg)
    workers = spawn(cfg, manifest, 1)
    held = lease.acquire(str(run_dir / "checkpoints"), run_dir.name, cfg.timeouts.lease_s)
    coordinator = (
        ray.remote(Coordinator)
        .options(num_cpus=0, max_concurrency=4)
        .remote(cfg.model_dump(), str(run_dir), manifest, time.time(), workers, held)
    )
    try:
        with pytest.raises(
            JobError, match="a worker could not start: .*allocate.*the model does not fit a worker's memory"
        ):
            ray.get(coordinator.run.remote(False))
    finally:
        ray.kill(coordinator)
        lease.release(held)


@ray_test
def test_a_step_that_outlasts_its_timeout_names_the_timeout(make_cfg):
    """Issue 41, defect 6: every worker silent in a step (hung: a stalled link, a frozen process) ended the run as
    "every worker lost ... set checkpoint.every lower", naming neither the step nor the timeout that ran out."""
    cfg = make_cfg(
        *FAST,
        "run.name=silent",
        "cluster.warm_pool=0",
        "train.steps=8",
        "checkpoint.every=0",
        "timeouts.collective_s=2",
        "timeouts.step_s=4",
        "faults=[{rank: 0, step: 3, kind: hang}, {rank: 1, step: 3, kind: hang}]",
    )
    with pytest.raises(JobError, match=r"step 3: no answer within timeouts\.step_s=4 s\) needs a checkpoint"):
        train(cfg, new_run_dir(cfg), progress=False)
