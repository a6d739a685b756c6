"""Imports point one way (DESIGN.md, "Shape"): app.core at the bottom, then pipelines, then actors; app
on top, the only place that imports actors; tune is handed the training function by its caller. Lazy
imports inside functions count too: they are imports all the same."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {  # layer -> the layers it may import
    "app.core": {"app.core"},
    "pipelines": {"app.core", "pipelines"},
    "actors": {"app.core", "pipelines", "actors"},
    "tune": {"app.core", "tune"},
    "app": {"app.core", "pipelines", "actors", "tune", "app"},
}


def layer(module: str) -> str | None:
    if module == "app.core" or module.startswith("app.core."):
        return "app.core"
    top = module.split(".")[0]
    return top if top in ("pipelines", "actors", "tune", "app") else None


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if layer(f"{node.module}.{a.name}") == "app.core"}
    return found


SOURCES = sorted(p for top in ("app", "pipelines", "actors", "tune") for p in (ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = layer(module)
    wrong = sorted(m for m in imports(path) if layer(m) is not None and layer(m) not in ALLOWED[mine])
    assert not wrong, f"{module} ({mine}) imports {wrong}: against the layers"


ACTORS = [p for p in SOURCES if p.parts[len(ROOT.parts)] == "actors"]


@pytest.mark.parametrize("path", ACTORS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_worker_and_the_coordinator_side_share_only_the_protocol(path):
    """Inside `actors`, the worker (actors/worker/) and the coordinator's side (the rest) meet over Ray calls and
    actors/protocol.py's types. The one import across: the pool starts workers (the package's `spawn`)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = {m for m in imports(path) if m.startswith("actors.") and m != module}
    if module.startswith("actors.worker"):
        across = sorted(m for m in mine if not m.startswith("actors.worker") and m != "actors.protocol")
    else:
        across = sorted(
            m for m in mine if m.startswith("actors.worker") and (m, module) != ("actors.worker", "actors.pool")
        )
    assert not across, (
        f"{module} imports {across} across the worker/coordinator line: put what both need in actors.protocol"
    )
