"""The metrics the code declares, read from its source (no Ray): the Grafana and the docs tests check them."""

from __future__ import annotations

import ast

METRIC_KINDS = ("Gauge", "Counter", "Histogram")


def declared_metrics(tree: ast.Module, where: str = "") -> dict[str, str]:
    """metric name as given to ray.util.metrics -> its kind, for each construction in `tree`. A name is a string
    literal, or an f-string over the variable of a comprehension that iterates a literal dict (the gauges table):
    that one stands for every key of the dict."""
    expanded = comprehension_names(tree)
    names = {}
    for kind, call in metric_calls(tree):
        arg = call.args[0] if call.args else next(k.value for k in call.keywords if k.arg == "name")
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found = [arg.value]
        else:
            assert id(call) in expanded, f"{where}:{call.lineno}: cannot read the metric name {ast.unparse(arg)}"
            found = expanded[id(call)]
        names |= dict.fromkeys(found, kind)
    return names


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


def comprehension_names(tree: ast.Module) -> dict[int, list[str]]:
    """id(call) -> the names of an f-string-named metric built in a comprehension over a literal dict's keys
    (`{name: Gauge(f"etrain_{name}", ...) for name, text in {...}.items()}`)."""
    names = {}
    for comp in ast.walk(tree):
        for gen in getattr(comp, "generators", []):
            it = gen.iter
            if not (
                isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and isinstance(it.func.value, ast.Dict)
            ):
                continue
            var = gen.target.elts[0] if isinstance(gen.target, ast.Tuple) else gen.target
            keys = [ast.literal_eval(k) for k in it.func.value.keys]
            for call in ast.walk(comp):
                if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.JoinedStr):
                    names[id(call)] = [render(call.args[0], {var.id: k}) for k in keys]
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
