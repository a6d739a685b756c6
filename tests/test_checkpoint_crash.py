"""A process killed at random points while saving never leaves a checkpoint that is taken as valid.

The victim (tests/helpers/save_forever.py) writes checkpoints whose every tensor holds its step, back
to back, until SIGKILL lands at a random moment: inside a part, between parts, in the commit
marker, in retention. After each kill the reader must return the newest whole checkpoint (or
none), never a mix; the next victim carries on over the debris.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from etrain.core import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def kill_while_saving(uri: str, kills: int, seed: int) -> tuple[int, int]:
    """Kill `kills` victims at random moments; check the store after each. (checkpoints seen, kills that left debris)"""
    rng = random.Random(seed)
    seen, debris = 0, 0
    for _ in range(kills):
        latest = checkpoint.load_latest(uri)
        start = latest.meta["step"] + 1 if latest else 1
        victim = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "helpers" / "save_forever.py"), uri, str(start)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        _, _, took = victim.stdout.readline().split()  # its first save, to learn the pace of this store
        time.sleep(rng.uniform(0, 2 * float(took)))  # mostly inside the next save or two, anywhere in one
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        ck = checkpoint.load_latest(uri)
        if ck is None:
            continue
        seen += 1
        step = ck.meta["step"]
        for name in ("model.pt", "optim.pt"):
            state = checkpoint.deserialize(ck.parts[name])
            tensors = state.values() if name == "model.pt" else [s["exp_avg"] for s in state["state"].values()]
            assert all(bool((t == step).all()) for t in tensors), f"{name} of step {step} holds another step's values"
        assert checkpoint.deserialize(ck.parts["extra.pt"]) == {"step": step} and ck.meta["cursor"] == step * 16
        fs, root = fsspec.core.url_to_fs(uri)
        fs.invalidate_cache()
        debris += any(p.rstrip("/") > f"{root}/step-{step:08d}" for p in fs.ls(root, detail=False) if "step-" in p)
    return seen, debris


def test_killed_saves_never_leave_a_valid_looking_checkpoint_on_disk(tmp_path):
    seen, debris = kill_while_saving(str(tmp_path / "ck"), kills=6, seed=0)
    assert seen == 6  # every victim committed one checkpoint before it was killed
    # Some kills landed inside a save and left an uncommitted step behind, which the reader passed over. (How
    # many depends on where the sleeps fall against this machine's pace of saves: 2 of 6 in one run, 3+ in others.)
    assert debris >= 1


@pytest.mark.timeout(180)
def test_killed_saves_never_leave_a_valid_looking_checkpoint_on_s3(s3_bucket):
    seen, _ = kill_while_saving(f"{s3_bucket}/ck", kills=3, seed=1)
    assert seen == 3  # (a part is one PUT on S3: a save cut short often leaves nothing to see)
