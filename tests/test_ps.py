"""The parameter-server shard without Ray: a plain object driven by asyncio tasks."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from torch import nn

from etrain.control.ps import ParamShard, assign_shards
from etrain.core.config import OptimConfig
from etrain.core.optim import make_scheduler

OPTIM = {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.1}
SHAPES = {
    "wte": (64, 16),
    "h.0.attn.w": (16, 48),
    "h.0.attn.b": (48,),
    "h.0.ln.g": (16,),
    "h.0.mlp.w": (16, 64),
    "h.1.attn.w": (16, 48),
    "h.1.mlp.w": (64, 16),
    "h.1.ln.g": (16,),
    "ln_f.g": (16,),
    "scale": (),
}


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=gen),
        "b": torch.randn(3, generator=gen),
        "g": torch.randn(3, generator=gen),
    }


def grads_like(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}


def shard(workers: int, window_s: float = 5.0, max_staleness: int = 2, **kw) -> ParamShard:
    return ParamShard(
        init_params(), OPTIM, total_steps=6, workers=workers, window_s=window_s, max_staleness=max_staleness, **kw
    )


async def step(ps: ParamShard, worker: int, seed: int, samples: int = 4, compute_s: float = 0.0) -> dict:
    """One worker iteration: pull, compute for compute_s, push a gradient seeded by `seed`."""
    version, params = await ps.pull(worker)
    await asyncio.sleep(compute_s)
    return await ps.push(worker, version, grads_like(params, seed), samples)


def run_all(*coros, timeout_s: float = 10.0) -> list:
    """Run coroutines concurrently on a fresh loop; a hang fails the test instead of stalling it."""

    async def gathered():
        return await asyncio.wait_for(asyncio.gather(*coros), timeout_s)

    return asyncio.run(gathered())


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 10])
def test_assign_shards_balanced_complete_deterministic(num_shards):
    shards = assign_shards(SHAPES, num_shards)
    names = [n for s in shards for n in s]
    assert sorted(names) == sorted(SHAPES) and len(shards) == num_shards
    loads = [sum(math.prod(SHAPES[n]) for n in s) for s in shards]
    assert max(loads) - min(loads) <= max(math.prod(s) for s in SHAPES.values())
    shuffled = dict(random.Random(num_shards).sample(list(SHAPES.items()), len(SHAPES)))
    assert assign_shards(shuffled, num_shards) == shards


def test_prompt_rounds_equal_adamw_on_sample_weighted_mean():
    ps = shard(workers=3, samples_per_step=12)  # a round holds 2 + 3 + 7 samples: one step of the schedule
    ref = {n: nn.Parameter(t.clone()) for n, t in init_params().items()}
    cfg = OptimConfig(**OPTIM)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref["w"]], "weight_decay": cfg.weight_decay},
            {"params": [ref["b"], ref["g"]], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )
    ref_sched = make_scheduler(ref_opt, cfg, total_steps=6)

    async def go():
        for r in range(3):
            samples = [2, 3, 7]
            results = await asyncio.gather(*(step(ps, w, seed=10 * r + w, samples=samples[w]) for w in range(3)))
            assert [x["version"] for x in results] == [r + 1] * 3
            assert all(x["staleness"] == 0 and x["applied_with"] == 3 for x in results)
            summed = [grads_like(ref, 10 * r + w) for w in range(3)]
            for n, p in ref.items():
                p.grad = sum(g[n] for g in summed) / sum(samples)
            ref_opt.step()
            ref_sched.step()

    asyncio.run(go())
    _, params = asyncio.run(ps.pull(0))
    for n, p in ref.items():
        torch.testing.assert_close(params[n], p.detach(), atol=1e-6, rtol=0)
    assert ps.stats()["updates"] == 3 and ps.stats()["window_closes"] == 0


def test_straggler_is_folded_into_a_later_round():
    ps = shard(workers=3, window_s=0.1, max_staleness=3)

    async def fast(w: int) -> list[dict]:
        return [await step(ps, w, seed=i, compute_s=0.01) for i in range(6)]

    async def slow() -> list[dict]:  # done after two pushes: idle, it holds back no round after that
        return [await step(ps, 2, seed=i, compute_s=0.2) for i in range(2)]

    *_, straggler = run_all(fast(0), fast(1), slow())
    stats = ps.stats()
    assert stats["window_closes"] > 0
    assert all(r["staleness"] >= 1 for r in straggler)
    assert stats["max_staleness_seen"] <= 3 and stats["max_staleness_seen"] >= 1
    assert sum(stats["staleness_hist"].values()) == stats["pushes"] == 14


def test_very_slow_straggler_holds_fast_pushers_at_the_bound():
    ps = shard(workers=3, window_s=0.05, max_staleness=2)
    done = asyncio.Event()

    async def fast(w: int) -> list[dict]:
        out = []
        while not done.is_set():
            out.append(await step(ps, w, seed=len(out), compute_s=0.01))
        return out

    async def slow() -> list[dict]:
        out = [await step(ps, 2, seed=i, compute_s=0.5) for i in range(2)]
        ps.set_workers(2)  # it leaves: rounds no longer wait for it
        done.set()
        return out

    _, _, straggler = run_all(fast(0), fast(1), slow())
    stats = ps.stats()
    assert [r["staleness"] for r in straggler] == [2, 2]  # fast pushers were blocked at the bound, not past it
    assert stats["max_staleness_seen"] == 2 and set(stats["staleness_hist"]) <= {0, 1, 2}
    assert stats["version"] <= 2 * (2 + 1) + 1  # about 1 s of fast pushing, yet only a few versions


def test_idle_members_do_not_hold_rounds_back():
    """The caller's drain: only some workers get a last batch; the others neither pull nor push."""
    ps = shard(workers=3, window_s=0.02, max_staleness=1)

    async def go():
        await asyncio.gather(*(step(ps, w, seed=w) for w in range(3)))
        return [await step(ps, 0, seed=s) for s in range(3)]

    [alone] = run_all(go())
    assert [r["version"] for r in alone] == [2, 3, 4] and ps.stats()["window_closes"] == 3


