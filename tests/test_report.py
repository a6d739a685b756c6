"""The run report from a synthetic but consistent metrics.jsonl: no Ray, no cluster."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from etrain.core.config import ConfigError
from etrain.driver.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = {"loss", "throughput", "data_wait", "world_size", "grad_norm", "time"}
T0 = 1_700_000_000.0


def _train(step: int, world: int, complete: bool = True) -> dict:
    record = {"kind": "train", "step": step, "world_size": world, "batch": 16, "cursor": 16 * step, "time": T0 + step}
    if complete:  # a step committed by survivors of a lost worker has none of these
        step_time = 0.1 + 0.01 * (step % 3)
        record |= {
            "loss": 5.0 - 0.1 * step,
            "lr": 1e-3,
            "grad_norm": 10.0 / step,
            "skipped": step == 7,
            "tokens_per_s": 16 * 128 / step_time,
            "step_time_s": step_time,
            "worker_s": step_time,
            "mfu": 0.3,
            "data_wait_s": 0.5 if step == 1 else 0.001,
            "compute_s": 0.07,
            "communication_s": 0.01,
            "other_s": step_time - 0.081,
            "checkpoint_stall_s": 0.0,
        }
    return record


def _membership(reason: str, step: int, before: int, after: int) -> dict:
    return {
        "kind": "membership",
        "reason": reason,
        "step": step,
        "world_before": before,
        "world_after": after,
        "phases": {"detect": 0.01, "migrate": 0.02, "reform": 0.03, "first_step": 0.2},
        "total_s": 0.26,
    }


def _run(tmp_path: Path, name: str = "elastic-run") -> Path:
    """30 steps: 2 workers, a scale-out to 3 after step 10, a worker lost in step 20 (its survivors commit it
    without a loss) and a recover to 2. As the coordinator writes them, a membership record comes after the
    first step that follows the change."""
    records = []
    for step in range(1, 31):
        records.append(_train(step, 3 if 10 < step <= 20 else 2, complete=step != 20))
        if step == 11:
            records.append(_membership("scale-out", 10, 2, 3))
        if step == 21:
            records.append(_membership("recover", 20, 3, 2))
        if step in (15, 30):
            records.append({"kind": "eval", "step": step, "eval_loss": 4.0 - 0.05 * step, "time": T0 + step + 0.5})
        if step == 25:
            records.append(
                {
                    "kind": "checkpoint",
                    "level": "full",
                    "step": 25,
                    "path": "file:///x/step-00000025",
                    "bytes": 1000,
                    "stall_s": 0.01,
                    "save_s": 0.1,
                    "time": T0 + 25.6,
                }
            )
    records.insert(10, {"kind": "autoscale", "step": 10, "world": 2, "wanted": 3, "time": T0 + 10.1})
    records.append({"kind": "outlier", "step": 12, "grad_norm": 40.0, "limit": 20.0, "time": T0 + 12.5})
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_report_plots_page_and_summary(tmp_path):
    run = _run(tmp_path)
    report = write_report(run)

    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report"]  # nothing outside out_dir
    assert set(report["plots"]) == PLOTS
    for path in report["plots"].values():
        assert path.parent == run / "report" and path.read_bytes().startswith(PNG)

    page = report["html"].read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 6 and all(base64.b64decode(i).startswith(PNG) for i in images)
    assert "elastic-run" in page

    # each change at the end of the step it followed, in seconds since the first step ended (step s ends at T0 + s)
    assert report["events"] == [(9.0, "scale-out 2→3"), (19.0, "recover 3→2")]
    s = report["summary"]
    assert s["steps"] == 30 and s["final_loss"] == pytest.approx(2.0) and s["final_eval_loss"] == pytest.approx(2.5)
    assert s["membership"] == {"scale-out": 1, "recover": 1}
    assert s["checkpoints"] == 1 and s["recoveries"] == 1 and s["mean_mfu"] == pytest.approx(0.3)


def test_report_to_another_directory_after_a_resume(tmp_path):
    """A resume rewinds the step: a change at the resumed step is placed at the resume, not at the older run's step."""
    run = tmp_path / "resumed"
    run.mkdir()
    records = [
        _train(1, 2),
        _train(2, 2),
        _train(3, 2),
        {"kind": "resume", "step": 2, "time": T0 + 50},
        _train(3, 2) | {"time": T0 + 51},
        _membership("recover", 2, 2, 1),
        _train(4, 1) | {"time": T0 + 52},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report(run, tmp_path / "out")
    assert report["html"] == tmp_path / "out" / "report.html" and not (run / "report").exists()
    assert report["events"] == [(49.0, "recover 2→1")]
    assert report["summary"]["steps"] == 4 and report["summary"]["recoveries"] == 2  # the recover and the resume


@pytest.mark.parametrize("case", ["no directory", "no metrics", "no steps"])
def test_report_errors_name_the_path(tmp_path, case):
    run = tmp_path / "run"
    if case != "no directory":
        run.mkdir()
    if case == "no steps":  # just started: the group formed, nothing committed yet
        (run / "metrics.jsonl").write_text(json.dumps(_membership("start", 0, 0, 2)) + "\n")
    with pytest.raises(ConfigError, match="no steps recorded yet" if case == "no steps" else "etrain train") as e:
        write_report(run)
    assert str(run) in str(e.value)


def test_report_leaves_matplotlib_to_whoever_makes_one(tmp_path):
    """Making a report needs matplotlib, importing its module does not; and no pyplot (no backend switch) at all."""
    run = _run(tmp_path)
    code = (
        "import sys; from etrain.driver.report import write_report; assert 'matplotlib' not in sys.modules; "
        f"write_report({str(run)!r}); assert 'matplotlib.pyplot' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_records_of_an_older_run_are_read_under_todays_names(tmp_path):
    """Fields renamed since (a train record's data cursor, an outlier's batch) read under their new names; a record
    with both keeps today's, and other kinds keep a field of the old name."""
    from etrain.core.config import load_config
    from etrain.core.records import read_jsonl, summarize

    old = [
        {"kind": "train", "step": 1, "world_size": 2, "batch": 16, "samples": 16, "time": T0},
        {"kind": "train", "step": 2, "world_size": 2, "batch": 16, "samples": 32, "time": T0 + 1},
        {"kind": "outlier", "step": 2, "grad_norm": 9.0, "limit": 3.0, "samples": 16, "guard_restarted": False},
        {"kind": "train", "step": 3, "world_size": 2, "batch": 16, "samples": 0, "cursor": 48, "time": T0 + 2},
        {"kind": "quarantine", "samples": [1, 2]},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    rows = read_jsonl(path)
    assert [r.get("cursor") for r in rows[:2]] == [16, 32] and not any("samples" in r for r in rows[:3])
    assert rows[2]["batch"] == 16 and rows[3]["cursor"] == 48 and rows[4]["samples"] == [1, 2]
    summary = summarize(path, load_config("tiny"), T0, T0)
    assert (summary["steps"], summary["samples"]) == (3, 48)
