"""`etrain prepare`: raw documents to training shards, as a Ray Data pipeline.

read → normalise → quality filters → language (prepare.languages) → exact dedup
(group by hash) → near dedup (MinHash; documents grouped by LSH band key) → byte tokens → packed rows, per
logical shard (source x length bucket) → ~`data.shard_bytes` physical shards.

A corpus below LOCAL_BYTES (or any, with prepare.engine=local) runs the same stages in this process instead
(etrain/data/local_rows.py), with the same output byte for byte: a small corpus waits on Ray Data's per-stage
start-up far longer than its work takes.

Every document read is accounted for: kept, or rejected with a reason in
`quarantine.jsonl`; `report.json` adds it up (read = kept + rejected). The
output is a pure function of the inputs and the config: documents are ordered
by id (input file order, then row) wherever order matters.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from tqdm import tqdm

from etrain.core.config import Config, ConfigError, PrepareConfig
from etrain.core.storage import STORAGE_ERRORS, StorageError, describe
from etrain.data import dedup, language, quality, scripts, tokenizer
from etrain.data.local_rows import Rows
from etrain.data.shards import SplitWriter, pack_rows, write_manifest

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# prepare.engine=auto: inputs up to this size are prepared in this process, about 30 s of work for one core
# (bench/prepare_engine.py: 7.1 MB in 28 s, where a warm 2-CPU Ray Data took 51 s); above it, Ray Data.
LOCAL_BYTES = 8 * 2**20


STAGES = (
    "reading, normalising, filtering",
    "exact duplicates",
    "near duplicates (MinHash)",
    "tokenising, packing, writing shards",
    "manifest and report",
)


def prepare(
    srcs: list[str],
    out: str,
    cfg: Config,
    overwrite: bool = False,
    storage: dict | None = None,
    progress: bool = True,
    start_ray: Callable[[], None] | None = None,
) -> dict:
    """Each stage is a Ray Data run with its own per-operator progress (or, for a small corpus, a pass in this
    process); the stage bar says which of them is running. `start_ray` is called only when Ray Data runs."""
    storage = storage or {}
    known = language.known() if cfg.prepare.languages else set()
    if unknown := sorted(set(cfg.prepare.languages) - known):
        raise ConfigError(f"prepare.languages: the language check does not know {unknown}; it knows {sorted(known)}")
    fs, root = open_output(out, storage)
    if fs.exists(root) and fs.ls(root):
        if not overwrite:
            raise ConfigError(
                f"output {out} exists and is not empty; pass --overwrite to replace it, or choose another --out"
            )
        if "://" in out:
            fs.rm(root, recursive=True)  # object storage is written in place: clear it first
    files, missing = expand(srcs, storage)
    local = engine(files, cfg) == "local"
    if not local:
        if start_ray is not None:
            start_ray()
        ray.data.DataContext.get_current().enable_progress_bars = progress
    with tqdm(
        total=len(STAGES), unit="stage", desc=f"prepare: {STAGES[0]}", disable=not progress, file=sys.stderr
    ) as stages:

        def next_stage(index: int, **counts) -> None:
            stages.set_description(f"prepare: {STAGES[index]}", refresh=False)
            stages.set_postfix(counts, refresh=False)
            stages.update()

        source = Rows.from_items(files, progress) if local else ray.data.from_items(files)
        docs = source.flat_map(partial(read_documents, cfg=cfg.prepare, storage=storage))
        docs = docs.map(partial(inspect, cfg=cfg))
        if cfg.prepare.languages:
            allowed, share = cfg.prepare.languages, cfg.prepare.language_min_share
            docs = docs.map(partial(language.check, allowed=allowed, min_share=share))
        docs = docs.materialize()
        parts = _partitions(docs.count())
        if not local:
            docs.context.shuffle_strategy = _shuffle(docs.count())  # what the stages below derive from `docs` run with
        kept = docs.filter(lambda r: r["reason"] is None)
        next_stage(1, documents=docs.count())
        exact = _exact_duplicates(kept, parts)
        unique = kept.filter(lambda r: r["doc_id"] not in exact)
        next_stage(2, exact_duplicates=len(exact))
        near = _near_duplicates(unique, cfg.prepare, parts)
        final = unique.filter(lambda r: r["doc_id"] not in near)
        duplicates = {d: ("duplicate_exact", of) for d, of in exact.items()} | {
            d: ("duplicate_near", of) for d, of in near.items()
        }
        rejected = _quarantine(docs, duplicates) + [
            {"doc_id": -1, "path": p, "row": 0, "reason": "unreadable", "detail": why, "script": "none"}
            for p, why in missing
        ]
        read = Counter({r["script"]: r["count()"] for r in docs.groupby("script").count().take_all()})
        if missing:
            read["none"] += len(missing)
        next_stage(3, rejected=len(rejected))
        tok = _tokenizer(cfg.prepare.tokenizer, final)
        staging = _staging(out, fs, root)
        spec = (tok.text, tok.eos_name) if tok else None

        def pack_all(held: frozenset[int]) -> list[dict]:
            return (
                final.map(partial(assign, cfg=cfg, held=held))
                .groupby("group", num_partitions=parts)
                .map_groups(
                    partial(pack, out=staging, cfg=cfg, storage=storage, file_tokenizer=spec), batch_format="pandas"
                )
                .take_all()
            )

        packed = pack_all(frozenset())
        if not _samples(packed, "eval") and _samples(packed, "train"):  # a small corpus: hold out more, pack again
            sfs, sroot = fsspec.core.url_to_fs(staging, **storage)
            sfs.rm(sroot, recursive=True)
            packed = pack_all(held_out(final, cfg, packed))
        next_stage(4, shards=sum(len(json.loads(r["entries"])) for r in packed))
        try:
            report = _finish(
                out,
                staging,
                fs,
                root,
                cfg,
                packed,
                rejected,
                read=read,
                storage=storage,
                tok=tok,
            )
        except ConfigError:  # nothing for the user: nothing of this run left behind either (no manifest was written)
            sfs, sroot = fsspec.core.url_to_fs(staging, **storage)
            if sfs.exists(sroot):
                sfs.rm(sroot, recursive=True)
            raise
        stages.update()
    return report


def engine(files: list[dict], cfg: Config) -> str:
    """Which engine prepares `files`: prepare.engine, or with auto, "local" up to LOCAL_BYTES of input, else "ray"."""
    if cfg.prepare.engine != "auto":
        return cfg.prepare.engine
    return "local" if sum(f["bytes"] for f in files) <= LOCAL_BYTES else "ray"


def _tokenizer(spec, kept) -> tokenizer.TokenizerFile | None:
    """prepare.tokenizer: None for bytes; a tokenizer file read; or a BPE learned from the kept documents' text
    (up to its sample_bytes, in document order)."""
    if spec == tokenizer.BYTES:
        return None
    if isinstance(spec, str):
        try:
            return tokenizer.read_file(spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def sample():
        taken = 0
        for row in kept.sort("doc_id").iter_rows():
            if taken >= spec.sample_bytes:
                return
            taken += len(row["text"])
            yield row["text"]

    return tokenizer.train_bpe(sample(), spec.vocab_size)


def open_output(out: str, storage: dict):
    """The output's filesystem, checked before any work: options it takes, storage that answers."""
    try:
        fs, root = fsspec.core.url_to_fs(out, **storage)
        fs.exists(root)  # an object store's client is made here, with the options
    except TypeError as e:
        raise ConfigError(
            f"--storage-option for {out}: {e}; pass options of its fsspec filesystem (for s3://: endpoint_url, key, "
            "secret, client_kwargs, ...)"
        ) from None
    except STORAGE_ERRORS as e:
        raise StorageError(
            f"cannot reach the output {out}: {describe(e)}; check the endpoint (--storage-option endpoint_url=..., or "
            "AWS_ENDPOINT_URL) and the credentials"
        ) from None
    return fs, root


