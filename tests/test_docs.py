"""The docs document what the code defines (unit tier: no Ray, no network, a few seconds).

The reference pages in docs/reference/ are written from the code by docs/reference.py (config keys from the pydantic
tree of `etrain.core.config.Config`, record kinds and fields from `etrain.core.records`, metrics from the
`ray.util.metrics` constructors in etrain/ by `ast`, commands and options from `etrain`'s argparse parser); here they
are written again in memory and must equal the committed ones, so a key, kind, metric or option added to the code
fails until `python docs/reference.py` has run. The same lists must each appear in their page. Also: the README stays
short, every notebook is described, every bench has a section in bench/README.md with its command and results file,
and every relative link between the README, docs/ and bench/ resolves to a file and a heading.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from helpers.metric_source import declared_metrics

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
BENCH_README = ROOT / "bench" / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md")), BENCH_README, ROOT / "notebooks" / "README.md"]
README_LINES = 600  # a page a newcomer reads in ten minutes; the details go to docs/


def load_reference():
    """docs/reference.py, the generator, imported from its file (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "reference.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


reference = load_reference()


def section(path: Path, title: str) -> str:
    """The text under a heading named `title`, up to the next heading of its level or above."""
    text = path.read_text()
    found = re.search(rf"^(#+) {re.escape(title)}\s*$", text, re.M)
    assert found, f"{path.name} has no heading {title!r}"
    level = len(found.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, found.end())
    return text[found.end() : end.start() if end else len(text)]


def mentioned(name: str, text: str) -> bool:
    """`name` as a whole token: `train.steps` is not found in `train.steps_x` nor `ray_etrain_step` in `..._seconds`."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def missing_message(what: str, missing: list[str], where: str) -> str:
    return (
        f"{len(missing)} {what} not documented in {where}: {', '.join(missing)}. Run `python docs/reference.py` and "
        "commit what it writes."
    )


# -- the reference is the code's ---------------------------------------------------------------------------------


def test_the_committed_reference_is_what_the_code_writes():
    pages = reference.pages()
    stale = [
        name
        for name, text in pages.items()
        if not (REFERENCE / name).exists() or (REFERENCE / name).read_text() != text
    ]
    extra = sorted(p.name for p in REFERENCE.glob("*.md") if p.name not in pages)
    assert not stale, f"docs/reference/{', '.join(stale)} differ from the code: run `python docs/reference.py`"
    assert not extra, f"docs/reference/ holds pages docs/reference.py does not write: {extra}; remove them"


def test_config_keys_are_read_from_the_tree():
    keys = [k.key for k in reference.config_keys()]
    assert {"train.steps", "timeouts.collective_s", "finetune.lora.rank", "faults[].rank"} <= set(keys)
    assert {"model.rope_scaling.factor", "prepare.tokenizer.vocab_size"} <= set(keys)  # a section a value may be
    assert len(keys) == len(set(keys)) > 100


def test_every_config_key_is_in_the_reference():
    text = (REFERENCE / "config.md").read_text()
    missing = [k.key for k in reference.config_keys() if not mentioned(k.key, text)]
    assert not missing, missing_message("config keys", missing, "docs/reference/config.md")


def test_record_kinds_are_read_from_the_code():
    kinds = {kind: cls for names, cls in reference.record_kinds().items() for kind in names}
    assert {"train", "eval", "membership", "health", "resume", "rollback", "outer"} <= set(kinds)
    assert "eval_reward" in {name for name, _, _ in reference.record_fields(kinds["eval"])}


def test_every_record_kind_and_field_is_in_the_reference():
    text = (REFERENCE / "records.md").read_text()
    missing = []
    for names, cls in reference.record_kinds().items():
        part = section(REFERENCE / "records.md", ", ".join(f"`{k}`" for k in names))
        missing += [f"{names[0]}.{field}" for field, _, _ in reference.record_fields(cls) if f"`{field}`" not in part]
    missing += [k for names in reference.record_kinds() for k in names if f"`{k}`" not in text]
    assert not missing, missing_message("record kinds or fields", missing, "docs/reference/records.md")


def test_metrics_are_read_from_the_code():
    metrics = reference.exported_metrics()
    assert {"ray_etrain_loss", "ray_etrain_scale_events_total", "ray_etrain_grad_norm_distribution"} <= set(metrics)
    assert {"ray_etrain_replicas", "ray_etrain_node_risk"} <= set(metrics)
    assert all(metric.description for metric, _ in metrics.values())


def test_every_exported_metric_is_in_the_reference():
    """Counted the way tests/test_grafana.py counts them (`declared_metrics`), not through the generator."""
    text = (REFERENCE / "metrics.md").read_text()
    names = set()
    for path in reference.code_files():
        for name, kind in declared_metrics(reference.parsed(path), str(path)).items():
            names.add(f"ray_{name}_total" if kind == "Counter" else f"ray_{name}")
    missing = sorted(m for m in names if not mentioned(m, text))
    assert names and not missing, missing_message("metrics", missing, "docs/reference/metrics.md")


def test_every_command_and_option_is_in_the_reference():
    text = (REFERENCE / "cli.md").read_text()
    commands = reference.commands()
    assert {"train", "finetune", "prepare", "status", "cluster"} <= set(commands)
    missing = [f"etrain {name}" for name in commands if f"## etrain {name}\n" not in text]
    for name, sub in commands.items():
        part = section(REFERENCE / "cli.md", f"etrain {name}")
        flags = {o for a in reference.options(sub) for o in a.option_strings}
        missing += [f"etrain {name} {flag}" for flag in sorted(flags) if not mentioned(flag, part)]
    assert not missing, missing_message("commands or options", missing, "docs/reference/cli.md")


def test_every_run_directory_file_is_one_the_code_writes():
    code = "\n".join(p.read_text() for p in reference.code_files())
    unknown = [path for path, needle, _ in reference.RUN_FILES if needle not in code]
    assert not unknown, f"docs/reference.py's RUN_FILES names files no code in etrain/ mentions: {unknown}"


def test_the_text_kept_beside_the_code_names_only_what_the_code_has_and_does_not_say():
    """The generator's own descriptions (CONFIG_TEXT, RECORD_WHEN, FIELD_TEXT) fill in what the code does not say;
    one the code now says, or about something gone, is to be deleted."""
    keys = {k.key for k in reference.config_keys()}
    gone = [k for k in reference.CONFIG_TEXT if k not in keys]
    said = [k for k in reference.CONFIG_TEXT if k in keys and described(k)]
    kinds = {kind: cls for names, cls in reference.record_kinds().items() for kind in names}
    gone += [k for k in reference.RECORD_WHEN if k not in kinds]
    said += [
        k for k in reference.RECORD_WHEN if k in kinds and not kinds[k].__doc__.startswith(kinds[k].__name__ + "(")
    ]
    for key in reference.FIELD_TEXT:
        kind, field = key.split(".")
        found = {name: what for name, _, what in reference.record_fields(kinds[kind])} if kind in kinds else {}
        gone += [key] if field not in found else []
        said += [key] if found.get(field) else []
    assert not gone, f"docs/reference.py describes what the code no longer has: {gone}; delete those entries"
    assert not said, f"docs/reference.py describes what the code now says itself: {said}; delete those entries"


def described(key: str) -> bool:
    """Whether the code itself describes a config key: its field's description or its section's docstring list."""
    *path, leaf = re.split(r"\.|\[\]\.", key)
    model = reference.Config
    for part in path:
        kind = model.model_fields[part].annotation
        args = [a for a in (kind, *getattr(kind, "__args__", ())) if reference.is_section(a)]
        model = args[0]
    field = model.model_fields[leaf]
    return bool(field.description or reference.bulleted(model.__doc__).get(leaf))


# -- the README and the pages --------------------------------------------------------------------------------------


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines < README_LINES, f"README.md has {lines} lines: keep it under {README_LINES}; move details to docs/"


def test_every_notebook_is_in_the_readme():
    text = section(README, "Notebooks")
    missing = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if p.name not in text]
    assert not missing, f'README.md, "Notebooks", does not describe {missing}: say what each shows'


def test_every_bench_has_a_section_with_its_command_and_results():
    text = BENCH_README.read_text()
    benches = [p for p in sorted((ROOT / "bench").glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert benches
    missing = [p.name for p in benches if f"python bench/{p.name}" not in text]
    assert not missing, f"bench/README.md has no section with the command of {missing}"
    results = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    unnamed = [name for name in results if f"results/{name}" not in text]
    assert not unnamed, f"bench/README.md names no section for the results {unnamed}"
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


def without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    """The page's heading anchors as GitHub makes them (a repeated one gets -1, -2, ...), none inside code blocks."""
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", without_code(path.read_text()), re.M):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def test_the_pages_are_all_checked():
    assert {"training.md", "config.md", "records.md", "metrics.md", "cli.md", "contributing.md"} <= {
        p.name for p in PAGES
    }


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_a_heading(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        if not page.exists() or (anchor and (page.suffix != ".md" or anchor not in anchors(page))):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to no file or heading: {broken}"
