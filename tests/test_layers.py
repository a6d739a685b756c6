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


# What decides the mode a run trains in: the config's own validation and the registry read it; the training
# machinery (the control plane and the worker) never does (the command line, the driver and reports may still
# describe a run's layout, or check a reward file a user gave)
MACHINERY = ("etrain.control", "etrain.worker")
CHECKED = sorted(p for p in SOURCES if layer(".".join(p.relative_to(ROOT).with_suffix("").parts)) in MACHINERY)


def mode_tests(path: Path) -> list[str]:
    """The lines where `path` branches on which mode it trains in: a condition (if, while, a conditional
    expression, a boolean operand, an assert) that reads comm.mode or ppo.reward, or compares a layout's ranks with
    a number (a layout's size as a quantity, ranks × replicas, is no test)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        tests = []
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests += node.values
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
        for test in tests:
            text = ast.unparse(test)
            reads_mode = any(key in text for key in ("comm.mode", "ppo.reward"))
            compares_ranks = any(
                isinstance(n, ast.Compare)
                and "ranks" in ast.unparse(n)
                and any(isinstance(c, ast.Constant) and isinstance(c.value, int) for c in [n.left, *n.comparators])
                for n in ast.walk(test)
            )
            if reads_mode or compares_ranks:
                found.append(f"line {test.lineno}: {text}")
    return sorted(set(found))


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_mode_branches_outside_the_registry(path):
    """Issue 42: one spec per training mode (etrain/core/modes.py), looked up once by both sides; the code acts on
    its policies and its engine and stepper, and never asks again which mode it is in."""
    wrong = mode_tests(path)
    assert not wrong, f"{path.relative_to(ROOT)} branches on the training mode: {wrong}; put it in the mode's spec"


FAMILY_FOLDERS = sorted(p.name for p in (ROOT / "etrain" / "core" / "models").iterdir() if (p / "__init__.py").exists())
OUTSIDE_MODELS = [p for p in SOURCES if not p.is_relative_to(ROOT / "etrain" / "core" / "models")]


def family_tests(source: str) -> list[str]:
    """Where `source` names a family's parts or asks which family it has: an import from a family's folder, or a
    comparison of something with a family's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(n.startswith(f"etrain.core.models.{f}") for n in names for f in FAMILY_FOLDERS):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in FAMILY_FOLDERS for s in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_family_folders_are_found():
    assert {"gpt", "llama"} <= set(FAMILY_FOLDERS), FAMILY_FOLDERS
    caught = "from etrain.core.models.llama.model import Llama\nif cfg.model.family == 'gpt':\n    pass\n"
    assert len(family_tests(caught)) == 2, "the check finds an import of a family's module and a test of its name"
    assert not family_tests("if cfg.model.spec.hf is None:\n    pass\n")


@pytest.mark.parametrize("path", OUTSIDE_MODELS, ids=lambda p: str(p.relative_to(ROOT)))
def test_families_only_through_their_spec(path):
    """Issue 42: one spec per model family (etrain/core/models/<family>/); outside that package the code reads the
    spec (cfg.model.spec, make_model) and never names a family's modules or tests a family's name."""
    wrong = family_tests(path.read_text())
    assert not wrong, f"{path.relative_to(ROOT)} names a model family: {wrong}; put it in the family's spec"
