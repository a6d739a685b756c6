"""Imports point one way (DESIGN.md, "Shape"), inside the one `etrain` package: etrain.core at the bottom, then
etrain.data, then the worker, then the control plane (actors both), then the driver and the command line on top;
etrain.tune is handed the training function by its caller. Lazy imports inside functions count too: they are
imports all the same."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("etrain.core", "etrain.data", "etrain.worker", "etrain.control", "etrain.tune", "etrain.driver", "etrain.cli")
ALLOWED = {  # layer -> the layers it may import
    "etrain.core": {"etrain.core"},
    "etrain.data": {"etrain.core", "etrain.data"},
    "etrain.worker": {"etrain.core", "etrain.data", "etrain.worker"},
    "etrain.control": {"etrain.core", "etrain.data", "etrain.worker", "etrain.control"},
    "etrain.tune": {"etrain.core", "etrain.tune"},
    "etrain.driver": {"etrain.core", "etrain.data", "etrain.worker", "etrain.control", "etrain.tune", "etrain.driver"},
    "etrain.cli": set(LAYERS),
}


def layer(module: str) -> str | None:
    return next((top for top in LAYERS if module == top or module.startswith(top + ".")), None)


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {
                f"{node.module}.{a.name}" for a in node.names if layer(f"{node.module}.{a.name}") == "etrain.core"
            }
    return found


SOURCES = sorted(p for p in (ROOT / "etrain").rglob("*.py") if p != ROOT / "etrain" / "__init__.py")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = layer(module)
    assert mine is not None, f"{module} is in no layer: put it in one of {LAYERS}"
    wrong = sorted(m for m in imports(path) if layer(m) is not None and layer(m) not in ALLOWED[mine])
    assert not wrong, f"{module} ({mine}) imports {wrong}: against the layers"


ACTORS = [p for p in SOURCES if layer(".".join(p.relative_to(ROOT).with_suffix("").parts)) == "etrain.control"]


@pytest.mark.parametrize("path", ACTORS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_control_plane_reaches_the_worker_only_through_its_protocol(path):
    """The worker (etrain/worker/) and the control plane (etrain/control/) meet over Ray calls and
    etrain/worker/protocol.py's types. The one other import: the pool starts workers (the package's `spawn`)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    across = sorted(
        m
        for m in imports(path)
        if layer(m) == "etrain.worker"
        and m != "etrain.worker.protocol"
        and (m, module) != ("etrain.worker", "etrain.control.pool")
        and not (m.startswith("etrain.worker.protocol."))
    )
    assert not across, f"{module} imports {across} from the worker: put what both need in etrain.worker.protocol"
