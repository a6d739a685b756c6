"""How much eval loss gradient compression costs, and how the cost moves with the run's length.

Each compressed mode against uncompressed, the same seed and steps, in one Ray instance:
2 workers train the tiny GPT for 300 and for 1,000 steps (its own cosine schedule each),
in interleaved rounds. `topk_start100` is top-k with the first 100 steps sent whole
(`comm.compress_start=100`): it tells apart the cost of compressing the early,
fast-moving steps from the cost of compressing at all.

    python bench/comm_gap.py [--lengths 300 1000] [--rounds 3] [--only none topk ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import ray
from comm import SYNC, run_variant
from rounds import publish, summary

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "none": SYNC["none"],
    "topk": SYNC["topk"],
    "powersgd": SYNC["powersgd"],
    "topk_start100": [*SYNC["topk"], "comm.compress_start=100"],
}


def gaps(medians: dict, length: int) -> dict:
    """Each compressed variant's eval loss and bytes against uncompressed at one run length."""
    none = medians[f"none@{length}"]
    return {
        name: {
            "eval_loss_change": medians[f"{name}@{length}"]["eval_loss"]["median"] / none["eval_loss"]["median"] - 1,
            "bytes_vs_none": medians[f"{name}@{length}"]["bytes_per_worker_step"]["median"]
            / none["bytes_per_worker_step"]["median"],
        }
        for name in VARIANTS
        if name != "none" and f"{name}@{length}" in medians
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 1000], help="training steps of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run only these variants (and none)")
    parser.add_argument(
        "--data", default=str(Path.home() / ".cache/etrain/data"), help="where the embedded corpus is built"
    )
    parser.add_argument("--out", default=str(RESULTS / "comm_gap.json"), help="results file ('' to skip)")
    args = parser.parse_args(argv)
    names = [n for n in VARIANTS if n == "none" or not args.only or n in args.only]
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="etrain-bench-comm-gap-") as root:
        for i in range(args.rounds):
            for length in args.lengths:
                for name in names:
                    key = f"{name}@{length}"
                    started = time.perf_counter()
                    result = run_variant(f"{name}-{length}-{i}", VARIANTS[name], length, Path(root), args.data)
                    runs.setdefault(key, []).append(result)
                    print(
                        f"round {i + 1}/{args.rounds} {key:>20}: eval loss {result['eval_loss']:.4f}, "
                        f"{result['bytes_per_worker_step'] / 1e6:.3f} MB/worker/step "
                        f"({time.perf_counter() - started:.0f} s)",
                        flush=True,
                    )
    medians = {key: summary(rs) for key, rs in runs.items()}
    report = {
        "machine": "2 cores, tiny GPT (2 layers, 128 wide), 2 workers, gloo",
        "rounds": args.rounds,
        "variants": {key: {"config": VARIANTS[key.split("@")[0]], **m} for key, m in medians.items()},
        "gaps": {str(length): gaps(medians, length) for length in args.lengths},
    }
    return publish(report, "gaps", args.out)


if __name__ == "__main__":
    main()
