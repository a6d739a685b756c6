"""Global sample order: a pure function of (seed, epoch), never of the world size.

Resume state is one integer, the global cursor (samples consumed since step 0).
A step takes the next `global_batch` ids from the cursor and splits them among
the workers; any split of the same ids gives the same update (see the worker's
loss weighting), so the world size can change between steps.

The order is shard-aware so a 3-shard node cache never thrashes: each epoch
visits the shards in a seeded order, `block` shards at a time, and shuffles the
samples within each block (MosaicML Streaming's shuffle blocks). Consecutive
positions therefore touch at most `block` shards, and the shard sequence ahead
is known, which is what the cache's eviction and prefetch use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """What the order depends on: the seed, the shards' sample counts and the shuffle block."""

    seed: int
    sizes: tuple[int, ...]
    block: int = 2

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum((0, *self.sizes))

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, ids, side="right") - 1


def blocks(layout: Layout, epoch: int) -> list[np.ndarray]:
    """The shard groups of one epoch, in visiting order."""
    shards = np.random.default_rng([layout.seed, epoch, 0]).permutation(len(layout.sizes))
    return [shards[i : i + layout.block] for i in range(0, len(shards), layout.block)]


@functools.lru_cache(maxsize=2)
def epoch_order(layout: Layout, epoch: int) -> np.ndarray:
    parts = []
    for index, group in enumerate(blocks(layout, epoch)):
        ids = np.concatenate([np.arange(layout.starts[s], layout.starts[s + 1]) for s in group])
        parts.append(np.random.default_rng([layout.seed, epoch, 1, index]).permutation(ids))
    order = np.concatenate(parts)
    order.flags.writeable = False  # cached: callers share it
    return order


def take(layout: Layout, cursor: int, count: int) -> np.ndarray:
    """The `count` sample ids after global position `cursor`, crossing epochs as needed."""
    out = []
    while count > 0:
        epoch, pos = divmod(cursor, layout.num_samples)
        chunk = epoch_order(layout, epoch)[pos : pos + count]
        out.append(chunk)
        cursor += len(chunk)
        count -= len(chunk)
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def shards_ahead(layout: Layout, cursor: int, horizon: int) -> list[int]:
    """Shards in the order they are next needed from `cursor` on, over `horizon` blocks (the current one first)."""
    epoch, pos = divmod(cursor, layout.num_samples)
    ahead: list[int] = []
    while horizon > 0:
        groups = blocks(layout, epoch)
        ends = np.cumsum([sum(layout.sizes[s] for s in g) for g in groups])
        for group in groups[int(np.searchsorted(ends, pos, side="right")) :]:
            ahead += [int(s) for s in group if s not in ahead]
            horizon -= 1
            if horizon == 0:
                break
        epoch, pos = epoch + 1, 0
    return ahead


def plan_step(layout: Layout, cursor: int, global_batch: int, weights: list[float]) -> list[np.ndarray]:
    """Each worker's sample ids for the step starting at `cursor`: the whole of what a step reads."""
    return split(take(layout, cursor, global_batch), weights)


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
