"""One shard of a bounded-staleness parameter server: rounds of pushed gradients, one AdamW step per round.

Workers pull parameters, compute a gradient on their own batch and push it; a shard
folds pushes into *rounds* and applies one AdamW step per round on the
sample-weighted mean gradient (sum of pushed gradients / sum of pushed samples).
The shard is a plain class driven by asyncio only, so tests run it inside
`asyncio.run`; the caller wraps it as a Ray async actor (`max_concurrency` large).

Round semantics (a round is open from its first push until it is applied):

- It closes when every member (workers `0 .. workers-1`, the caller's dense ranks)
  has pushed into it, or when `window_s` has passed since its first push -- but the
  window may close it only while no member outside it *lags*: computes on a base
  <= version - max_staleness. A member computes from its pull until its push on
  that base is folded; an idle one (never pulled, or pushed since its last pull)
  holds nothing back. A lagging member is waited for until it pushes into the
  round or pulls again (then it is no longer behind).
- Closing applies the step, advances `version` by one and wakes every push in it.
- A gradient is folded into the open round whatever its base; its staleness
  (version when folded - base version) is recorded.
- A worker already in the open round (it pushed again before the round closed)
  waits and is folded into the next round: one push per worker per round.

Invariant: no applied gradient is staler than `max_staleness`. A version advances
only when every computing member has pushed into the round or is less than
max_staleness behind, so a member that pulls before each push stays in bound. A
push that would break the bound anyway (no pull before it, a rank that changed
hands, a second push queued behind the round with max_staleness=0) is refused
with ValueError. A member that pulls and then never pushes (nor leaves through
set_workers) holds rounds back once it lags: that is the bound doing its job.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from etrain.core.config import OptimConfig
from etrain.core.optim import lr_factor, make_optimizer


def assign_shards(shapes: dict[str, tuple[int, ...]], num_shards: int) -> list[list[str]]:
    """Whole parameters to shards, largest first onto the lightest shard.

    Greedy largest-first keeps every shard within the largest tensor's size of any
    other, and ties break on name and shard index so every process computes the
    same assignment from the same shapes.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    loads = [0] * num_shards
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        lightest = min(range(num_shards), key=lambda i: (loads[i], i))
        shards[lightest].append(name)
        loads[lightest] += math.prod(shapes[name])
    return shards


@dataclass(eq=False)
class _Round:
    """Pushes waiting for one update."""

    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over pushes
    samples: int = 0
    pushers: set[int] = field(default_factory=set)
    window_passed: bool = False
    timer: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = -1  # the version its update produced, once done
    lr: float = 0.0  # the learning rate of its update


