"""Monitoring on a real run: the Prometheus endpoint of the session's Ray, `etrain status`, `etrain report`.

One run serves all three: its metrics are scraped while it trains (the session's Ray
exports every second; Ray's default is every 10 s), it is scaled out from 1 to 2 workers
midway so a scale event reaches the dashboard, and the report is drawn from its records.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import time
import urllib.request

import pytest

from etrain.cli import main
from etrain.driver.job import new_run_dir, train

from helpers.runs import FAST, records

SAMPLE = re.compile(r"^(ray_etrain_\w+)\{([^}]*)\} (\S+)$")


def scrape(port: int, run: str) -> dict[tuple[str, str], float]:
    """(metric, extra label) -> value for this run's series; the extra label is `part` or `reason`, or ''."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("run") == run:
            values[(m.group(1), labels.get("part") or labels.get("reason") or labels.get("le", ""))] = float(m.group(3))
    return values


WANTED = [
    ("ray_etrain_step", ""),
    ("ray_etrain_loss", ""),
    ("ray_etrain_tokens_per_second", ""),
    ("ray_etrain_grad_norm", ""),
    ("ray_etrain_world_size", ""),
    ("ray_etrain_warm_pool_ready", ""),
    ("ray_etrain_cache_hit_rate", ""),
    ("ray_etrain_fetched_bytes_total", ""),
    ("ray_etrain_eval_loss", ""),
    ("ray_etrain_checkpoint_step", ""),
    ("ray_etrain_step_seconds", "compute"),
    ("ray_etrain_step_seconds", "communication"),
    ("ray_etrain_step_seconds", "data_wait"),
    ("ray_etrain_scale_events_total", "scale-out"),
    ("ray_etrain_scale_latency_seconds", "scale-out"),
    ("ray_etrain_grad_norm_distribution_count", ""),
    ("ray_etrain_grad_norms_total", ""),
]


