"""`configs/grafana/etrain.json` against the metrics `actors/dashboard.py` publishes: no Ray cluster needed.

The published metrics are read two ways: by constructing `Dashboard("t")` in a
child process (`ray.util.metrics` objects can be built without `ray.init`, and the child keeps
them out of this test session's process), and by parsing `actors/dashboard.py` with `ast`, which
also sees metrics created outside `__init__`. Prometheus names follow Ray's exporter: a `ray_`
prefix, `_total` on Counters, `_bucket`/`_count`/`_sum` on Histograms.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_JSON = ROOT / "configs" / "grafana" / "etrain.json"
DASHBOARD_PY = ROOT / "actors" / "dashboard.py"
KINDS = ("Gauge", "Counter", "Histogram")
METRIC = re.compile(r"\bray_etrain_\w+")

CONSTRUCT = """
import json
import ray
from ray.util.metrics import Metric
from actors.dashboard import Dashboard

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
print(json.dumps({"ray_initialized": ray.is_initialized(), "metrics": found}))
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
def published() -> dict[str, tuple[str, tuple[str, ...]]]:
    """metric name as given to ray.util.metrics -> (kind, tag keys), from a constructed Dashboard."""
    out = subprocess.run(
        [sys.executable, "-c", CONSTRUCT], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["ray_initialized"], "constructing Dashboard must not start Ray"
    assert result["metrics"], "Dashboard('t') holds no ray.util.metrics objects"
    return {name: (kind, tuple(keys)) for name, (kind, keys) in result["metrics"].items()}


@pytest.fixture(scope="module")
def every_metric(published) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """The constructed Dashboard's metrics, plus any the source creates elsewhere (tag keys unknown: None)."""
    return {name: (kind, None) for name, kind in parsed_metric_names().items()} | published


@pytest.fixture(scope="module")
def series(every_metric) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """Prometheus series name -> (metric name, tag keys or None)."""
    return {s: (name, keys) for name, (kind, keys) in every_metric.items() for s in prometheus_names(name, kind)}


def parsed_metric_names() -> dict[str, str]:
    """metric name -> kind, for every Gauge/Counter/Histogram call in actors/dashboard.py.

    A name is a string literal, or an f-string over the variable of a dict comprehension that
    iterates `{...}.items()` (the gauges table): that one stands for every key of the literal dict.
    """
    tree = ast.parse(DASHBOARD_PY.read_text())
    expansions: dict[int, list[str]] = {}  # id(call) -> names, for calls inside a comprehension over a literal dict
    for comp in ast.walk(tree):
        if not isinstance(comp, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            continue
        for gen in comp.generators:
            it = gen.iter
            if (
                isinstance(it, ast.Call)
                and isinstance(it.func, ast.Attribute)
                and it.func.attr in ("items", "keys")
                and isinstance(it.func.value, ast.Dict)
            ):
                keys = [ast.literal_eval(k) for k in it.func.value.keys]
                var = gen.target.elts[0] if isinstance(gen.target, ast.Tuple) else gen.target
                for call in ast.walk(comp):
                    if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.JoinedStr):
                        expansions[id(call)] = [_render(call.args[0], {var.id: k}) for k in keys]
    names = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in KINDS):
            continue
        arg = call.args[0] if call.args else next(k.value for k in call.keywords if k.arg == "name")
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found = [arg.value]
        elif id(call) in expansions:
            found = expansions[id(call)]
        else:
            raise AssertionError(f"line {call.lineno}: cannot read the metric name {ast.unparse(arg)}")
        for n in found:
            names[n] = call.func.id
    return names


def _render(fstring: ast.JoinedStr, env: dict[str, str]) -> str:
    parts = []
    for v in fstring.values:
        if isinstance(v, ast.Constant):
            parts.append(v.value)
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in env:
            parts.append(env[v.value.id])
        else:
            raise AssertionError(f"cannot render the metric name {ast.unparse(fstring)}")
    return "".join(parts)


def targets(dashboard: dict):
    """(panel, target) for every query panel; rows hold no queries."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        for target in panel.get("targets", []):
            yield panel, target


def test_importable_model(dashboard):
    assert dashboard["title"] == "etrain: training"
    assert dashboard["uid"] == "etrain-training"
    assert dashboard["schemaVersion"] == 39
    assert dashboard["refresh"] == "10s"
    assert dashboard["time"] == {"from": "now-1h", "to": "now"}
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
        assert not unknown, f"{panel['title']}: {sorted(unknown)} are not published by actors/dashboard.py"
        if any(series[s][1] is None for s in used):
            continue  # a metric Dashboard.__init__ does not create: its tag keys are unknown
        tags = {k for s in used for k in series[s][1]} | {"le"}
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        assert grouped <= tags, f"{panel['title']}: groups by {sorted(grouped - tags)}, not a tag of {sorted(used)}"
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        shown = grouped if grouped else tags
        assert legend <= shown, f"{panel['title']}: legend uses {sorted(legend - shown)}, which the query drops"


def test_every_published_metric_is_on_the_dashboard(dashboard, every_metric):
    used = {m for _, target in targets(dashboard) for m in METRIC.findall(target["expr"])}
    missing = [name for name, (kind, _) in every_metric.items() if not prometheus_names(name, kind) & used]
    assert not missing, f"published but on no panel of {DASHBOARD_JSON.name}: {missing}"


def test_source_parse_sees_every_constructed_metric(published):
    """The parse is what catches metrics created outside __init__; it must at least see all that are."""
    parsed = parsed_metric_names()
    assert {name: parsed.get(name) for name in published} == {name: kind for name, (kind, _) in published.items()}
