"""`etrain prepare`: raw documents turned into training shards (Ray Data; etrain/data/prepare.py), and the
`etrain train` command that trains on them."""

from __future__ import annotations

import json
import shlex
import sys

from etrain.cli.options import add_config, command
from etrain.core.errors import UsageError


def add_command(sub) -> None:
    p = command(
        sub,
        "prepare",
        cmd_prepare,
        "turn raw documents into training shards (Ray Data; a small corpus in this process)",
        "etrain prepare docs/ dump.jsonl --out corpus/ --field body",
        "etrain prepare s3://raw/crawl/ --out s3://bucket/corpus --storage-option endpoint_url=http://127.0.0.1:9000",
    )
    p.add_argument("src", nargs="+", help="text files, directories, globs, .jsonl or .parquet; local or s3://")
    p.add_argument(
        "--out", required=True, help="output directory or URI (shards, manifest.json, report.json, quarantine.jsonl)"
    )
    add_config(p)
    p.add_argument("--field", help="JSONL key holding the text (prepare.jsonl_field; none: 'text')")
    p.add_argument("--column", help="Parquet column holding the text (prepare.parquet_column; none: 'text')")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option for s3:// (endpoint_url, key, secret ...); never logged",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_prepare(args, started_at: float) -> int:
    from etrain.core.config import load_config
    from etrain.data.prepare import open_output, prepare
    from etrain.driver.job import connect

    sugar = [f"prepare.jsonl_field={args.field}"] * bool(args.field)
    sugar += [f"prepare.parquet_column={args.column}"] * bool(args.column)
    cfg = load_config(args.config, [*sugar, *args.set])
    storage = dict(_parse_option(o) for o in args.storage_option)
    open_output(args.out, storage)  # a wrong option or an unreachable endpoint, named before Ray starts
    _check_tokenizer(cfg)
    report = prepare(
        args.src,
        args.out,
        cfg,
        overwrite=args.overwrite,
        storage=storage,
        progress=not args.no_progress,
        start_ray=lambda: connect(cfg),
    )
    print(json.dumps(report, indent=1))
    out = args.out.rstrip("/")
    print(
        f"manifest: {out}/manifest.json\nreport: {out}/report.json\nquarantine: {out}/quarantine.jsonl", file=sys.stderr
    )
    print(f"train on it: {_train_command(args.config or 'tiny', cfg, out, report)}", file=sys.stderr)
    return 0


def _check_tokenizer(cfg) -> None:
    """A tokenizer file that cannot be read, named before Ray starts."""
    if isinstance(cfg.prepare.tokenizer, str) and cfg.prepare.tokenizer != "bytes":
        from etrain.core.config import ConfigError
        from etrain.data.tokenizer import read_file

        try:
            read_file(cfg.prepare.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _train_command(config: str, cfg, out: str, report: dict) -> str:
    """`etrain train` on a prepared corpus, with the keys its data needs: the sequence length it was packed at, and
    a vocabulary as large as its tokenizer's when the config's is smaller."""
    vocab = report["vocab_size"]
    keys = [f"data.source={out}/manifest.json", f"model.seq_len={cfg.model.seq_len}"]
    keys += [f"model.vocab_size={vocab}"] * (vocab > cfg.model.vocab_size)
    return f"etrain train --config {shlex.quote(config)} " + " ".join(f"--set {shlex.quote(k)}" for k in keys)


def _parse_option(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(
            f"--storage-option {item.split('=')[0]!r} must look like key=value (e.g. endpoint_url=http://127.0.0.1:9000)"
        )
    return key, value
