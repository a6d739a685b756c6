"""Global sample order: a pure function of (seed, epoch), never of the world size.

Resume state is one integer, the global cursor (samples consumed since step 0).
A step takes the next `global_batch` ids from the cursor and splits them among
the workers; any split of the same ids gives the same update (see the worker's
loss weighting), so the world size can change between steps.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    perm.flags.writeable = False  # cached: callers share it
    return perm


def take(seed: int, num_samples: int, cursor: int, count: int) -> np.ndarray:
    """The `count` sample ids after global position `cursor`, crossing epochs as needed."""
    out = []
    while count > 0:
        epoch, pos = divmod(cursor, num_samples)
        chunk = epoch_permutation(seed, epoch, num_samples)[pos : pos + count]
        out.append(chunk)
        cursor += len(chunk)
        count -= len(chunk)
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def split_counts(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of `total` proportional to `weights`, each share >= 1."""
    if total < len(weights):
        raise ValueError(f"cannot give {len(weights)} workers at least one of {total} samples")
    spare = total - len(weights)
    scale = sum(weights)
    exact = [spare * w / scale for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: spare - sum(counts)]:
        counts[i] += 1
    return [c + 1 for c in counts]


def split(ids: np.ndarray, weights: list[float]) -> list[np.ndarray]:
    bounds = np.cumsum([0, *split_counts(len(ids), weights)])
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