def test_second_push_of_a_worker_waits_for_the_next_round():
    ps = shard(workers=2)

    async def go():
        first = asyncio.create_task(step(ps, 0, seed=1))
        second = asyncio.create_task(step(ps, 0, seed=2))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        other = await step(ps, 1, seed=3)
        assert (await first)["version"] == other["version"] == 1 and other["applied_with"] == 2
        await asyncio.sleep(0.05)
        assert not second.done()
        await step(ps, 1, seed=4)
        return await second

    [second] = run_all(go())
    assert {k: second[k] for k in ("version", "staleness", "applied_with")} == {
        "version": 2,
        "staleness": 1,
        "applied_with": 2,
    }


def test_set_workers_changes_the_round_size():
    ps = shard(workers=3)

    async def go():
        ps.set_workers(2)
        results = await asyncio.gather(step(ps, 0, seed=0), step(ps, 1, seed=1))
        assert [r["applied_with"] for r in results] == [2, 2]
        ps.set_workers(3)
        pending = [asyncio.create_task(step(ps, w, seed=w)) for w in (0, 1)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in pending)  # waits for the third worker
        ps.set_workers(2)  # ... until it leaves
        return await asyncio.gather(*pending)

    [results] = run_all(go())
    assert [r["version"] for r in results] == [2, 2]
    assert ps.stats()["window_closes"] == 0


def test_state_load_round_trips_exactly():
    a = shard(workers=1)
    fresh = ParamShard(init_params(seed=7), OPTIM, total_steps=6, workers=1)

    async def go(ps: ParamShard, seeds: range):
        for s in seeds:
            await step(ps, 0, seed=s)

    asyncio.run(go(a, range(2)))
    fresh.load(a.state())
    assert_states_equal(fresh.state(), a.state())
    asyncio.run(go(a, range(2, 4)))
    asyncio.run(go(fresh, range(2, 4)))
    assert_states_equal(fresh.state(), a.state())
    assert_states_equal(shard(workers=1).state(), shard(workers=1).state())  # before any step, too


def test_load_without_moments_starts_them_afresh():
    a = shard(workers=1)
    asyncio.run(step(a, 0, seed=0))
    state = a.state()
    del state["optim"]["b"]
    b = shard(workers=1)
    b.load(state)
    moments = b.state()["optim"]
    assert moments["b"]["step"].item() == 0 and not moments["b"]["exp_avg"].any()
    assert torch.equal(moments["w"]["exp_avg"], state["optim"]["w"]["exp_avg"])


def assert_states_equal(x: dict, y: dict) -> None:
    assert x["version"] == y["version"]
    for n in y["params"]:
        assert torch.equal(x["params"][n], y["params"][n])
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(x["optim"][n][k], y["optim"][n][k]), (n, k)


@pytest.mark.parametrize(
    "grads, match",
    [
        ({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "missing \\['g'\\]"),
        ({"w": torch.zeros(4, 3), "b": torch.zeros(3), "g": torch.zeros(3), "x": torch.zeros(1)}, "unknown \\['x'\\]"),
        ({"w": torch.zeros(3, 4), "b": torch.zeros(3), "g": torch.zeros(3)}, "parameter 'w': got shape \\(3, 4\\)"),
    ],
)
def test_mismatched_push_names_the_parameter(grads, match):
    with pytest.raises(ValueError, match=match):
        asyncio.run(shard(workers=1).push(0, 0, grads, 1))


def test_push_past_the_bound_is_refused():
    ps = shard(workers=1, max_staleness=1)

    async def go():
        for s in range(2):
            await step(ps, 0, seed=s)
        with pytest.raises(ValueError, match="2 versions stale"):
            await ps.push(0, 0, grads_like(init_params(), 0), 1)

    asyncio.run(go())
