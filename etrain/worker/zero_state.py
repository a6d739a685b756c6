"""ZeRO-1 optimizer state saved by parts: each rank writes its own shard, a loader merges them.

`ZeroRedundancyOptimizer.consolidate_state_dict` funnels every shard through rank 0 (its memory
and its link). Instead each rank writes `local_part` and rank 0 also writes `param_groups`; `merge`
turns them into the ordinary `state_dict()` of a plain optimizer built over the same param groups
(`etrain.core.optim.make_optimizer`). That state loads into a plain optimizer or a `ZeroRedundancyOptimizer`
at any world size, so the checkpoint does not depend on the world that wrote it.

Global indices are those of a plain optimizer's `state_dict()`: parameters numbered in order across
`param_groups`. A ZeRO optimizer's own `param_groups` is the global view, so the numbering is taken
from it; its `optim` is the local optimizer over this rank's parameters (both public attributes).
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


def _global_index(opt: ZeroRedundancyOptimizer) -> dict[torch.Tensor, int]:
    return {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in opt.param_groups))}


def _cpu_copy(value: Any) -> Any:
    # A copy even on CPU, where .cpu() returns the same tensor: training keeps updating it in place.
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def local_part(opt: ZeroRedundancyOptimizer) -> dict:
    """This rank's share of the optimizer state, keyed by global index, copied to CPU.

    `owned` lists every parameter this rank updates, with state or not (a parameter that never
    had a gradient has none): it lets `merge` tell such a parameter from a missing part.
    Needs no collective, so each rank can write its part when it likes.
    """
    index = _global_index(opt)
    local = opt.optim
    owned = sorted(index[p] for g in local.param_groups for p in g["params"])
    state = {index[p]: {k: _cpu_copy(v) for k, v in s.items()} for p, s in local.state.items()}
    return {"owned": owned, "state": dict(sorted(state.items()))}


def param_groups(opt: torch.optim.Optimizer) -> list[dict]:
    """The global param groups as a plain `state_dict()` has them: hyper-parameters (the current lr
    the scheduler set included) and `params` as global indices. The same on every rank; one writes it."""
    groups, start = [], 0
    for group in opt.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    return groups


def merge(parts: list[dict], groups: list[dict]) -> dict:
    """A plain optimizer `state_dict()` from every rank's `local_part` and the `param_groups`.

    The parts must partition the parameters exactly: an index owned by two parts, or by none,
    or unknown to `groups`, raises a ValueError naming the indices, rather than loading a state
    that silently restarts (or doubles) some parameters' moments. A part's order does not matter.
    """
    everything = [i for g in groups for i in g["params"]]
    owner: dict[int, int] = {}
    duplicates: set[int] = set()
    state: dict[int, dict] = {}
    for rank, part in enumerate(parts):
        for i in part["owned"]:
            if i in owner:
                duplicates.add(i)
            owner[i] = rank
        strays = sorted(set(part["state"]) - set(part["owned"]))
        if strays:
            raise ValueError(f"part {rank} has state for parameters it does not own: {strays}")
        state.update(part["state"])
    if duplicates:
        raise ValueError(f"parameters owned by more than one part: {sorted(duplicates)}")
    missing = sorted(set(everything) - set(owner))
    if missing:
        raise ValueError(f"parameters in no part (is a rank's part missing?): {missing}")
    unknown = sorted(set(owner) - set(everything))
    if unknown:
        raise ValueError(f"parts hold parameters the param groups do not list: {unknown}")
    return {"state": dict(sorted(state.items())), "param_groups": [dict(g) for g in groups]}