# -- reading -------------------------------------------------------------------


def expand(srcs: list[str], storage: dict) -> tuple[list[dict], list[tuple[str, str]]]:
    """Input files in a stable order with their sizes (one listing, no request per file), and the arguments that
    name nothing readable."""
    files, missing = [], []
    for src in srcs:
        fs, path = fsspec.core.url_to_fs(src, **storage)
        protocol = src.split("://")[0] + "://" if "://" in src else ""
        if any(c in path for c in "*?["):
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        elif fs.exists(path):
            found = {path: fs.info(path)}
        else:
            missing.append((src, "no such file, directory or glob match"))
            continue
        source = Path(path.rstrip("/")).name.split(".")[0] or "input"
        for p, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            files.append(
                {
                    "path": protocol + p,
                    "format": FORMATS.get(Path(p).suffix, "text"),
                    "source": source,
                    "bytes": int(info.get("size") or 0),
                }
            )
    return [{**f, "file_id": i} for i, f in enumerate(files)], missing


def read_documents(file: dict, cfg: PrepareConfig, storage: dict) -> list[dict]:
    base = {"path": file["path"], "source": file["source"]}
    try:
        with fsspec.open(file["path"], "rb", **storage) as f:
            data = f.read()
        texts = list(_texts(data, file["format"], cfg))
    except Exception as e:  # one unreadable input is reported, never fatal
        return [
            {
                **base,
                "doc_id": file["file_id"] << 32,
                "row": 0,
                "raw": None,
                "reason": "unreadable",
                "detail": f"{type(e).__name__}: {e}",
            }
        ]
    return [
        {**base, "doc_id": (file["file_id"] << 32) + row, "row": row, "raw": text, "reason": why, "detail": None}
        for row, (text, why) in enumerate(texts)
    ]