class ParamShard:
    """A shard's parameters, their AdamW state, and the open round of pushes."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        optim_cfg: dict,
        total_steps: int,
        workers: int,
        window_s: float = 0.3,
        max_staleness: int = 2,
        samples_per_step: int = 1,
    ):
        if not params:
            raise ValueError("a parameter shard needs at least one parameter")
        if window_s < 0 or max_staleness < 0:
            raise ValueError(f"window_s={window_s} and max_staleness={max_staleness} must not be negative")
        self.cfg = OptimConfig(**optim_cfg)
        self.total_steps = total_steps
        self.samples_per_step = samples_per_step  # the lr schedule runs on samples applied, not on updates
        self.samples = 0  # applied so far
        self.window_s = window_s
        self.max_staleness = max_staleness
        self._params = {n: nn.Parameter(t.detach().to("cpu", torch.float32).clone()) for n, t in params.items()}
        self._opt = make_optimizer(nn.ParameterList(self._params.values()), self.cfg)
        self.version = 0
        self._bases: dict[int, int] = {}  # computing worker -> version it pulled
        self._round = _Round()
        self._stats = {"updates": 0, "pushes": 0, "max_staleness_seen": 0, "staleness_hist": {}, "window_closes": 0}
        self.set_workers(workers)

    async def push(self, worker: int, base_version: int, grads: dict[str, torch.Tensor], samples: int) -> dict:
        """Fold a gradient (summed over `samples` samples) into a round; return once that round is applied."""
        grads = self._checked(grads)
        if samples < 1:
            raise ValueError(f"worker {worker} pushed a gradient over {samples} samples; it needs at least one")
        if base_version > self.version:
            raise ValueError(
                f"worker {worker} pushed on base version {base_version}, newer than this shard's {self.version}"
            )
        while worker in self._round.pushers:
            await self._round.done.wait()
        staleness = self.version - base_version
        if staleness > self.max_staleness:
            raise ValueError(
                f"worker {worker}'s gradient is {staleness} versions stale (base {base_version}, now "
                f"{self.version}), over max_staleness={self.max_staleness}: pull before each push"
            )
        rnd = self._round
        self._fold(rnd, worker, base_version, grads, samples, staleness)
        self._maybe_close()
        await rnd.done.wait()
        return {"version": rnd.version, "staleness": staleness, "applied_with": len(rnd.pushers), "lr": rnd.lr}

    async def pull(self, worker: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version and parameters; `worker` computes on them from now on."""
        self._bases[worker] = self.version  # caught up: a round waiting for it may close now ...
        self._maybe_close()
        self._bases[worker] = self.version  # ... and then it gets that round's result
        return self.version, {n: p.detach().clone() for n, p in self._params.items()}

    async def read(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version and parameters, for an evaluation or a checkpoint: nobody computes on them."""
        return self.version, {n: p.detach().clone() for n, p in self._params.items()}

    def set_workers(self, workers: int) -> None:
        """Members become ranks 0 .. workers-1; the open round re-checks whether it is complete."""
        if workers < 1:
            raise ValueError(f"a parameter shard needs at least one worker, got {workers}")
        self.workers = workers
        self._bases = {w: v for w, v in self._bases.items() if w < workers}
        self._maybe_close()

    def stats(self) -> dict:
        return {"version": self.version, **self._stats, "staleness_hist": dict(self._stats["staleness_hist"])}

    def state(self) -> dict:
        """Applied parameters and AdamW moments by name; pushes in the open round are not part of it."""
        optim = {}
        for name, p in self._params.items():
            fresh = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            s = self._opt.state.get(p) or fresh  # what AdamW starts from
            optim[name] = {k: s[k].detach().clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        return {
            "version": self.version,
            "samples": self.samples,
            "optim": optim,
            "params": {n: p.detach().clone() for n, p in self._params.items()},
        }

    def load(self, state: dict) -> None:
        """Restore a state(); a parameter missing from state["optim"] starts its AdamW moments afresh.

        Workers must pull again: what they computed on belongs to the state before.
        """
        if self._round.pushers:
            raise ValueError(f"cannot load while workers {sorted(self._round.pushers)} have pushes in the open round")
        params = self._checked(state["params"])
        moments = state["optim"]
        if unknown := moments.keys() - self._params.keys():
            raise ValueError(f"optimizer state for parameters not in this shard: {sorted(unknown)}")
        for name, m in moments.items():
            self._check_shape(name, m["exp_avg"])
            self._check_shape(name, m["exp_avg_sq"])
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(params[name])
                self._opt.state.pop(p, None)
                if name in moments:
                    self._opt.state[p] = {
                        k: moments[name][k].detach().to(torch.float32).clone()
                        for k in ("step", "exp_avg", "exp_avg_sq")
                    }
        self.version = int(state["version"])
        self.samples = int(state.get("samples", 0))
        self._bases = {}

    def _checked(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Exactly this shard's names and shapes, as CPU fp32: a mismatch is a sharding bug upstream."""
        missing, extra = self._params.keys() - tensors.keys(), tensors.keys() - self._params.keys()
        if missing or extra:
            raise ValueError(
                f"parameter names do not match this shard: missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        for name, t in tensors.items():
            self._check_shape(name, t)
        return {n: t.detach().to("cpu", torch.float32) for n, t in tensors.items()}

    def _check_shape(self, name: str, t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(self._params[name].shape):
            raise ValueError(
                f"parameter {name!r}: got shape {tuple(t.shape)}, expected {tuple(self._params[name].shape)}"
            )

    def _fold(
        self, rnd: _Round, worker: int, base: int, grads: dict[str, torch.Tensor], samples: int, staleness: int
    ) -> None:
        if not rnd.pushers:
            rnd.timer = asyncio.get_running_loop().create_task(self._window(rnd))
            rnd.grads = {n: g.clone() for n, g in grads.items()}  # a copy: Ray's tensors may be read-only
        else:
            for n, g in grads.items():
                rnd.grads[n].add_(g)
        rnd.samples += samples
        rnd.pushers.add(worker)
        if self._bases.get(worker, base) <= base:
            self._bases.pop(worker, None)  # idle until it pulls again: nothing of it in flight to wait for
        hist = self._stats["staleness_hist"]
        hist[staleness] = hist.get(staleness, 0) + 1
        self._stats["pushes"] += 1
        self._stats["max_staleness_seen"] = max(self._stats["max_staleness_seen"], staleness)

    async def _window(self, rnd: _Round) -> None:
        await asyncio.sleep(self.window_s)
        rnd.window_passed = True
        self._maybe_close()

    def _maybe_close(self) -> None:
        rnd = self._round
        if not rnd.pushers:
            return
        if set(range(self.workers)) <= rnd.pushers:
            self._close(by_window=False)
        elif rnd.window_passed and not self._lagging(rnd):
            self._close(by_window=True)

    def _lagging(self, rnd: _Round) -> list[int]:
        """Computing members outside the round that one more version would push past max_staleness."""
        return [
            w
            for w, base in self._bases.items()
            if w < self.workers and w not in rnd.pushers and base <= self.version - self.max_staleness
        ]

    def _close(self, by_window: bool) -> None:
        rnd = self._round
        rnd.lr = self._step(rnd.grads, rnd.samples)
        self.version += 1
        self._stats["updates"] += 1
        self._stats["window_closes"] += by_window
        if not rnd.window_passed:
            rnd.timer.cancel()
        rnd.version = self.version
        self._round = _Round()
        rnd.done.set()

    def _step(self, grads: dict[str, torch.Tensor], samples: int) -> float:
        """One AdamW step on the sample-weighted mean gradient, at the schedule's lr for this version."""
        for name, p in self._params.items():
            p.grad = grads[name] / samples
        lr = self.cfg.lr * lr_factor(self.samples // self.samples_per_step, self.cfg, self.total_steps)
        for group in self._opt.param_groups:
            group["lr"] = lr
        self._opt.step()
        self.samples += samples
        for p in self._params.values():
            p.grad = None
        return lr
