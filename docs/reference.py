"""The reference pages in docs/reference/, written from the code: `python docs/reference.py` writes them, and
tests/test_docs.py fails when the committed pages differ from what it would write now.

    config.md          every key of etrain.core.config.Config (its pydantic tree): key, type, default, description
    records.md         every record kind of etrain.core.records (its dataclasses) and their fields
    metrics.md         every metric the code publishes with ray.util.metrics (read from the source, no Ray)
    cli.md             every command and option of `etrain` (its argparse parser)
    run-directory.md   the files a run directory holds

Descriptions come from the code: field descriptions, docstrings, comments, help strings. Where the code has none,
the small tables below give the text; tests/test_docs.py holds them to name only what the code has and does not
describe itself, so they shrink as the code grows its own.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from etrain.core import records
from etrain.core.config import Config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference"
CODE = ROOT / "etrain"
HEADER = "<!-- Written by docs/reference.py from the code: edit the code (or that script), then run it. -->\n\n"

# -- text the code does not hold (yet) -----------------------------------------------------------------------------

CONFIG_TEXT = {  # keys whose field has no description and whose section's docstring lists none for it
    "model.positions": "`rotary` or `learned` position embeddings",
    "model.dropout": "dropout on the embeddings, in attention and in the MLP; 0 = none (in a layout: "
    "[Model parallelism](../parallelism.md#one-replicas-layout))",
    "prepare.tokenizer.train": "`bpe`: learn a byte-level BPE",
    "prepare.min_mean_word_length": "shortest mean word length; below `max_mean_word_length`",
    "prepare.max_mean_word_length": "longest mean word length",
    "prepare.minhash_perms": "MinHash permutations per document",
    "train.seed": "the run's seed: the sample order, the initial weights, each step's RNG",
    "optim.lr": "the peak learning rate, after the warm-up",
    "optim.min_lr": "the schedule's floor: `cosine` ends there, `cosine_restarts` falls to it in each cycle",
    "optim.warmup_steps": "steps of the linear warm-up",
    "optim.weight_decay": "decoupled, on matrices only",
    "optim.beta1": "the optimizer's first beta (AdamW and LAMB alike)",
    "optim.beta2": "the second beta",
    "cluster.num_workers": "workers at the start",
    "model.rope_scaling.factor": "the rotary frequencies of long wavelengths are divided by this",
    "model.rope_scaling.low_freq_factor": "wavelengths longer than original_max_position_embeddings / "
    "low_freq_factor are scaled in full",
    "model.rope_scaling.high_freq_factor": "wavelengths shorter than original_max_position_embeddings / "
    "high_freq_factor are kept; those between, interpolated",
    "model.rope_scaling.original_max_position_embeddings": "the context length the model was pre-trained at",
    "faults[].rank": "the rank that fails",
    "faults[].step": "the step (from 1) at which it fails",
    "faults[].kind": "how it fails (above); a drill of a slowly failing node: "
    "[Node health](../elastic.md#node-health-predictive-maintenance); `link`: "
    "[A simulated link](../gradient-sync.md#a-simulated-link)",
}

SECTIONS = {  # each top-level section: what it is for, and the page that explains it
    "model": "The model's family and shape: see [Models](../models.md)",
    "data": "The corpus, its shards and each node's cache: see [Data](../data.md)",
    "prepare": "See [Preparing a corpus](../data.md#preparing-a-corpus)",
    "train": "Steps, batch, precision, evaluation and the stability guards: see [Training](../training.md)",
    "optim": "AdamW or LAMB, a warm-up then cosine or cosine restarts: see "
    "[Optimizer and schedule](../training.md#optimizer-and-schedule)",
    "comm": "See [Gradient sync](../gradient-sync.md)",
    "balance": "See [Straggler balancing](../gradient-sync.md#straggler-balancing)",
    "checkpoint": "See [Checkpoints](../training.md#checkpoints)",
    "cluster": "Workers, CPUs and GPUs each, the Ray address: see [Elastic training](../elastic.md) and "
    "[On a cluster](../cluster.md)",
    "parallel": "A replica's tensor, pipeline and sharded layout: see [Model parallelism](../parallelism.md)",
    "finetune": "A base and LoRA: see [Fine-tuning](../finetuning.md)",
    "ppo": "See [PPO](../finetuning.md#ppo) and [GRPO](../finetuning.md#grpo)",
    "timeouts": "The one nested timeout hierarchy: where torch would wait 30 minutes by default, a dead or hung "
    "peer becomes an error within these bounds; the config refuses timeouts that do not nest",
    "health": "Predictive maintenance: see [Node health](../elastic.md#node-health-predictive-maintenance)",
    "run": "See [Run directory](run-directory.md)",
    "faults": "Injected failures for tests and drills (`etrain/control/faults.py`), a list",
}

RECORD_WHEN = {  # record kinds whose dataclass has no docstring
    "eval": "an evaluation",
    "autoscale": "the autoscaling policy wants another size",
    "nan_rollback": "a non-finite gradient rolled the run back to `to_step` with the lr scaled by `lr_scale` "
    "([Stability guards](../training.md#stability-guards))",
    "checkpoint": "a save committed ([Checkpoints](../training.md#checkpoints))",
    "checkpoint_failed": "a save not written: the run goes on, and only a failed final checkpoint fails the job",
    "warning": "something to know (MFU above 100%), shown by the driver",
}

FIELD_TEXT = {  # record fields with no comment in records.py
    "train.world_size": "members that ran the step",
    "train.batch": "samples the step took",
    "train.loss": "the batch's mean training loss",
    "train.lr": "the step's learning rate",
    "train.grad_norm": "the global gradient norm, before clipping",
    "train.tokens_per_s": "the step's throughput",
    "train.step_time_s": "the step's wall time on the coordinator",
    "train.worker_s": "the slowest worker's own time for the step",
    "train.mfu": "model FLOPs utilisation (GPU only: [MFU](../monitoring.md#mfu))",
    "train.shares": "each worker's samples of the batch",
    "train.speeds": "each worker's measured speed (samples per second of its own compute)",
    "train.comm_bytes": "what the workers handed to the collectives",
    "train.dense_bytes": "what plain all-reduce would have sent",
    "train.data_wait_s": "the slowest worker's wait for data",
    "train.cache_hits": "shard requests the node caches served",
    "train.cache_misses": "shard requests the node caches fetched",
    "train.fetched_bytes": "bytes the node caches fetched from storage",
    "train.fetched_shards": "shards the node caches fetched from storage",
    "train.compute_s": "forward and backward",
    "train.communication_s": "collective time not hidden behind the backward pass",
    "train.other_s": "the worker's rest",
    "train.checkpoint_stall_s": "how long a save held the step up",
    "eval.eval_loss": "the loss on `train.eval_samples` held-out sequences",
    "membership.world_before": "members before the change",
    "membership.world_after": "members after it",
    "membership.lost": "members lost",
    "membership.joiners": "members that joined",
    "membership.joiner_nodes": "the nodes the joiners came from",
    "membership.draining_nodes": "nodes whose members leave (preempted or at risk)",
    "membership.joined": "process: Ray's start of the worker's process; imports; build: model, optimizer, data; "
    "warm_up; attach: its node's shard cache; wait: until the change",
    "start.phases": "connect: Ray started or joined; coordinator: workers asked for, the coordinator started; "
    "workers: their processes built (torch, the model); form: cache attach and the process group; load: a resume's "
    "checkpoint; first_step",
    "autoscale.world": "members now",
    "autoscale.wanted": "the size the policy wants",
    "balance.balanced": "true: shares follow speeds (a straggler was seen); false: equal shares",
    "balance.shares": "each worker's samples of the batch from now on",
    "outlier.grad_norm": "the step's gradient norm",
    "outlier.limit": "the running mean + `train.outlier_sigmas` standard deviations it passed",
    "outlier.batch": "the step's samples, written to `quarantine.jsonl`",
    "outlier.guard_restarted": "`train.outlier_patience` outliers in a row: the guard starts over",
    "nan_rollback.to_step": "the checkpoint's step the run went back to",
    "nan_rollback.lr_scale": "the lr's scale from now on (halved at each rollback)",
    "checkpoint.level": "`light` or `full`",
    "checkpoint.path": "the checkpoint's directory",
    "checkpoint.bytes": "its parts' bytes",
    "checkpoint.stall_s": "how long the save held training up",
    "checkpoint.save_s": "from the save's start to its commit",
    "checkpoint.retain_error": "removing older checkpoints failed: the new one stands",
    "checkpoint_failed.error": "why: a writer failed or was lost, or storage refused the commit marker",
    "outer.path": "the checkpoint loaded (none: no checkpoint, or an outer rewind)",
    "outer.level": "its level",
    "outer.base": "a light checkpoint's full base",
    "outer.reason": "why the run went back",
    "outer.reached_step": "the step the run had reached",
    "outer.records_redone": "records moved to `metrics.redone.jsonl`",
    "outer.load_s": "the checkpoint's load time",
    "health.node": "the node",
    "health.score": "its risk, 0 to 1",
    "health.reasons": "the rules and trends behind the score",
    "health.action": "above",
    "warning.text": "the warning",
}

RECORD_MORE = {  # what a kind carries beyond its dataclass's fields
    "train": "Parameter-server mode adds `pushes`, `max_staleness`, `mean_staleness` and `version`; a PPO step adds "
    "`reward`, `kl`, `kl_coef` (the β the step applied), `kl_base`, `clip_fraction`, `entropy`, `value_loss`, "
    "`policy_loss` and `response_len` ([PPO](../finetuning.md#ppo)); a GRPO step `kl_loss` in place of `value_loss` "
    "([GRPO](../finetuning.md#grpo)).",
    "start": "Not in parameter-server mode.",
}

RUN_FILES = (  # (path in the run directory, a name the code writes it under, what it holds)
    ("config.yaml", "config.yaml", "the resolved config; `--resume` reads it"),
    ("metrics.jsonl", "metrics.jsonl", "one line per event: see [Records](records.md)"),
    (
        "summary.json",
        "summary.json",
        "steps, samples, tokens, first/final loss, final eval loss, tokens/s, wall and start-up time, world size, "
        "config hash",
    ),
    (
        "status.json",
        "status.json",
        "the live state `etrain status` reads, rewritten at most once a second and once more when the job ends "
        "([Monitoring](../monitoring.md))",
    ),
    (
        "checkpoints/step-NNNNNNNN/",
        "commit.json",
        "the parts (`model.pt`; `optim.pt`, or under ZeRO-1 one `optim-NNN.pt` per rank plus `optim-groups.pt`, the "
        "param groups, written by rank 0; `extra.pt`; under top-k, in a full checkpoint of two or more workers, one "
        "`residual-NNN.pt` per rank; a layout's `dcp/` files) + `commit.json` (written last, with sha256); "
        "`checkpoint.uri` may point anywhere fsspec reaches (`s3://...`)",
    ),
    ("checkpoints/cursor.json", "cursor.json", "the step and data cursor after the newest step (the cursor level)"),
    (
        "checkpoints/lease.json",
        "lease.json",
        "the run's owner while a driver trains it ([One driver per run](../training.md#one-driver-per-run))",
    ),
    ("driver.log", "driver.log", "the driver's log, with the traceback of any failure the terminal showed in one line"),
    (
        "metrics.redone.jsonl",
        "metrics.redone.jsonl",
        "records of steps a resume, rollback or outer rewind redid, moved aside so no step appears twice",
    ),
    (
        "quarantine.jsonl",
        "quarantine.jsonl",
        "the samples of updates the outlier guard skipped (`sources`, by step)",
    ),
    ("report/", "report.html", "`etrain report`'s PNG plots and `report.html`"),
)

# -- config keys ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    key: str
    type: str
    default: str
    description: str


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[Key]:
    """Every key of the tree as a user writes it: `section.key`, nested sections dotted (`finetune.lora.rank`), a
    list of sections as `name[].key` (`faults[].rank`), and the keys of a section a value may be instead of a plain
    one (`model.rope_scaling.factor`, `prepare.tokenizer.vocab_size`) under the key itself."""
    keys = []
    described = bulleted(model.__doc__)
    for name, field in model.model_fields.items():
        key, kind = f"{prefix}{name}", field.annotation
        if is_section(kind):
            keys += config_keys(kind, f"{key}.")
            continue
        keys.append(Key(key, type_text(kind), default_text(field), description(key, field, described)))
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if is_section(item):
            keys += config_keys(item, f"{key}[].")
        for member in (m for m in typing.get_args(kind) if is_section(m) and item is None):
            keys += config_keys(member, f"{key}.")
    return keys


def is_section(kind: object) -> bool:
    return inspect.isclass(kind) and issubclass(kind, BaseModel)


def bulleted(doc: str | None) -> dict[str, str]:
    """`- name (default): what` lines of a section's docstring (the timeouts' one table) -> name: what."""
    text = textwrap.dedent("\n".join((doc or "").splitlines()[1:]))
    found = re.findall(r"^- (\w+) \([^)]*\): (.*?)(?=^- |\Z)", text, re.M | re.S)
    return {name: " ".join(what.split()) for name, what in found}


def description(key: str, field: FieldInfo, described: dict[str, str]) -> str:
    text = field.description or described.get(key.rsplit(".", 1)[-1]) or CONFIG_TEXT.get(key)
    if not text:
        raise SystemExit(
            f"config key {key} has no description: give its Field a description= (or add it to CONFIG_TEXT in "
            "docs/reference.py), then run `python docs/reference.py`"
        )
    return text


def type_text(kind: object) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return " or ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(type_text(a) for a in args if a is not type(None))
        return f"{text}, or none" if type(None) in args else text
    if origin is list:
        return f"list of {type_text(args[0])}"
    if is_section(kind):
        return "mapping (keys below)"
    return getattr(kind, "__name__", str(kind))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value} ({value // 2**20} MiB)"
    return str(value)


def config_page() -> str:
    lines = [
        "# Config keys",
        "",
        "One pydantic tree, `etrain.core.config.Config`; each section belongs to one component. A preset "
        "(`--config`, from `etrain/configs/`) or a YAML file gives a tree; `--set section.key=value` overrides one "
        "key; `etrain config` prints the resolved tree, and every run saves it as `config.yaml`. A wrong key or "
        "value stops with exit code 2, naming the key, what it got and what is allowed.",
    ]
    for section, keys in by_section(config_keys()).items():
        lines += ["", f"## {section}", "", f"{SECTIONS[section]}."]
        for key, cls in section_classes(section):
            text = intro(cls)
            lines += ["", f"`{key}`: {text}" if key != section else text] if text else []
        lines += ["", "| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k.key}` | {cell(k.type)} | {cell(k.default)} | {cell(k.description)} |" for k in keys]
    return "\n".join(lines) + "\n"


def by_section(keys: list[Key]) -> dict[str, list[Key]]:
    sections: dict[str, list[Key]] = {}
    for k in keys:
        sections.setdefault(re.split(r"[.\[]", k.key)[0], []).append(k)
    return sections


def section_classes(section: str) -> list[tuple[str, type[BaseModel]]]:
    """(key, model) of the section and of the sections nested in it, whose docstrings introduce its table."""
    kind = Config.model_fields[section].annotation
    kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    if not is_section(kind):
        return []
    nested = [(f"{section}.{n}", f.annotation) for n, f in kind.model_fields.items() if is_section(f.annotation)]
    return [(section, kind), *nested]


def intro(cls: type[BaseModel]) -> str:
    """A section's docstring as prose: its lines joined, its `- name (default): what` list left to the table."""
    doc = cls.__doc__ or ""
    return " ".join(re.split(r"^\s*- \w+ \(", doc, maxsplit=1, flags=re.M)[0].split())