def _texts(data: bytes, fmt: str, cfg: PrepareConfig):
    if fmt == "text":
        yield quality.decode(data)
    elif fmt == "jsonl":
        for line in data.decode("utf-8").splitlines():
            if line.strip():
                yield _json_text(line, cfg.jsonl_field)
    else:
        for value in pq.read_table(pa.BufferReader(data), columns=[cfg.parquet_column]).column(0).to_pylist():
            yield (value, None) if isinstance(value, str) else (None, f"no_text_in_{cfg.parquet_column}")


def _json_text(line: str, field: str) -> tuple[str | None, str | None]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None, "invalid_json"
    value = value.get(field) if isinstance(value, dict) else None
    return (value, None) if isinstance(value, str) else (None, f"no_text_in_{field}")


def inspect(doc: dict, cfg: Config) -> dict:
    """Normalise, filter, fingerprint (sha256 for exact, MinHash for near duplicates)."""
    text = quality.normalise(doc.pop("raw")) if doc["raw"] is not None else ""
    reason = doc["reason"] or quality.reject_reason(text, cfg.prepare)
    keep = reason is None
    perms = dedup.permutations(cfg.prepare.minhash_perms)
    sig = (
        dedup.signature(text, cfg.prepare.ngram, perms)
        if keep
        else np.zeros(cfg.prepare.minhash_perms, dtype=np.uint64)
    )
    return {
        **doc,
        "text": text if keep else "",
        "reason": reason,
        "sha": hashlib.sha256(text.encode()).hexdigest(),
        "sig": sig,
        "chars": len(text),
        "script": scripts.of_document(text),
    }


# -- deduplication ---------------------------------------------------------------


