"""Saves checkpoints in a loop until killed: the victim of tests/test_checkpoint_crash.py.

Every tensor of the checkpoint at step S holds the value S, so a reader can tell a
checkpoint that is whole from one mixing steps or cut short.
"""

import sys
import time

import torch

from etrain.core import checkpoint


def main(uri: str, step: int) -> None:
    while True:
        started = time.perf_counter()
        parts = {
            "model.pt": {f"w{i}": torch.full((256, 1024), float(step)) for i in range(4)},
            "optim.pt": {"state": {i: {"exp_avg": torch.full((256, 1024), float(step))} for i in range(4)}},
            "extra.pt": {"step": step},
        }
        checkpoint.save(uri, step, parts, {"cursor": step * 16}, keep=2)
        print(f"saved {step} {time.perf_counter() - started:.4f}", flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