def test_metrics_status_and_report_of_a_live_run(ray_session, make_cfg, capsys):
    assert ray_session is not None, "the session's Ray must export metrics (tests/conftest.py)"
    cfg = make_cfg(
        *FAST,
        "run.name=watched",
        "train.steps=120",
        "cluster.num_workers=1",
        "train.eval_every=20",
        "checkpoint.every=20",
    )
    run_dir = new_run_dir(cfg)
    seen: dict = {}

    def watch():
        """Scale out once a pool worker is ready; take `etrain status`; scrape until every metric is there."""
        while not records(run_dir, "train"):
            time.sleep(0.2)
        deadline = time.monotonic() + 10  # status.json follows the records within status_file.STATUS_S
        while time.monotonic() < deadline:
            assert main(["status", "--json", str(run_dir)]) == 0
            seen["status"] = json.loads(capsys.readouterr().out)
            if seen["status"]["step"] >= 1:
                break
            time.sleep(0.2)
        assert main(["status", str(run_dir), "--once"]) == 0
        seen["status_text"] = capsys.readouterr().out
        assert main(["scale", str(run_dir), "--workers", "2"]) == 0
        capsys.readouterr()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            values = scrape(ray_session, "watched")
            # Ray may export the scale event's counter and the world-size gauge in different flushes.
            if all(k in values for k in WANTED) and values[("ray_etrain_world_size", "")] == 2:
                seen["scraped"], seen["records"] = values, records(run_dir, "train")
                seen["stopped_at"] = seen["records"][-1]["step"]
                # Between events (no checkpoint, evaluation or scale event for a while) every series stays.
                seen["later"] = []
                for _ in range(4):
                    time.sleep(1.2)
                    seen["later"].append([k for k in WANTED if k not in scrape(ray_session, "watched")])
                return
            time.sleep(0.5)
        values = scrape(ray_session, "watched")
        world_size = values.get(("ray_etrain_world_size", ""))
        seen["missing"] = [k for k in WANTED if k not in values] or [f"world_size {world_size}, not 2"]

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    train(cfg, run_dir, progress=False)
    thread.join(timeout=5)

    assert "missing" not in seen, f"not scraped while the run trained: {seen['missing']}"
    assert "scraped" in seen, "the run ended before every metric reached the Prometheus endpoint; give it more steps"
    values, train_records = seen["scraped"], seen["records"]
    assert seen["stopped_at"] < cfg.train.steps  # scraped from the live run, not after it
    # Every gauge holds a value the run recorded (the scrape lags the records by up to one export interval).
    assert 1 <= values[("ray_etrain_step", "")] <= seen["stopped_at"]
    recorded = {
        name: [r[field] for r in train_records if r.get(field) is not None]
        for name, field in [("loss", "loss"), ("tokens_per_second", "tokens_per_s"), ("grad_norm", "grad_norm")]
    }
    for name, values_recorded in recorded.items():
        value = values[(f"ray_etrain_{name}", "")]
        assert any(math.isclose(value, v, rel_tol=1e-6) for v in values_recorded), (
            f"{name} = {value} was never recorded"
        )
    assert seen["later"] == [[]] * 4, f"series gone from later scrapes: {seen['later']}"
    # On CPU there is no honest peak: MFU is left out, not shown wrong (etrain/core/flops.py).
    assert ("ray_etrain_mfu", "") not in values and all(r.get("mfu") is None for r in train_records)
    # The histogram holds exactly the recorded gradient norms (its count is the first steps', each bucket
    # theirs), and the exact sum beside it is theirs (Ray exports the histogram's own _sum from midpoints).
    # Ray may export the two series in different flushes, so the sum is that of the first steps, not
    # necessarily as many as the histogram's count.
    all_norms = [r["grad_norm"] for r in records(run_dir, "train")]
    count = int(values[("ray_etrain_grad_norm_distribution_count", "")])
    norms = all_norms[:count]
    total = values[("ray_etrain_grad_norms_total", "")]
    assert any(math.isclose(total, p, rel_tol=1e-6) for p in itertools.accumulate(all_norms)), (
        f"{total} is no sum of the first norms"
    )
    for le in ("0.5", "1.0", "3.0", "10.0"):
        assert values[("ray_etrain_grad_norm_distribution_bucket", le)] == sum(n <= float(le) for n in norms), le
    assert values[("ray_etrain_world_size", "")] == 2  # scraped after the scale-out was published
    assert values[("ray_etrain_scale_events_total", "scale-out")] == 1
    scale_out = next(r for r in records(run_dir, "membership") if r["reason"] == "scale-out")
    assert math.isclose(values[("ray_etrain_scale_latency_seconds", "scale-out")], scale_out["total_s"], rel_tol=1e-6)
    assert values[("ray_etrain_step_seconds", "compute")] > 0
    assert 0 <= values[("ray_etrain_cache_hit_rate", "")] <= 1
    assert (
        values[("ray_etrain_fetched_bytes_total", "")] >= sum(r.get("fetched_bytes", 0) for r in train_records[:1]) > 0
    )
    assert values[("ray_etrain_grad_norm_distribution_count", "")] >= 1
    assert values[("ray_etrain_checkpoint_step", "")] % 20 == 0
    evals = [r["eval_loss"] for r in records(run_dir, "eval")]
    assert any(math.isclose(values[("ray_etrain_eval_loss", "")], v, rel_tol=1e-6) for v in evals)

    status = seen["status"]
    assert status["run"] == "watched" and status["total_steps"] == 120 and status["world_size"] == 1
    assert 1 <= status["step"] < 120 and status["phase"] in ("running", "checkpointing")
    assert status["loss"] is not None and status["tokens_per_s"] > 0
    assert f"run watched  ({run_dir})" in seen["status_text"] and "/120" in seen["status_text"]

    # The live view of a job that has ended says so; the list of jobs no longer has it.
    assert main(["status"]) == 0
    assert "watched" not in capsys.readouterr().out
    assert main(["status", str(run_dir), "--once"]) == 0  # read from the run directory: its last state
    ended = capsys.readouterr().out
    assert "(the job has ended)" in ended and "step 120/120" in ended
    assert main(["status", "watched", "--once"]) == 2  # by name: asked of Ray, where it is gone
    assert "no running job 'etrain:watched'" in capsys.readouterr().err

    # The report of the run: the scale-out is marked on the throughput plot.
    assert main(["report", str(run_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == cfg.train.steps
    for name in ("loss", "throughput", "data_wait", "world_size", "grad_norm"):
        assert (run_dir / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    from etrain.driver.report import write_report

    report = write_report(run_dir, run_dir / "again")
    assert [label for _, label in report["events"]] == ["scale-out 1→2"]
    split = report["summary"]["time"]
    print(split)  # issue 44: every second productive or a cause, none counted twice
    assert split["productive_s"] + sum(split["badput_s"].values()) == pytest.approx(split["wall_s"])
    assert all(v >= 0 for k, v in split["badput_s"].items() if k != "unaccounted")
    assert split["badput_s"]["unaccounted"] > -0.05 and 0 < split["goodput"] <= 1, split
    assert split["badput_s"]["start_up"] > 0 and split["badput_s"]["re_forming"] > 0  # the start; the scale-out
