"""The README documents what the code defines (unit tier: no Ray, no network, a few seconds).

Each list is derived from the code, never written out here: the config keys by walking the pydantic model tree of
`etrain.core.config.Config`; the record kinds and their fields from the dataclasses of `etrain/core/records.py` (a kind
given as a call argument, `Rewind`'s resume and rollback, from its call sites, by `ast`); the Prometheus names from
the `ray.util.metrics` constructors anywhere in etrain/, by `ast`; the commands and
options from `etrain`'s argparse parser. Each must appear in its reference section of README.md, so a key, kind,
metric or option added to the code fails here until it is documented. Also: every notebook is described, every bench
has a section in bench/README.md with its command and results file, and the links between the two resolve.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import typing
from pathlib import Path

import pytest
from metric_source import declared_metrics
from pydantic import BaseModel

from etrain.core import records
from etrain.core.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
CODE = ("etrain",)


def section(path: Path, title: str) -> str:
    """The text under a heading named `title`, up to the next heading of its level or above."""
    text = path.read_text()
    found = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.M)
    assert found, f"{path.name} has no heading {title!r}: the reference the code is checked against"
    level = len(found.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, found.end())
    return text[found.end() : end.start() if end else len(text)]


def mentioned(name: str, text: str) -> bool:
    """`name` as a whole token: `train.steps` is not found in `train.steps_x` nor `ray_etrain_step` in `..._seconds`."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def missing_message(what: str, missing: list[str], where: str, how: str) -> str:
    return f"{len(missing)} {what} not documented: {', '.join(missing)}. Add each to {where} ({how})."


def code_files() -> list[Path]:
    return sorted(p for folder in CODE for p in (ROOT / folder).rglob("*.py"))


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


# -- config keys ------------------------------------------------------------------------------------------------


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every key of the tree as the README writes it: `section.key`, nested sections dotted (`finetune.lora.rank`),
    and the items of a list of sections as `name[].key` (`faults[].rank`)."""
    keys = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if inspect.isclass(kind) and issubclass(kind, BaseModel):
            keys += config_keys(kind, f"{prefix}{name}.")
        elif inspect.isclass(item) and issubclass(item, BaseModel):
            keys += [f"{prefix}{name}", *config_keys(item, f"{prefix}{name}[].")]
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_config_keys_are_read_from_the_tree():
    keys = config_keys()
    assert {"train.steps", "timeouts.collective_s", "finetune.lora.rank", "faults[].rank"} <= set(keys)
    assert len(keys) == len(set(keys)) > 100


def test_every_config_key_is_in_the_readme():
    text = section(README, "Config keys")
    missing = [k for k in config_keys() if not mentioned(k, text)]
    assert not missing, missing_message(
        "config keys", missing, 'README.md, "Config keys"', "a row `| `section.key` | default | what |`"
    )


# -- record kinds -----------------------------------------------------------------------------------------------


def record_classes() -> list[type]:
    """Every record dataclass of etrain/core/records.py (those with a `kind`)."""
    return [
        cls
        for _, cls in inspect.getmembers(records, inspect.isclass)
        if cls.__module__ == records.__name__
        and dataclasses.is_dataclass(cls)
        and "kind" in {*typing.get_type_hints(cls), *(f.name for f in dataclasses.fields(cls))}
        and cls is not records.Record
    ]


def kinds_passed(name: str) -> set[str]:
    """The string constants handed as `kind` to `name` (the dataclass) or to a function named after it (`_rewind`),
    anywhere in the code: the kinds of a record whose kind is a field, not a constant of its class."""
    found = set()
    for path in code_files():
        for call in ast.walk(parsed(path)):
            if not isinstance(call, ast.Call):
                continue
            func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if func.strip("_").lower() != name.lower():
                continue
            args = [*call.args, *(k.value for k in call.keywords if k.arg == "kind")]
            found |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return found


def record_kinds() -> dict[str, list[str]]:
    """kind -> its fields (besides kind and step; `extra` is spread into a train record's line)."""
    kinds = {}
    for cls in record_classes():
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in ("kind", "step", "extra")]
        constant = getattr(cls, "kind", None)
        names = [constant] if isinstance(constant, str) else sorted(kinds_passed(cls.__name__))
        assert names, f"records.{cls.__name__}: no kind found (a ClassVar `kind`, or a constant at a call site)"
        kinds |= dict.fromkeys(names, fields)
    return kinds


