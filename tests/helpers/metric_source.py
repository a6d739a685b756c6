"""The metrics the code declares, read from its source (no Ray): the Grafana and the docs tests check them, and
docs/reference.py writes their reference page from them."""

from __future__ import annotations

import ast
from dataclasses import dataclass

METRIC_KINDS = ("Gauge", "Counter", "Histogram")


@dataclass(frozen=True)
class Metric:
    """One metric as its construction declares it: its kind, its description and its tag keys."""

    kind: str
    description: str
    tags: tuple[str, ...]


def declared_metrics(tree: ast.Module, where: str = "") -> dict[str, str]:
    """metric name as given to ray.util.metrics -> its kind, for each construction in `tree`."""
    return {name: metric.kind for name, metric in declared_metric_details(tree, where).items()}


def declared_metric_details(tree: ast.Module, where: str = "") -> dict[str, Metric]:
    """metric name as given to ray.util.metrics -> its Metric, for each construction in `tree`. A name is a string
    literal, or an f-string over the variable of a comprehension that iterates a literal dict (the gauges table):
    that one stands for every key of the dict, and its description is the key's value when the call passes it."""
    expanded = comprehension_names(tree)
    assigned = tuple_assignments(tree)
    found = {}
    for kind, call in metric_calls(tree):
        name = argument(call, 0, "name")
        text, tags = argument(call, 1, "description"), argument(call, -1, "tag_keys")
        tags = tuple(literal(tags, {}, assigned) or ()) if tags is not None else ()
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found[name.value] = Metric(kind, literal(text, {}, assigned) or "", tags)
            continue
        assert id(call) in expanded, f"{where}:{call.lineno}: cannot read the metric name {ast.unparse(name)}"
        for metric, env in expanded[id(call)]:
            found[metric] = Metric(kind, literal(text, env, assigned) or "", tags)
    return found


def argument(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    """The call's argument by keyword, or (index >= 0) by position."""
    named = next((k.value for k in call.keywords if k.arg == keyword), None)
    if named is not None or index < 0:
        return named
    return call.args[index] if len(call.args) > index else None


def literal(node: ast.expr | None, env: dict[str, str], assigned: dict[str, object]):
    """A literal's value; a name bound by the comprehension (`env`) or by one plain assignment (`assigned`)."""
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return env.get(node.id, assigned.get(node.id))
    return ast.literal_eval(node)


def tuple_assignments(tree: ast.Module) -> dict[str, object]:
    """name -> value of each `name = (literal, ...)` in the module (a shared tag_keys tuple)."""
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Tuple)
        and all(isinstance(e, ast.Constant) for e in node.value.elts)
    }


def metric_calls(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """(kind, call) for each construction of a ray.util.metrics class this module imports."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "ray.util.metrics"
        for alias in node.names
        if alias.name in METRIC_KINDS
    }
    return [
        (call.func.id, call)
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in imported
    ]


def comprehension_names(tree: ast.Module) -> dict[int, list[tuple[str, dict[str, str]]]]:
    """id(call) -> (name, the comprehension's bindings for it) for each name of an f-string-named metric built in a
    comprehension over a literal dict's items or keys (`{name: Gauge(f"etrain_{name}", text, ...) for name, text in
    {...}.items()}`)."""
    names = {}
    for comp in ast.walk(tree):
        for gen in getattr(comp, "generators", []):
            it = gen.iter
            if not (
                isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and isinstance(it.func.value, ast.Dict)
            ):
                continue
            targets = gen.target.elts if isinstance(gen.target, ast.Tuple) else [gen.target]
            items = [
                (ast.literal_eval(k), ast.literal_eval(v)) for k, v in zip(it.func.value.keys, it.func.value.values)
            ]
            for call in ast.walk(comp):
                if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.JoinedStr):
                    bound = [dict(zip([t.id for t in targets], item)) for item in items]
                    names[id(call)] = [(render(call.args[0], env), env) for env in bound]
    return names


def render(fstring: ast.JoinedStr, env: dict[str, str]) -> str:
    parts = []
    for v in fstring.values:
        if isinstance(v, ast.Constant):
            parts.append(v.value)
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in env:
            parts.append(env[v.value.id])
        else:
            raise AssertionError(f"cannot read the metric name {ast.unparse(fstring)}")
    return "".join(parts)
