"""A step's overhead, side by side: the demo's run (the tiny GPT, 2 workers, 500 steps) with each step sent ahead of
its predecessor's reports (train.send_ahead, the default) and with each sent after them.

Each run is `etrain train --config tiny` in a fresh process with its own local Ray. From its train records of the
steady state (steps 50 to 500), the median of each part of the step split (records: `{part}_s`), the control
path's share of the step (dispatch + other over the step's wall time), and the wall time per step from one commit
to the next over those steps (what a user waits; it counts the coordinator's time between steps, which a step sent
after its predecessor's reports does not have in its own split); and the start's phases (the start record), from the
CLI's start to the first step.

    python bench/overhead.py [--rounds 3] [--steps 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rounds import interleaved, publish, summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from etrain.core.records import STEP_PARTS, read_jsonl  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "overhead.json"
VARIANTS = {"ahead": "train.send_ahead=true", "after": "train.send_ahead=false"}
FIRST = 50  # steps left out: start-up, the first buckets, the warm pool's start


def measure(variant: str, args) -> dict:
    import subprocess

    root = tempfile.mkdtemp(prefix="overhead-")
    cmd = [str(Path(sys.executable).parent / "etrain"), "train", "--config", "tiny", "--no-progress"]
    sets = [f"run.root={root}", f"train.steps={args.steps}", VARIANTS[variant]]
    done = subprocess.run(
        [*cmd, *(a for s in sets for a in ("--set", s))], capture_output=True, text=True, cwd=ROOT, timeout=1800
    )
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    [run_dir] = Path(root).iterdir()
    return figures(read_jsonl(run_dir / "metrics.jsonl"))


def figures(records: list[dict]) -> dict:
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= FIRST and r.get("compute_s") is not None]
    out = {f"{part}_ms": 1000 * statistics.median(r[f"{part}_s"] for r in steps) for part in STEP_PARTS}
    out["step_ms"] = 1000 * statistics.median(r["step_time_s"] for r in steps)
    out["control_share"] = (out["dispatch_ms"] + out["other_ms"]) / out["step_ms"]
    out["wall_per_step_ms"] = 1000 * (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)
    out["sent_ahead"] = sum(bool(r.get("sent_ahead")) for r in steps) / len(steps)
    [start] = [r for r in records if r["kind"] == "start"]
    out |= {f"start_{phase}_s": s for phase, s in start["phases"].items()} | {"start_total_s": start["total_s"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default=str(RESULTS), help="'' writes nothing")
    args = p.parse_args()
    runs = interleaved(
        args.rounds,
        list(VARIANTS),
        lambda v: measure(v, args),
        lambda v, r: (
            f"{v:6s} step {r['step_ms']:6.1f} ms, wall {r['wall_per_step_ms']:6.1f} ms/step, control "
            f"{100 * r['control_share']:.1f}%"
        ),
    )
    medians = {v: summary(rs) for v, rs in runs.items()}
    ahead, after = (medians[v] for v in ("ahead", "after"))
    ratios = {
        "wall_per_step_ahead_vs_after": ahead["wall_per_step_ms"]["median"] / after["wall_per_step_ms"]["median"],
        "control_share_ahead": ahead["control_share"]["median"],
        "control_share_after": after["control_share"]["median"],
    }
    report = {"args": vars(args), "ratios": ratios, "medians": medians, "runs": runs, "when": time.strftime("%F %R")}
    publish(report, "ratios", args.out)


if __name__ == "__main__":
    main()
