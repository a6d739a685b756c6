"""The language check's cost in `etrain prepare`, side by side in one run, in interleaved rounds:

1. Per document, in this process: the language verdict (etrain/data/language.py) against the rest of a document's
   inspection (normalise, quality filters, MinHash: etrain/data/prepare.py `inspect`), on the same documents.
2. End to end: `etrain prepare` of the same corpus with `prepare.languages=[en]` and without, on Ray Data.

    python bench/language.py [--docs 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import ray
from rounds import summary

from etrain.core.config import load_config
from etrain.data.language import verdict
from etrain.data.prepare import inspect, prepare

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = {
    "en": "the river rose through night and by morning low fields beside old mill were under water so farmers moved "
    "their animals to ridge most of town had never seen flood like it school opened hall families whose houses",
    "de": "der fluss stieg in nacht und am morgen standen die niedrigen felder neben alten mühle unter wasser sodass "
    "bauern ihre tiere auf den hügel brachten meisten bewohner stadt hatten noch nie solches hochwasser erlebt",
    "fr": "la rivière a monté pendant nuit et au matin les champs bas près du vieux moulin étaient sous eau si bien "
    "que fermiers ont conduit leurs bêtes sur colline plupart des habitants avaient jamais vu une telle crue",
}


def corpus(n: int, seed: int = 0) -> list[str]:
    """Documents of 300 words in lines of 12: 70% English, 15% German, 15% French."""
    rng = random.Random(seed)
    langs = rng.choices(list(WORDS), weights=[70, 15, 15], k=n)
    docs = []
    for lang in langs:
        words = [rng.choice(WORDS[lang].split()) for _ in range(300)]
        docs.append("\n".join(" ".join(words[i : i + 12]) for i in range(0, 300, 12)))
    return docs


def per_document(docs: list[str], cfg) -> dict:
    started = time.perf_counter()
    for text in docs:
        verdict(text, ["en"], cfg.prepare.language_min_share)
    language_s = time.perf_counter() - started
    started = time.perf_counter()
    for i, text in enumerate(docs):
        inspect({"doc_id": i, "path": "p", "row": 0, "raw": text, "reason": None, "detail": None}, cfg)
    inspect_s = time.perf_counter() - started
    return {
        "language_docs_per_s": len(docs) / language_s,
        "inspect_docs_per_s": len(docs) / inspect_s,
        "language_over_inspect": language_s / inspect_s,
    }


def end_to_end(src: Path, work: Path, cfg, languages: list[str]) -> float:
    out = work / f"out-{time.monotonic_ns()}"
    cfg = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"languages": languages})})
    started = time.perf_counter()
    prepare([str(src)], str(out), cfg, progress=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(None, ["prepare.min_words=10", "data.eval_fraction=0.05", "prepare.engine=ray"])
    docs = corpus(args.docs)
    verdict(docs[0], ["en"], 0.8)  # the model loads once, outside the timing
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    rounds: dict[str, list[dict]] = {"per_document": [], "prepare": []}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
        end_to_end(src, Path(tmp), cfg, [])  # Ray Data's first start, outside the timing
        for r in range(args.rounds):
            rounds["per_document"].append(per_document(docs, cfg))
            first, second = ([], ["en"]) if r % 2 == 0 else (["en"], [])
            times = {tuple(first): end_to_end(src, Path(tmp), cfg, first)}
            times[tuple(second)] = end_to_end(src, Path(tmp), cfg, second)
            plain, filtered = times[()], times[("en",)]
            rounds["prepare"].append({"without_s": plain, "with_s": filtered, "with_over_without": filtered / plain})
            print(f"round {r + 1}: {rounds['per_document'][-1]} {rounds['prepare'][-1]}", flush=True)
    result = {
        "what": f"{args.docs} documents of 300 words (70% en, 15% de, 15% fr), prepare.languages=[en]; "
        f"median of {args.rounds} interleaved rounds with min and max",
        "per_document": summary(rounds["per_document"]),
        "prepare": summary(rounds["prepare"]),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "language.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
