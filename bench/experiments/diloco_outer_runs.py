"""The DiLoCo outer-step sweep of bench/experiments/diloco_outer.md: each named variant once, no link, 256 steps.

python bench/experiments/diloco_outer_runs.py [NAME ...]
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lowband  # noqa: E402
import ray  # noqa: E402

ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
trials = {
    "dense": [],
    "paper_h8": ["comm.mode=diloco", "comm.diloco.inner_steps=8"],
    "paper_h32": ["comm.mode=diloco", "comm.diloco.inner_steps=32"],
    "h1_lr1_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=1",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0",
    ],
    "h8_lr1_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=8",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0",
    ],
    "h8_lr07_m05": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=8",
        "comm.diloco.outer_lr=0.7",
        "comm.diloco.outer_momentum=0.5",
    ],
    "h32_lr1_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=32",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0",
    ],
    "h32_lr07_m05": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=32",
        "comm.diloco.outer_lr=0.7",
        "comm.diloco.outer_momentum=0.5",
    ],
    "h8_lr13_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=8",
        "comm.diloco.outer_lr=1.3",
        "comm.diloco.outer_momentum=0",
    ],
    "h8_lr1_m03": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=8",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0.3",
    ],
    "h16_lr1_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=16",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0",
    ],
    "h4_lr1_m0": [
        "comm.mode=diloco",
        "comm.diloco.inner_steps=4",
        "comm.diloco.outer_lr=1.0",
        "comm.diloco.outer_momentum=0",
    ],
}
trials = {k: v for k, v in trials.items() if not sys.argv[1:] or k in sys.argv[1:]}
with tempfile.TemporaryDirectory() as root:
    for name, ov in trials.items():
        lowband.MODES[name] = ov
        r = lowband.run_variant(name, "none", 256, Path(root), str(Path.home() / ".cache/etrain/data"))
        print(name, [round(loss, 3) for _, _, loss in r["evals"]], flush=True)