def _partitions(documents: int) -> int:
    """Shuffle partitions: Ray's default of 200 costs tens of seconds of empty tasks on a small corpus."""
    return max(2, min(200, documents // 20_000))


def _shuffle(documents: int) -> ray.data.context.ShuffleStrategy:
    """The groupbys' shuffle. Ray 2.60's default (SHUFFLE_V2) fails on the empty blocks a filter leaves ("No match for
    FieldRef"). The hash shuffle starts aggregator actors, new processes, for each groupby: a prepare of 30 small
    documents took 13-23 s with it and 5 s with the sort-based shuffle, which runs in tasks (same shards, byte for
    byte). Above 100,000 documents, the hash shuffle, built to scale (not measured here at that size)."""
    strategies = ray.data.context.ShuffleStrategy
    return strategies.SORT_SHUFFLE_PULL_BASED if documents < 100_000 else strategies.HASH_SHUFFLE


def _exact_duplicates(kept, parts: int) -> dict[int, int]:
    def later_copies(group):
        ids = sorted(group["doc_id"].tolist())
        return {"doc_id": ids[1:], "of": [ids[0]] * (len(ids) - 1)}

    rows = (
        kept.select_columns(["sha", "doc_id"])
        .groupby("sha", num_partitions=parts)
        .map_groups(later_copies, batch_format="pandas")
        .take_all()
    )
    return {int(r["doc_id"]): int(r["of"]) for r in rows}


def _near_duplicates(unique, cfg: PrepareConfig, parts: int) -> dict[int, int]:
    bands, rows = dedup.bands_for(cfg.near_dup_threshold, cfg.minhash_perms)

    def keys(doc):
        return [
            {"band": k, "doc_id": doc["doc_id"], "sig": doc["sig"]} for k in dedup.band_keys(doc["sig"], bands, rows)
        ]

    def pairs(group):
        ids, sigs = group["doc_id"].tolist(), group["sig"].tolist()
        found = [
            (ids[i], ids[j])
            for i in range(len(ids))
            for j in range(i + 1, len(ids))
            if dedup.similarity(sigs[i], sigs[j]) >= cfg.near_dup_threshold
        ]
        return {"a": [a for a, _ in found], "b": [b for _, b in found]}

    candidates = (
        unique.select_columns(["doc_id", "sig"])
        .flat_map(keys)
        .groupby("band", num_partitions=parts)
        .map_groups(pairs, batch_format="pandas")
        .take_all()
    )
    roots = dedup.clusters([(int(r["a"]), int(r["b"])) for r in candidates])
    return {d: root for d, root in roots.items() if d != root}


# -- packing and writing --------------------------------------------------------


def assign(doc: dict, cfg: Config, held: frozenset[int] = frozenset()) -> dict:
    """Split (by content hash: stable under any re-run) and logical shard (source x length bucket). With `held` (a
    small corpus whose hash split left the eval split no sample), those documents are eval too, and every eval
    document packs into one logical shard, so that none of their tokens is left over at a shard's end."""
    split = "eval" if _position(doc["sha"]) < cfg.data.eval_fraction or doc["doc_id"] in held else "train"
    short, long_ = cfg.prepare.length_buckets
    bucket = "short" if doc["chars"] < short else "medium" if doc["chars"] < long_ else "long"
    logical = "held-out" if held and split == "eval" else f"{doc['source']}.{bucket}"
    return {
        "doc_id": doc["doc_id"],
        "text": doc["text"],
        "name": f"{doc['path']}#{doc['row']}",
        "group": f"{split}/{logical}",
    }


def _position(sha: str) -> float:
    """A document's place in [0, 1) by its content hash: below data.eval_fraction, it is held out."""
    return int(sha[:8], 16) / 2**32


def _samples(packed: list[dict], split: str) -> int:
    return sum(e["samples"] for r in packed if r["split"] == split for e in json.loads(r["entries"]))


def held_out(final, cfg: Config, packed: list[dict]) -> frozenset[int]:
    """The documents to hold out when the hash split gave the eval split no sample: the next ones by content hash
    (a stable choice) until they hold about twice a sample's tokens, at the corpus' measured bytes per token, but
    never more than half the corpus. Nothing held out beyond the hash split if that cannot give a sample."""
    tokens = sum(r["tokens"] + r["dropped_tokens"] for r in packed)
    sizes = final.map(lambda r: {"at": _position(r["sha"]), "doc_id": r["doc_id"], "bytes": len(r["text"].encode())})
    docs = sorted((r["at"], r["doc_id"], r["bytes"]) for r in sizes.take_all())
    per_token = sum(size for *_, size in docs) / max(tokens, 1)
    need, held, size = 2 * (cfg.model.seq_len + 1) * per_token, set(), 0
    for _, doc_id, nbytes in docs[: len(docs) // 2]:
        if size >= need:
            break
        held.add(doc_id)
        size += nbytes
    return frozenset(held) if size >= need / 2 else frozenset()


def pack(group, out: str, cfg: Config, storage: dict, file_tokenizer: tuple[str, str] | None = None):
    """One logical shard: documents in id order, each ended by its end-of-document token (EOT with bytes; with
    `file_tokenizer`, a tokenizer file's text and its EOS token, that EOS), cut into seq_len + 1 rows."""
    group = group.sort_values("doc_id")
    split, logical = group["group"].iloc[0].split("/")
    if file_tokenizer is None:
        docs, dtype = [np.append(tokenizer.encode(t), np.uint8(tokenizer.EOT)) for t in group["text"]], "uint8"
    else:
        tok = _parsed(*file_tokenizer)
        docs, dtype = tok.encode_documents(list(group["text"])), tok.dtype
    row_len = cfg.model.seq_len + 1
    rows, sources = pack_rows(docs, list(group["name"]), row_len)
    writer = SplitWriter(out, f"{split}-{logical}", row_len, dtype, cfg.data.shard_bytes, storage)
    writer.add(rows, sources)
    writer.flush()
    entries = [{**s, "logical": logical} for s in writer.shards]
    total = sum(len(d) for d in docs)
    return {
        "split": [split],
        "entries": [json.dumps(entries)],
        "tokens": [rows.size],
        "dropped_tokens": [total - rows.size],
    }


@functools.cache
def _parsed(text: str, eos_name: str) -> tokenizer.TokenizerFile:
    """Parsed once per process (a Ray Data worker packs many groups), its EOS the one the driver read."""
    return tokenizer.TokenizerFile(text, eos_name)


def _staging(out: str, fs, root: str) -> str:
    """Local output is built beside its target and renamed in; object storage is written in place, manifest last."""
    if "://" in out:
        return out
    return str(Path(root).with_name(f".{Path(root).name}.tmp-{uuid.uuid4().hex[:8]}"))


def _finish(
    out,
    staging,
    fs,
    root,
    cfg: Config,
    packed: list[dict],
    rejected: list[dict],
    read: Counter,
    storage: dict,
    tok=None,
) -> dict:
    """The manifest, report.json (what was read, kept and rejected, in all and by script) and quarantine.jsonl."""
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for row in packed:
        splits[row["split"]] += json.loads(row["entries"])
    for entries in splits.values():
        entries.sort(key=lambda e: e["path"])
    rejected.sort(key=lambda r: (r["doc_id"], r["path"]))
    reasons = Counter(r["reason"] for r in rejected)
    by_script = {}
    for name, count in sorted(read.items()):
        why = Counter(r["reason"] for r in rejected if r["script"] == name)
        by_script[name] = {"read": count, "kept": count - why.total(), "rejected_by_reason": dict(sorted(why.items()))}
    report = {
        "documents_read": read.total(),
        "documents_kept": read.total() - len(rejected),
        "documents_rejected": len(rejected),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "duplicates_removed": reasons["duplicate_exact"] + reasons["duplicate_near"],
        "by_script": by_script,
        "tokens": sum(r["tokens"] for r in packed),
        "tokens_dropped_at_packing": sum(r["dropped_tokens"] for r in packed),
        "shards": sum(len(v) for v in splits.values()),
        "samples": {s: sum(e["samples"] for e in v) for s, v in splits.items()},
        "seq_len": cfg.model.seq_len,  # what a run on it sets (the command `etrain prepare` prints)
        "vocab_size": tok.vocab_size if tok else tokenizer.VOCAB_SIZE,
    }
    if not splits["train"]:
        raise ConfigError(
            f"no training data left: {report['documents_rejected']} of {read.total()} documents rejected "
            f"({dict(reasons)}); see the thresholds under prepare.*"
        )
    if not report["samples"]["eval"]:
        raise ConfigError(
            f"no evaluation sample: the {report['documents_kept']} documents kept are too few to hold out a sample of "
            f"model.seq_len + 1 = {cfg.model.seq_len + 1} tokens and leave the rest to train on; add documents, or "
            "lower model.seq_len"
        )
    sfs, sroot = fsspec.core.url_to_fs(staging, **storage)
    sfs.makedirs(sroot, exist_ok=True)
    sfs.pipe_file(posixpath.join(sroot, "quarantine.jsonl"), "".join(json.dumps(r) + "\n" for r in rejected).encode())
    sfs.pipe_file(posixpath.join(sroot, "report.json"), json.dumps(report, indent=1).encode())
    if tok is not None:  # kept with the shards: what a run's samples decode with (a model's template with it)
        kept = tokenizer.with_companions(cfg.prepare.tokenizer) if isinstance(cfg.prepare.tokenizer, str) else {}
        for name, body in (kept | {tokenizer.FILE: tok.text.encode()}).items():
            sfs.pipe_file(posixpath.join(sroot, name), body)
    write_manifest(
        staging,
        seq_len=cfg.model.seq_len,
        dtype=tok.dtype if tok else "uint8",
        vocab_size=tok.vocab_size if tok else tokenizer.VOCAB_SIZE,
        tokenizer=tok.manifest() if tok else tokenizer.BYTES,
        splits=splits,
        source={"kind": "prepare", "prepare": cfg.prepare.model_dump(exclude={"engine"}), "report": "report.json"},
        storage=storage,
    )
    if staging != out:
        if fs.exists(root):
            shutil.rmtree(root)  # only reached with --overwrite
        Path(staging).rename(root)
    return report


def _quarantine(docs, duplicates: dict[int, tuple[str, int]]) -> list[dict]:
    """Every rejected document with its source and reason (duplicates name the copy they repeat)."""
    originals = {of for _, of in duplicates.values()}
    wanted = docs.filter(lambda r: r["reason"] is not None or r["doc_id"] in duplicates or r["doc_id"] in originals)
    columns = ["doc_id", "path", "row", "reason", "detail", "script"]
    rows = {r["doc_id"]: r for r in wanted.select_columns(columns).take_all()}
    out = []
    for doc_id, r in rows.items():
        if r["reason"] is None and doc_id not in duplicates:
            continue  # an original that was kept
        reason, detail = r["reason"], r["detail"]
        if reason is None:
            reason, of = duplicates[doc_id]
            detail = f"duplicate of {rows[of]['path']} row {rows[of]['row']}"
        where = {"doc_id": int(doc_id), "path": r["path"], "row": int(r["row"])}
        out.append(where | {"reason": reason, "detail": detail, "script": r["script"]})
    return out
