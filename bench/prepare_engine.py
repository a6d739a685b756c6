"""`etrain prepare` in this process (prepare.engine=local) against Ray Data (prepare.engine=ray), side by side on the
same corpora in interleaved rounds, with a check that both wrote the same files. It prices Ray Data's per-stage
start-up on a small corpus and shows where the auto threshold (etrain/data/prepare.py LOCAL_BYTES) sits.

    python bench/prepare_engine.py [--sizes 25,1000,4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import ray
from language import corpus
from rounds import summary

from etrain.core.config import load_config
from etrain.data.prepare import prepare

RESULTS = Path(__file__).resolve().parent / "results"


def timed(src: Path, out: Path, engine: str) -> float:
    cfg = load_config(None, [f"prepare.engine={engine}", "data.eval_fraction=0.05"])
    started = time.perf_counter()
    prepare([str(src)], str(out), cfg, progress=False)
    return time.perf_counter() - started


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25,1000,4000", help="documents of 300 words per corpus")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in (int(s) for s in args.sizes.split(",")):
            src = work / f"src-{n}"
            src.mkdir()
            docs = corpus(n, seed=n)
            random.Random(n).shuffle(docs)
            (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
            if not results:
                timed(src, work / "warm", "ray")  # Ray Data's first start, outside the timing
            runs = []
            for r in range(args.rounds):
                order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
                seconds = {engine: timed(src, work / f"{n}-{r}-{engine}", engine) for engine in order}
                same = files(work / f"{n}-{r}-local") == files(work / f"{n}-{r}-ray")
                assert same, f"{n} documents: the engines wrote different files"
                runs.append(
                    {
                        "local_s": seconds["local"],
                        "ray_s": seconds["ray"],
                        "ray_over_local": seconds["ray"] / seconds["local"],
                    }
                )
                print(f"{n} documents, round {r + 1}: {runs[-1]}", flush=True)
            size = (src / "docs.jsonl").stat().st_size
            results[f"{n}_docs"] = {"input_bytes": size, **summary(runs)}
    result = {
        "what": f"etrain prepare of JSONL corpora (300-word documents) by prepare.engine, a 2-CPU local Ray; median of "
        f"{args.rounds} interleaved rounds with min and max; the two engines' files compared byte for byte each round",
        **results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prepare_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
