"""`configs/grafana/etrain.json` against the metrics `control/dashboard.py` publishes: no Ray cluster needed.

The published metrics are read two ways: by constructing `Dashboard("t")` in a
child process (`ray.util.metrics` objects can be built without `ray.init`, and the child keeps
them out of this test session's process), and by parsing `etrain/control/dashboard.py` with `ast`, which
also sees metrics created outside `__init__`. Prometheus names follow Ray's exporter: a `ray_`
prefix, `_total` on Counters, `_bucket`/`_count`/`_sum` on Histograms.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers.metric_source import declared_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_JSON = ROOT / "etrain" / "configs" / "grafana" / "etrain.json"
DASHBOARD_PY = ROOT / "etrain" / "control" / "dashboard.py"
METRIC = re.compile(r"\bray_etrain_\w+")
# A metric whose description says it is a share of a whole (0 to 1): Grafana shows it as a percentage.
FRACTION = re.compile(r"\b(share|utilisation|0 to 1)\b")

CONSTRUCT = """
import json
import ray
from ray._raylet import Config
from ray.util.metrics import Metric
from etrain.control.dashboard import Dashboard

def walk(value):
    if isinstance(value, Metric):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from walk(v)

d = Dashboard("t")
found = {m.info["name"]: [type(m).__name__, list(m.info["tag_keys"])] for m in walk(vars(d))}
described = {m.info["name"]: m.info["description"] for m in walk(vars(d))}
print(json.dumps({
    "ray_initialized": ray.is_initialized(),
    "metrics": found,
    "descriptions": described,
    "report_interval_ms": Config.metrics_report_interval_ms(),  # how often Ray exports them (its default)
}))
"""


def prometheus_names(name: str, kind: str) -> set[str]:
    base = f"ray_{name}"
    if kind == "Counter":
        return {f"{base}_total"}
    if kind == "Histogram":
        return {f"{base}_bucket", f"{base}_count", f"{base}_sum"}
    return {base}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


@pytest.fixture(scope="module")
def constructed() -> dict:
    """What a constructed Dashboard holds (its metrics, their descriptions) and Ray's default export interval."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_metrics_report_interval_ms"}  # Ray's default, not ours
    out = subprocess.run(
        [sys.executable, "-c", CONSTRUCT], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["ray_initialized"], "constructing Dashboard must not start Ray"
    assert result["metrics"], "Dashboard('t') holds no ray.util.metrics objects"
    return result


@pytest.fixture(scope="module")
def published(constructed) -> dict[str, tuple[str, tuple[str, ...]]]:
    """metric name as given to ray.util.metrics -> (kind, tag keys), from a constructed Dashboard."""
    return {name: (kind, tuple(keys)) for name, (kind, keys) in constructed["metrics"].items()}


@pytest.fixture(scope="module")
def every_metric(published) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """The constructed Dashboard's metrics, plus any the source creates elsewhere (tag keys unknown: None)."""
    return {name: (kind, None) for name, kind in parsed_metric_names().items()} | published


@pytest.fixture(scope="module")
def series(every_metric) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """Prometheus series name -> (metric name, tag keys or None)."""
    return {s: (name, keys) for name, (kind, keys) in every_metric.items() for s in prometheus_names(name, kind)}


def parsed_metric_names() -> dict[str, str]:
    """metric name -> kind, for every Gauge/Counter/Histogram construction in etrain/control/dashboard.py."""
    return declared_metrics(ast.parse(DASHBOARD_PY.read_text()), str(DASHBOARD_PY.relative_to(ROOT)))


def targets(dashboard: dict):
    """(panel, target) for every query panel; rows hold no queries."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        for target in panel.get("targets", []):
            yield panel, target


def seconds(interval: str) -> int:
    """A Grafana interval ("10s", "1m", "1h") in seconds."""
    m = re.fullmatch(r"(\d+)([smhd])", interval)
    assert m, f"not a Grafana interval: {interval!r}"
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def test_importable_model(dashboard, constructed):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    title, uid = dashboard["title"], dashboard["uid"]
    assert title.startswith(f"{project}: "), f"{title!r} does not name the project, {project}"
    # A uid Grafana takes (at most 40 of [A-Za-z0-9_-]): the title's slug, so /d/<uid>/<slug> reads alike.
    assert uid == re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") and len(uid) <= 40, (uid, title)
    assert isinstance(dashboard["schemaVersion"], int)  # Grafana migrates an older schema when it imports one
    # Refreshed as often as Ray exports the metrics: faster redraws the same values, slower lags behind them.
    assert seconds(dashboard["refresh"]) * 1000 == constructed["report_interval_ms"], dashboard["refresh"]
    assert dashboard["time"]["to"] == "now" and seconds(dashboard["time"]["from"].removeprefix("now-")) > 0
    assert isinstance(dashboard["panels"], list) and dashboard["panels"]

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"run", "datasource"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["multi"] and run["includeAll"]
    query = run["query"]["query"] if isinstance(run["query"], dict) else run["query"]
    assert query == "label_values(ray_etrain_step, run)"
    assert run["datasource"]["uid"] == "${datasource}"

    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert any(t.get("expr") for t in panel.get("targets", [])), f"{panel['title']}: no query"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit") or panel["type"] == "heatmap", f"{panel['title']}: no unit"


def test_queries_use_the_variables(dashboard):
    for panel, target in targets(dashboard):
        assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        expr = target["expr"]
        for m in METRIC.finditer(expr):
            assert expr[m.end() :].startswith('{run=~"$run"'), f"{panel['title']}: {m.group()} is not filtered by $run"
        assert "{{run}}" in target["legendFormat"] or target.get("format") == "heatmap", panel["title"]


def test_every_query_uses_published_metrics_and_their_tags(dashboard, series):
    for panel, target in targets(dashboard):
        expr = target["expr"]
        used = set(METRIC.findall(expr))
        assert used, f"{panel['title']}: {expr} names no etrain metric"
        unknown = used - set(series)
        assert not unknown, f"{panel['title']}: {sorted(unknown)} are not published by etrain/control/dashboard.py"
        if any(series[s][1] is None for s in used):
            continue  # a metric Dashboard.__init__ does not create: its tag keys are unknown
        tags = {k for s in used for k in series[s][1]} | {"le"}
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        assert grouped <= tags, f"{panel['title']}: groups by {sorted(grouped - tags)}, not a tag of {sorted(used)}"
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        shown = grouped if grouped else tags
        assert legend <= shown, f"{panel['title']}: legend uses {sorted(legend - shown)}, which the query drops"


def unit_of(series: str, metric: str, kind: str, description: str, expr: str) -> str:
    """The Grafana unit a Prometheus series calls for, from the metric as etrain/control/dashboard.py defines it."""
    if metric.endswith("_seconds"):
        return "s"
    if metric.endswith("_bytes"):
        per_second = kind == "Counter" and re.search(rf"\bi?rate\(\s*{re.escape(series)}\b", expr)
        return "Bps" if per_second else "bytes"
    if FRACTION.search(description):
        return "percentunit"
    return "short"


def test_each_panel_has_the_unit_of_its_metrics(dashboard, every_metric, series, constructed):
    """A panel's unit follows from what it plots: seconds, bytes (a rate of them: bytes/s), a share of a whole
    (shown as a percentage), a count or a plain number otherwise; one panel never mixes two of them."""
    descriptions = constructed["descriptions"]
    checked = 0
    for panel in dashboard["panels"]:
        if panel["type"] in ("row", "heatmap"):  # a heatmap's unit is its buckets'
            continue
        found = [(s, t["expr"]) for t in panel.get("targets", []) for s in METRIC.findall(t["expr"])]
        metrics = {s: series[s][0] for s, _ in found}
        if any(m not in descriptions for m in metrics.values()):
            continue  # a metric Dashboard.__init__ does not create: its description is unknown
        units = {unit_of(s, metrics[s], every_metric[metrics[s]][0], descriptions[metrics[s]], e) for s, e in found}
        assert len(units) == 1, f"{panel['title']}: its queries plot {sorted(units)}"
        assert panel["fieldConfig"]["defaults"].get("unit") == units.pop(), panel["title"]
        checked += 1
    assert checked, "no panel's unit was checked"


def test_every_published_metric_is_on_the_dashboard(dashboard, every_metric):
    used = {m for _, target in targets(dashboard) for m in METRIC.findall(target["expr"])}
    missing = [name for name, (kind, _) in every_metric.items() if not prometheus_names(name, kind) & used]
    assert not missing, f"published but on no panel of {DASHBOARD_JSON.name}: {missing}"


def test_source_parse_sees_every_constructed_metric(published):
    """The parse is what catches metrics created outside __init__; it must at least see all that are."""
    parsed = parsed_metric_names()
    assert {name: parsed.get(name) for name in published} == {name: kind for name, (kind, _) in published.items()}