def test_record_kinds_are_read_from_the_code():
    kinds = record_kinds()
    assert {"train", "eval", "membership", "health", "resume", "rollback"} <= set(kinds)
    assert "eval_reward" in kinds["eval"]


def test_every_record_kind_and_field_is_in_the_readme():
    text = section(README, "Records")
    kinds = record_kinds()
    missing = [k for k in kinds if f"`{k}`" not in text]
    assert not missing, missing_message(
        "record kinds", missing, 'README.md, "Records"', "a row `| `kind` | when | fields |`"
    )
    fields = sorted({f"{k}.{f}" for k, fs in kinds.items() for f in fs if not mentioned(f, text)})
    assert not fields, missing_message("record fields", fields, 'README.md, "Records"', "in its kind's row")


# -- dashboard metrics ------------------------------------------------------------------------------------------


def exported_metrics() -> dict[str, str]:
    """Prometheus name as the README writes it -> the file that declares it. Ray's exporter adds `ray_`, and
    `_total` to a Counter; a Histogram is named by its base (its `_bucket`/`_count`/`_sum` series follow)."""
    exported = {}
    for path in code_files():
        where = str(path.relative_to(ROOT))
        for name, kind in declared_metrics(parsed(path), where).items():
            exported[f"ray_{name}_total" if kind == "Counter" else f"ray_{name}"] = where
    return exported


def test_metrics_are_read_from_the_code():
    metrics = exported_metrics()
    assert {"ray_etrain_loss", "ray_etrain_scale_events_total", "ray_etrain_grad_norm_distribution"} <= set(metrics)
    assert {"ray_etrain_replicas", "ray_etrain_node_risk"} <= set(metrics)


def test_every_exported_metric_is_in_the_readme():
    text = section(README, "Dashboard metrics")
    missing = [f"{m} ({src})" for m, src in exported_metrics().items() if not mentioned(m, text)]
    assert not missing, missing_message(
        "metrics", missing, 'README.md, "Dashboard metrics"', "a row `| `ray_name{tags}` | what |`"
    )


# -- the rest of the reference ----------------------------------------------------------------------------------


def test_every_command_and_option_is_in_the_readme():
    from etrain.cli import _parser  # argparse only: commands import what they use when they run

    # argparse keeps its subcommands in a private list; nothing public walks them

    text = section(README, "Command line")
    commands = next(a for a in _parser()._actions if a.choices and isinstance(a.choices, dict)).choices
    missing = [f"etrain {name}" for name in commands if f"`etrain {name}" not in text]
    for name, sub in commands.items():
        flags = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing += [f"etrain {name} {flag}" for flag in sorted(flags) if not mentioned(flag, text)]
    assert not missing, missing_message("commands or options", missing, 'README.md, "Command line"', "its row")


def test_every_notebook_is_in_the_readme():
    text = section(README, "Notebooks")
    missing = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if p.name not in text]
    assert not missing, missing_message("notebooks", missing, 'README.md, "Notebooks"', "what it shows")


def test_every_bench_has_a_section_with_its_command_and_results():
    text = BENCH_README.read_text()
    benches = [p for p in sorted((ROOT / "bench").glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert benches
    missing = [p.name for p in benches if f"python bench/{p.name}" not in text]
    assert not missing, missing_message("benches", missing, "bench/README.md", "a section with its command")
    results = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    unnamed = [name for name in results if f"results/{name}" not in text]
    assert not unnamed, missing_message("results files", unnamed, "bench/README.md", "the section it comes from")
    named = set(re.findall(r"results/(\w+\.json)", text))
    assert named <= set(results), (
        f"bench/README.md names results files that do not exist: {sorted(named - set(results))}"
    )


def test_the_contents_link_every_section_after_it():
    text = README.read_text()
    after = text[text.index("## Contents") :]
    sections = [h for h in re.findall(r"^## (.+)$", after, re.M) if h != "Contents"]
    contents = section(README, "Contents")
    missing = [h for h in sections if f"(#{slug(h)})" not in contents]
    assert not missing, f'README.md, "Contents" links no {missing}: add `[title](#anchor)` for each'


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no headings inside code blocks
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", [README, BENCH_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_the_docs_resolve(doc):
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
        page = (doc.parent / target).resolve() if target else doc
        if not page.exists() or anchor not in anchors(page):
            broken.append(f"{target}#{anchor}")
    for target in re.findall(r"\]\(([^)#\s:]+)\)", doc.read_text()):
        if not (doc.parent / target).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: links to no heading or file: {broken}"
