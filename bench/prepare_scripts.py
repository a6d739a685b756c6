"""prepare's quality filters on a mixed-script corpus, ours against the whitespace rules, side by side in one run:

1. Judgement: precision and recall of "kept" against the hand labels of tests/data/mixed_scripts.jsonl (English,
   Chinese, Japanese, Thai and code, good documents and junk), per script, for our filters (etrain/data/quality.py
   and scripts.py) and for the same rules counting whitespace-separated words and `str.isalpha` letters (Gopher's
   rules as usually written, and this project's before issue 43); then `etrain prepare` itself on the file (Ray
   Data), its report.json's kept per script.
2. Cost: documents judged per second (the filters and the script of each document, as prepare's `inspect` runs
   them), ours against the whitespace rules, and their share of a whole `inspect` (normalise, filters, script,
   MinHash), on the labelled documents repeated, in interleaved rounds.

    python bench/prepare_scripts.py [--repeat 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray
from rounds import publish, summary

from etrain.core.config import PrepareConfig, load_config
from etrain.data import quality, scripts
from etrain.data.prepare import inspect, prepare

ROOT = Path(__file__).resolve().parent.parent
LABELLED = ROOT / "tests" / "data" / "mixed_scripts.jsonl"
RESULTS = ROOT / "bench" / "results"


def whitespace_reason(text: str, cfg: PrepareConfig) -> str | None:
    """The peer: words are what str.split() gives, letters what str.isalpha() says."""
    words = text.split()
    if len(words) < cfg.min_words:
        return "too_short"
    visible = [c for c in text if not c.isspace()]
    if sum(not c.isalpha() for c in visible) / len(visible) > cfg.max_symbol_ratio:
        return "symbols_digits"
    if not cfg.min_mean_word_length <= sum(map(len, words)) / len(words) <= cfg.max_mean_word_length:
        return "word_length"
    if quality.repeated_line_ratio(text) > cfg.max_repeated_line_ratio:
        return "repeated_lines"
    if quality.repeated_ngram_ratio(words, cfg.ngram) > cfg.max_repeated_ngram_ratio:
        return "repeated_ngrams"
    return None


def ours(text: str, cfg: PrepareConfig) -> str | None:
    scripts.of_document(text)  # prepare names each document's script too
    return quality.reject_reason(text, cfg)


def judged(rows: list[dict], reason, cfg: PrepareConfig) -> dict:
    """Per script: precision and recall of the documents kept, against the labels good and junk."""
    out = {}
    for script in sorted({r["script"] for r in rows}):
        mine = [r for r in rows if r["script"] == script]
        kept = {i for i, r in enumerate(mine) if reason(r["text"], cfg) is None}
        good = {i for i, r in enumerate(mine) if r["label"] == "good"}
        out[script] = {
            "documents": len(mine),
            "good": len(good),
            "kept": len(kept),
            "precision": len(kept & good) / len(kept) if kept else None,
            "recall": len(kept & good) / len(good),
        }
    return out


def docs_per_s(texts: list[str], reason, cfg: PrepareConfig) -> float:
    started = time.perf_counter()
    for text in texts:
        reason(text, cfg)
    return len(texts) / (time.perf_counter() - started)


def _doc(text: str) -> dict:
    return {"doc_id": 0, "path": "p", "row": 0, "raw": text, "reason": None, "detail": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=40, help="copies of the labelled documents timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "prepare_scripts.json"))
    args = parser.parse_args()
    cfg = load_config("tiny")
    rows = [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines()]
    judgement = {"ours": judged(rows, ours, cfg.prepare), "whitespace": judged(rows, whitespace_reason, cfg.prepare)}

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        split = cfg.model_copy(update={"data": cfg.data.model_copy(update={"shard_bytes": 8000, "eval_fraction": 0.2})})
        report = prepare([str(LABELLED)], str(Path(tmp) / "out"), split, progress=False)
    ray.shutdown()
    good = Counter(r["script"] for r in rows if r["label"] == "good")
    end_to_end = {s: {"kept": v["kept"], "good": good[s]} for s, v in report["by_script"].items()}

    texts = [r["text"] for r in rows] * args.repeat
    rounds: list[dict] = []
    for r in range(args.rounds):  # interleaved, the order alternating
        order = [("ours", ours), ("whitespace", whitespace_reason)]
        speed = {name: docs_per_s(texts, fn, cfg.prepare) for name, fn in (order if r % 2 == 0 else order[::-1])}
        speed["inspect"] = docs_per_s(texts, lambda text, _: inspect(_doc(text), cfg), cfg.prepare)
        rounds.append(
            {f"{k}_docs_per_s": v for k, v in speed.items()}
            | {"ours_over_whitespace_time": speed["whitespace"] / speed["ours"]}
            | {"ours_share_of_inspect": speed["inspect"] / speed["ours"]}
        )
        print(f"round {r + 1}: {rounds[-1]}", flush=True)
    result = {
        "what": f"tests/data/mixed_scripts.jsonl ({len(rows)} documents, labelled by hand), the tiny preset's "
        f"prepare thresholds; cost on {len(texts)} documents, median of {args.rounds} interleaved rounds with min "
        "and max",
        "judgement": judgement,
        "prepare_kept_by_script": end_to_end,
        "cost": summary(rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    publish(result, "judgement", args.out)
    print(json.dumps({"prepare_kept_by_script": end_to_end, "cost": result["cost"]}, indent=1))


if __name__ == "__main__":
    main()
