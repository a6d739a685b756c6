"""Near-duplicate detection: MinHash signatures, LSH band keys, and the clusters they form.

Written with numpy rather than datasketch because the index must not live in
one process: each document emits one key per band, Ray Data groups documents by
key (etrain.data.prepare), and only the candidate pairs, verified against the
threshold, come back to the driver, where a union-find keeps the smallest
document id of each cluster.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from etrain.data import scripts


def permutations(num_perm: int, seed: int = 1) -> np.ndarray:
    """One random 64-bit key per hash function."""
    return np.random.default_rng(seed).integers(0, 2**63, num_perm, dtype=np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (a*x+b mod p does not
    for small x, and then one shingle wins the minimum under every key)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shingles(text: str, n: int) -> np.ndarray:
    """The text's word n-grams, hashed: of characters where a script has no spaces (etrain/data/scripts.py)."""
    words = scripts.words(text)
    grams = {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}
    return np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))


def signature(text: str, n: int, keys: np.ndarray) -> np.ndarray:
    return _mix(shingles(text, n)[:, None] ^ keys[None, :]).min(axis=0)


def bands_for(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) whose LSH threshold (1/b)^(1/r) is the highest not above `threshold` (recall first)."""
    options = [(b, num_perm // b) for b in range(1, num_perm + 1)]
    below = [(b, r) for b, r in options if (1 / b) ** (1 / r) <= threshold]
    return max(below, key=lambda br: ((1 / br[0]) ** (1 / br[1]), br[1]))


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[str]:
    return [
        f"{i}:{hashlib.blake2b(sig[i * rows : (i + 1) * rows].tobytes(), digest_size=8).hexdigest()}"
        for i in range(bands)
    ]


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity of the shingle sets."""
    return float(np.mean(a == b))


def clusters(pairs: list[tuple[int, int]]) -> dict[int, int]:
    """Each document of a duplicate pair -> the smallest id of its cluster."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in pairs:
        rx, ry = root(x), root(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    return {x: root(x) for x in parent}