# -- records -------------------------------------------------------------------------------------------------------


def record_classes() -> list[type]:
    """Every record dataclass of etrain.core.records (those with a `kind`)."""
    found = [
        cls
        for _, cls in inspect.getmembers(records, inspect.isclass)
        if cls.__module__ == records.__name__
        and dataclasses.is_dataclass(cls)
        and "kind" in {*typing.get_type_hints(cls), *(f.name for f in dataclasses.fields(cls))}
        and cls is not records.Record
    ]
    return sorted(found, key=lambda cls: inspect.getsourcelines(cls)[1])  # as records.py declares them


def code_files() -> list[Path]:
    return sorted(CODE.rglob("*.py"))


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


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


def record_kinds() -> dict[tuple[str, ...], type]:
    """The kinds each record dataclass is written as -> the class: one kind, or those its call sites pass."""
    kinds = {}
    for cls in record_classes():
        constant = getattr(cls, "kind", None)
        names = (constant,) if isinstance(constant, str) else tuple(sorted(kinds_passed(cls.__name__)))
        if not names:
            raise SystemExit(f"records.{cls.__name__}: no kind found (a ClassVar `kind`, or a constant at a call site)")
        kinds[names] = cls
    return kinds


def record_fields(cls: type) -> list[tuple[str, str, str]]:
    """(field, type, what) of a record class, besides kind, step and extra (spread into a train record's line);
    `what` is the field's comment in records.py."""
    comments = dict(re.findall(r"^    (\w+): [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
    return [
        (f.name, str(f.type).replace(" | None", ", or none"), comments.get(f.name, ""))
        for f in dataclasses.fields(cls)
        if f.name not in ("kind", "step", "extra")
    ]


def records_page() -> str:
    lines = [
        "# Records",
        "",
        "Each line of a run's `metrics.jsonl` is one record, with its `kind`, `step` and `time` (seconds since the "
        "epoch); every kind is a dataclass of `etrain.core.records`. A field without a value is left out of the line.",
        "A step's wall time splits into " + ", ".join(f"`{p}`" for p in records.STEP_PARTS) + " (a train record's "
        "`{part}_s`, the dashboard's `ray_etrain_step_seconds{part}`); a membership change's `phases` are "
        + ", ".join(f"`{p}`" for p in records.CHANGE_PHASES)
        + "; a joiner's arrival before it (`joined`) "
        + ", ".join(f"`{p}`" for p in records.JOIN_PHASES)
        + "; a run's start "
        + ", ".join(f"`{p}`" for p in records.START_PHASES)
        + ", all in seconds.",
    ]
    for kinds, cls in record_kinds().items():
        lines += ["", "## " + ", ".join(f"`{k}`" for k in kinds), "", when(kinds[0], cls)]
        lines += ["", "| field | type | what |", "|---|---|---|"]
        for name, kind, what in record_fields(cls):
            what = what or FIELD_TEXT.get(f"{kinds[0]}.{name}", "")
            lines.append(f"| `{name}` | {cell(kind)} | {cell(what)} |")
        if kinds[0] in RECORD_MORE:
            lines += ["", RECORD_MORE[kinds[0]]]
    return "\n".join(lines) + "\n"


def when(kind: str, cls: type) -> str:
    doc = " ".join((cls.__doc__ or "").split())
    if doc and not doc.startswith(f"{cls.__name__}("):  # a dataclass without a docstring gets its signature
        return doc
    if kind not in RECORD_WHEN:
        raise SystemExit(
            f"record kind {kind} ({cls.__name__}) says nowhere when it is written: give the class a docstring (or add "
            "it to RECORD_WHEN in docs/reference.py), then run `python docs/reference.py`"
        )
    return RECORD_WHEN[kind][0].upper() + RECORD_WHEN[kind][1:] + "."


# -- dashboard metrics ---------------------------------------------------------------------------------------------


def metric_source():
    """tests/helpers/metric_source.py: the metrics the code declares, read from its source (the tests use it too)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        return importlib.import_module("helpers.metric_source")
    finally:
        sys.path.remove(str(ROOT / "tests"))


def exported_metrics() -> dict[str, tuple[object, str]]:
    """Prometheus name -> (its Metric, the file that declares it). Ray's exporter adds `ray_`, and `_total` to a
    Counter; a Histogram is named by its base (its `_bucket`/`_count`/`_sum` series follow)."""
    source, exported = metric_source(), {}
    for path in code_files():
        where = str(path.relative_to(ROOT))
        for name, metric in source.declared_metric_details(parsed(path), where).items():
            exported[f"ray_{name}_total" if metric.kind == "Counter" else f"ray_{name}"] = (metric, where)
    return dict(sorted(exported.items()))


def metrics_page() -> str:
    lines = [
        "# Dashboard metrics",
        "",
        "The coordinator publishes every record it writes to `metrics.jsonl` with `ray.util.metrics` too. The "
        "metrics appear on each node's Prometheus endpoint (its port set by `ray start --head "
        "--metrics-export-port=8080`) with Ray's `ray_` prefix (and `_total` after a counter's name), every series "
        "tagged with `run`; the tags after the name are the others. A histogram's `_bucket`, `_count` and `_sum` "
        "series follow its name. What the figures mean, and the Grafana dashboard of them: "
        "[Monitoring](../monitoring.md).",
        "",
        "| metric | kind | what | declared in |",
        "|---|---|---|---|",
    ]
    for name, (metric, where) in exported_metrics().items():
        tags = [t for t in metric.tags if t != "run"]
        shown = f"{name}{{{','.join(tags)}}}" if tags else name
        what = metric.description
        if "part" in tags:
            what += "; `part`: " + ", ".join(f"`{p}`" for p in records.STEP_PARTS) + " ([Records](records.md#train))"
        lines.append(f"| `{shown}` | {metric.kind.lower()} | {cell(what)} | `{where}` |")
    return "\n".join(lines) + "\n"


# -- command line --------------------------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """`etrain`'s parser, from the command line's public entry point when it has one (argparse only: commands import
    what they use when they run)."""
    cli = importlib.import_module("etrain.cli")
    for name in ("parser", "build_parser", "make_parser", "_parser"):
        if callable(getattr(cli, name, None)):
            return getattr(cli, name)()
    raise SystemExit("etrain.cli has no function that returns its argparse parser (parser())")


def commands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    # argparse keeps its subcommands in a private list; nothing public walks them
    parser = parser or cli_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if a.option_strings and "--help" not in a.option_strings]


def shown(a: argparse.Action) -> str:
    """An argument's value as argparse's usage names it: its metavar, its choices, or its name."""
    return a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())


def synopsis(name: str, sub: argparse.ArgumentParser) -> str:
    words = [f"etrain {name}"]
    for a in (a for a in sub._actions if not a.option_strings):
        words.append({"+": f"{shown(a)}...", "?": f"[{shown(a)}]", "*": f"[{shown(a)}...]"}.get(a.nargs, shown(a)))
    return " ".join(words) + (" [options]" if options(sub) else "")


def option_row(a: argparse.Action) -> str:
    flags = ", ".join(f"`{o}`" for o in a.option_strings)
    if a.nargs != 0:
        flags += f" `{shown(a)}`"
    default = "required" if a.required else "" if a.default in (None, False, [], argparse.SUPPRESS) else a.default
    repeat = " (repeatable)" if isinstance(a, argparse._AppendAction) and "repeatable" not in (a.help or "") else ""
    return f"| {flags} | {cell(str(default))} | {cell((a.help or '') + repeat)} |"


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        "`etrain COMMAND --help` prints each command's options and examples. Exit codes: 0 done, 2 a usage error, "
        "1 a runtime failure, 130 Ctrl-C ([Errors](../training.md#errors)).",
    ]
    for name, sub in commands().items():
        what = (sub.description or "").rstrip(".")
        lines += ["", f"## etrain {name}", "", what[:1].upper() + what[1:] + ".", "", "```", synopsis(name, sub)]
        lines += ["```"]
        for a in sub._actions:
            if not a.option_strings and a.help:
                lines += ["", f"`{shown(a)}`: {a.help}."]
        for group in sub._mutually_exclusive_groups:
            flags = " or ".join(f"`{a.option_strings[0]}`" for a in group._group_actions)
            lines += ["", f"One of {flags}" + (", required." if group.required else ".")]
        if options(sub):
            lines += ["", "| option | default | what |", "|---|---|---|", *map(option_row, options(sub))]
        if sub.epilog:
            examples = [e.strip() for e in sub.epilog.splitlines()[1:] if e.strip()]
            lines += ["", "```bash", *examples, "```"]
    return "\n".join(lines) + "\n"


# -- the run directory ---------------------------------------------------------------------------------------------


def run_directory_page() -> str:
    lines = [
        "# Run directory",
        "",
        "Every run writes one directory (`run.root`/`run.name`, default `runs/<timestamp>`, made absolute; the driver "
        "prints it). `run.name` is one directory name inside `run.root`, in any language (no `/` or `\\`, not `.` or "
        "`..`, at most 255 bytes); on the dashboard its `run` tag is percent-encoded where it is not ASCII (Ray's "
        "metrics take ASCII tags only). A run directory or a local `checkpoint.uri` inside Ray's temporary directory "
        "is refused (exit 2): under `ray job submit --working-dir` a relative path lands in the unpacked package "
        "there and is deleted with the Ray session.",
        "",
        "| file | what |",
        "|---|---|",
        *(f"| `{path}` | {cell(what)} |" for path, _, what in RUN_FILES),
    ]
    return "\n".join(lines) + "\n"


# -- the pages -----------------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text for a table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def pages() -> dict[str, str]:
    """file name in docs/reference/ -> its text."""
    return {
        "cli.md": HEADER + cli_page(),
        "config.md": HEADER + config_page(),
        "records.md": HEADER + records_page(),
        "metrics.md": HEADER + metrics_page(),
        "run-directory.md": HEADER + run_directory_page(),
    }


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, text in pages().items():
        (OUT / name).write_text(text)
        print(f"wrote {(OUT / name).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
