"""The part of a Ray Data Dataset that `etrain prepare` uses, over a list of rows in this process.

A small corpus waits on Ray Data's per-stage start-up (each stage a separate execution, its shuffles in tasks) far
longer than its work takes: 260 documents spent 67 s of a notebook's cell from a cold start, 25 documents 1.3 s
against 0.23 s here on a warm Ray (bench/prepare_engine.py). Prepared here, the same stage functions give the same
shards byte for byte.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pandas as pd
from tqdm import tqdm


class Rows:
    def __init__(self, rows: list[dict], progress: bool = False):
        self.rows, self.progress = rows, progress

    @classmethod
    def from_items(cls, items: list[dict], progress: bool = False) -> Rows:
        return cls([dict(item) for item in items], progress)

    def flat_map(self, fn: Callable[[dict], list[dict]]) -> Rows:
        return self._with([out for row in self._each(fn) for out in fn(dict(row))])

    def map(self, fn: Callable[[dict], dict]) -> Rows:
        return self._with([fn(dict(row)) for row in self._each(fn)])

    def filter(self, fn: Callable[[dict], bool]) -> Rows:
        return self._with([row for row in self.rows if fn(row)])

    def select_columns(self, columns: list[str]) -> Rows:
        return self._with([{c: row[c] for c in columns} for row in self.rows])

    def sort(self, key: str) -> Rows:
        return self._with(sorted(self.rows, key=lambda row: row[key]))

    def groupby(self, key: str, num_partitions: int | None = None) -> Groups:
        return Groups(self.rows, key)

    def _with(self, rows: list[dict]) -> Rows:
        return Rows(rows, self.progress)

    def _each(self, fn: Callable) -> Iterator[dict]:
        """The rows, under a bar named after the function (Ray Data shows one per operator)."""
        name = getattr(fn, "func", fn).__name__
        return iter(tqdm(self.rows, desc=name, unit="row", leave=False, disable=not self.progress, file=sys.stderr))

    def materialize(self) -> Rows:
        return self

    def count(self) -> int:
        return len(self.rows)

    def take_all(self) -> list[dict]:
        return list(self.rows)

    def iter_rows(self) -> Iterator[dict]:
        return iter(self.rows)


class Groups:
    def __init__(self, rows: list[dict], key: str):
        self.groups: dict = {}
        for row in rows:
            self.groups.setdefault(row[key], []).append(row)
        self.key = key

    def map_groups(self, fn: Callable[[pd.DataFrame], dict], batch_format: str = "pandas") -> Rows:
        """`fn` gets a group as a DataFrame (the batch format prepare asks Ray Data for) and returns columns."""
        out = []
        for key in sorted(self.groups):
            columns = fn(pd.DataFrame(self.groups[key]))
            out += [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        return Rows(out)

    def count(self) -> Rows:
        return Rows([{self.key: key, "count()": len(rows)} for key, rows in sorted(self.groups.items())])
