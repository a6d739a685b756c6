"""Hyper-parameter search: the space file's checks, and a real search on the session's Ray
(Tune + Optuna TPE + ASHA) that is killed mid-way, resumed, and survives a failing trial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from etrain.cli import main
from etrain.core import checkpoint
from etrain.core.config import ConfigError, load_config
from etrain.core.records import read_jsonl
from etrain.tune.space import load_space

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, says",
    [
        ("optim.lrr: {uniform: [0.1, 0.2]}", "'optim.lrr'"),
        ("optim.lr: {uniform: [0.2, 0.1]}", "low < high"),
        ("optim.lr: {loguniform: [0.0, 0.1]}", "low > 0"),
        ("optim.lr: {normal: [0.0, 0.1]}", "exactly one of"),
        ("model.n_layer: {int: [1.5, 3]}", "whole-number"),
        ("model.n_head: {choice: [4, 3]}", "'model.n_head' = 3"),
        ("train.steps: {int: [10, 100]}", "budget"),
        ("optim.lr: {choice: []}", "non-empty"),
        ("- optim.lr", "mapping"),
    ],
)
def test_a_bad_space_names_the_parameter(tmp_path, text, says):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    with pytest.raises(ConfigError, match=None) as e:
        load_space(space, load_config("tiny"))
    assert says in str(e.value)


def test_bad_space_exits_2(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {uniform: [1, 0]}")
    assert main(["tune", "--config", "tiny", "--space", str(space), "--out", str(tmp_path / "t")]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert main(["tune", "--resume", "--out", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--reduction", "1"], "--reduction must be above 1"),
        (["--grace", "0"], "--grace at least 1"),
        (["--resume", "--reduction", "3"], "a resumed search keeps its own"),
        (["--grace", "2", "--set", "train.steps=8", "--set", "train.eval_every=4"], "ASHA would stop nothing"),
    ],
)
def test_asha_settings_that_cannot_prune_exit_2(tmp_path, capsys, flags, says):
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    argv = ["tune", "--config", "tiny", "--space", str(space), "--out", str(tmp_path / "t"), *flags]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "t" / "study").exists()


def test_resume_refuses_a_study_that_others_can_write(tmp_path, capsys):
    """Issue 15, defect 12: `--resume` unpickles the study (Ray Tune's design), so a pickle someone else
    could have written would run their code: such a search directory is refused before anything loads."""
    out = tmp_path / "search"
    (out / "study").mkdir(parents=True)
    pickle = out / "study" / "tuner.pkl"
    pickle.write_bytes(b"not loaded")
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    (out / "base.yaml").write_text(load_config("tiny").to_yaml())
    spec = {"space": str(space), "trials": 2, "concurrency": 1, "seed": 0, "sampler": "tpe", "pruning": True}
    (out / "search.json").write_text(json.dumps(spec))
    pickle.chmod(0o666)
    assert main(["tune", "--resume", "--out", str(out)]) == 2
    assert f"{pickle} is writable by anyone: resuming a search unpickles its study" in capsys.readouterr().err


@pytest.mark.usefixtures("ray_session")
def test_search_survives_a_failing_trial_and_resumes_after_a_kill(data_dir, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(
        "optim.lr: {loguniform: [1.0e-3, 1.0e-2]}\ndata.source: {choice: [embedded, /nonexistent/manifest.json]}\n"
    )
    out = tmp_path / "search"
    sets = [
        f"data.cache_dir={data_dir}",
        "data.corpus_bytes=1500000",
        "data.shard_bytes=200000",
        "train.steps=12",
        "train.eval_every=4",
        "checkpoint.every=4",
        "cluster.num_workers=1",
        "cluster.warm_pool=0",
    ]
    args = [
        "tune",
        "--config",
        "tiny",
        *(a for s in sets for a in ("--set", s)),
        "--space",
        str(space),
        "--trials",
        "3",
        "--concurrency",
        "2",
        "--seed",
        "3",
        "--out",
        str(out),
        "--no-progress",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    code = "import sys; from etrain.cli import main; sys.exit(main())"
    driver = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def mid_run(trial: Path) -> bool:
        """A checkpoint past the first committed, and the trial four steps from its end: Tune cannot have
        recorded it as done, whatever the machine's speed."""
        meta = checkpoint.newest_meta(str(trial / "checkpoints"))
        return meta is not None and meta["step"] >= 8

    deadline = time.time() + 240
    while not (done := [trial for trial in (out / "trials").glob("*") if mid_run(trial)]):
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        assert time.time() < deadline, "no trial reached its checkpoint of step 8 within 240 s"
        time.sleep(0.05)
    finished = done[0].name
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    assert not (out / "trials.json").exists()

    assert main(["tune", "--resume", "--out", str(out), "--no-progress"]) == 0
    rows = json.loads((out / "trials.json").read_text())
    assert len(rows) == 3 and len({r["trial"] for r in rows}) == 3
    assert {r["status"] for r in rows} <= {"completed", "pruned", "failed"}
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all(
        r["params"]["data.source"] == "/nonexistent/manifest.json" and "nonexistent" in r["error"] for r in failed
    )
    # The trial killed mid-run resumes once, from its last checkpoint, and its records hold each step once.
    assert finished in {r["trial"] for r in rows}
    records = read_jsonl(out / "trials" / finished / "metrics.jsonl")
    resumes = [(r["step"], r["reached_step"]) for r in records if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0][0] in (8, 12) and resumes[0][1] >= resumes[0][0], (
        f"trial {finished}: expected one resume, from its checkpoint of step 8 (or 12), got {resumes}"
    )
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    best = min((r for r in rows if r["status"] == "completed"), key=lambda r: r["eval_loss"])
    assert rows[0] == best
    assert load_config(str(out / "best.yaml")).optim.lr == pytest.approx(best["params"]["optim.lr"])


def test_a_trial_asha_stopped_reaches_optuna_as_pruned_and_a_finished_one_as_complete():
    """Ray tells Optuna a stopped trial is COMPLETE at its early loss; ours says PRUNED, keeping its evaluations."""
    import optuna
    from optuna.trial import TrialState
    from ray.tune.result import TRAINING_ITERATION

    from etrain.tune.search import METRIC, Search

    space = {"optim.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    search = Search(space, metric=METRIC, mode="min", sampler=optuna.samplers.RandomSampler(seed=0), steps=20)
    for trial, losses in (("stopped", [3.0]), ("finished", [3.1, 2.5])):
        search.suggest(trial)
        for i, loss in enumerate(losses):
            search.on_trial_result(trial, {METRIC: loss, "step": 10 * (i + 1), TRAINING_ITERATION: i + 1})
        search.on_trial_complete(trial, {METRIC: losses[-1], "step": 10 * len(losses)})
    search.suggest("failed")
    search.on_trial_complete("failed", None, error=True)
    stopped, finished, failed = search._ot_study.get_trials(deepcopy=False)
    assert stopped.state == TrialState.PRUNED and stopped.intermediate_values == {1: 3.0}
    assert finished.state == TrialState.COMPLETE and finished.value == 2.5
    assert failed.state == TrialState.FAIL
