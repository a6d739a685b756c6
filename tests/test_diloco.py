"""DiLoCo (comm.mode=diloco) in the elastic trainer, on the session's Ray.

The reference is DiLoCo written out by hand in this process: workers' inner steps by the engine's own step code, and
the outer step (the samples-weighted mean pseudo-gradient, then Nesterov) from the paper's formula, not ours. Then
the promises around it: a crash mid-window resumes bitwise from the last outer step's checkpoint, and a worker
lost mid-window sends the run back to the last outer step with every sample still read once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from etrain.control.control import JobError
from etrain.core import checkpoint
from etrain.core.records import read_jsonl
from etrain.data import order
from etrain.data.shards import ShardReader, read_manifest
from etrain.driver.job import new_run_dir, resolve_data, train
from etrain.worker.actor import step_seed
from etrain.worker.diloco import Diloco
from etrain.worker.injection import Injected

from helpers.runs import FAST, records

pytestmark = pytest.mark.usefixtures("ray_session")

H, STEPS = 3, 8  # outer steps at 3, 6 and 8 (the run's end closes a window early)
BASE = [
    *FAST, f"train.steps={STEPS}", "comm.mode=diloco", f"comm.diloco.inner_steps={H}", "balance.enabled=false",
    "cluster.warm_pool=0",
]  # fmt: skip


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in records(run_dir, "train")]


def by_hand(cfg, workers: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DiLoCo as its paper writes it: each worker's losses summed per step, and the final weights."""
    manifest = resolve_data(cfg)
    shards = read_manifest(manifest)["splits"]["train"]["shards"]
    layout = order.Layout(cfg.train.seed, tuple(s["samples"] for s in shards), cfg.data.shuffle_shards)
    reader = ShardReader(manifest, "train", cfg.data.cache_shards)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.cpus_per_worker)  # as a worker computes, so the sums round alike
    try:
        engines = [Diloco(cfg, torch.device("cpu")) for _ in range(workers)]
        outer = [p.detach().clone() for p in engines[0].trained]
        momentum = [torch.zeros_like(p) for p in outer]
        d, batch, cursor, out = cfg.comm.diloco, cfg.train.global_batch, 0, []
        taken = [0] * workers
        for step in range(1, cfg.train.steps + 1):
            shares = order.plan_step(layout, cursor, batch, [1.0] * workers)
            cursor += batch
            total = 0.0
            for rank, (engine, ids) in enumerate(zip(engines, shares)):
                torch.manual_seed(step_seed(cfg.train.seed, step, rank))
                engine.optimizer.zero_grad(set_to_none=True)
                rows = torch.from_numpy(reader.get(ids).astype(np.int64))
                loss, _ = engine.forward_backward(rows, batch, Injected())
                engine.update(batch, 1.0, math.inf)
                total += loss
                taken[rank] += len(ids)
            out.append(total)
            if step % H and step != cfg.train.steps:
                continue
            with torch.no_grad():
                for i, o in enumerate(outer):
                    g = sum((o - e.trained[i]) * (n / sum(taken)) for e, n in zip(engines, taken))
                    momentum[i] = g if step == H else d.outer_momentum * momentum[i] + g  # torch's first: g
                    o -= d.outer_lr * (g + d.outer_momentum * momentum[i])
                    for e in engines:
                        e.trained[i].copy_(o)
            taken = [0] * workers
        return out, {k: v.clone() for k, v in engines[0].model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("workers", [2, 3])
def test_diloco_trains_what_the_paper_writes_and_meets_once_per_window(make_cfg, workers):
    """Against the hand-written reference, step by step: each worker trains alone on its share of every global batch
    (the cursor moves once per sample), and the workers meet only at outer steps, sending the trained weights'
    bytes once there and nothing in between."""
    cfg = make_cfg(*BASE, f"run.name=diloco-{workers}", f"cluster.num_workers={workers}", "checkpoint.every=4")
    run_dir = new_run_dir(cfg)
    summary = train(cfg, run_dir, progress=False)
    assert summary["steps"] == STEPS
    want, weights = by_hand(cfg, workers)
    assert losses(run_dir) == pytest.approx(want, rel=1e-5)
    trained = records(run_dir, "train")
    assert [r["cursor"] for r in trained] == [16 * s for s in range(1, STEPS + 1)]
    dense = 4 * cfg.model.param_count()
    sent = {r["step"]: r["comm_bytes"] for r in trained}
    assert sent == {s: workers * (dense + 8) if s in (3, 6, 8) else 0 for s in range(1, STEPS + 1)}
    # checkpoint.every=4 falls inside a window: the save waits for its outer step
    assert [c["step"] for c in records(run_dir, "checkpoint")] == [6, 8]
    saved = checkpoint.model_weights(checkpoint.load_latest(str(run_dir / "checkpoints")).parts)
    assert saved.keys() == weights.keys()
    for k, v in weights.items():
        assert torch.allclose(saved[k], v, rtol=1e-5, atol=1e-6), k


def test_a_crash_between_outer_steps_resumes_bitwise_from_the_last_one(make_cfg, rng):
    """A worker dies with no recovery left, at a drawn step inside a window, of a drawn rank; the resumed run goes on
    from the last outer step's checkpoint and every step's loss equals the uninterrupted run's, bit for bit."""
    steps = 12
    base = [*BASE, f"train.steps={steps}", "checkpoint.every=3"]
    reference = new_run_dir(make_cfg(*base, "run.name=uninterrupted"))
    train(make_cfg(*base, "run.name=uninterrupted"), reference, progress=False)
    rank, step = rng.randrange(2), rng.choice([s for s in range(4, steps) if s % H])
    print(f"rank {rank} dies at step {step}")
    faulted = [*base, "run.name=crashed", "cluster.max_recoveries=0"]
    run_dir = new_run_dir(make_cfg(*faulted))
    with pytest.raises(JobError, match="max_recoveries"):
        train(make_cfg(*faulted, f"faults=[{{rank: {rank}, step: {step}, kind: kill}}]"), run_dir, progress=False)
    train(make_cfg(*faulted), run_dir, resume=True, progress=False)
    resumed_at = records(run_dir, "resume")[0]["step"]  # the last save may still have been in flight at the crash
    assert resumed_at % H == 0 and resumed_at <= (step - 1) // H * H
    assert losses(run_dir) == losses(reference)


def test_a_worker_lost_between_outer_steps_sends_the_window_back_and_a_joiner_takes_a_peers_state(make_cfg, rng):
    """2 workers and a pool worker; a drawn rank dies at a drawn step inside a window. The run goes back to the
    last outer step (an `outer` rewind), the pool worker takes the lost one's place with a live peer's state of that
    step, and the window is redone by the new group: every step once in the records, every sample once, and the
    redone window starts from exactly the state the uninterrupted run had there."""
    steps = 90  # room for the pool worker to start (~3-8 s here): the fault waits for it
    rank, step = rng.randrange(2), rng.choice([s for s in range(4, 12) if s % H])
    print(f"rank {rank} dies at step {step}")
    base = [*BASE, f"train.steps={steps}", "cluster.warm_pool=1"]
    reference = new_run_dir(make_cfg(*base, "run.name=whole"))
    train(make_cfg(*base, "run.name=whole"), reference, progress=False)
    cfg = make_cfg(*base, "run.name=lost", f"faults=[{{rank: {rank}, step: {step}, kind: kill, ready_pool: true}}]")
    run_dir = new_run_dir(cfg)
    assert train(cfg, run_dir, progress=False)["steps"] == steps
    # held until the pool worker was ready; its record went aside with the redone window's (metrics.redone.jsonl),
    # unless it fired at a window's first step, where nothing is redone
    redone = run_dir / "metrics.redone.jsonl"
    kept = [*(read_jsonl(redone) if redone.exists() else []), *read_jsonl(run_dir / "metrics.jsonl")]
    fired = [r for r in kept if r["kind"] == "fault"][0]["step"]
    start = (fired - 1) // H * H
    rewinds = records(run_dir, "outer")
    if (fired - 1) % H:  # the lost step was not the first of its window: the window's steps before it are redone
        assert [(r["step"], r["reached_step"]) for r in rewinds] == [(start, fired - 1)], rewinds
    else:
        assert rewinds == []
    trained = records(run_dir, "train")
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert [r["cursor"] for r in trained] == [16 * s for s in range(1, steps + 1)]
    change = records(run_dir, "membership")[-1]
    assert (change["step"], change["reason"], change["world_after"], change["joiners"]) == (start, "recover", 2, 1)
    assert all(r["world_size"] == 2 for r in trained)
    dense = 4 * cfg.model.param_count()
    assert [r["comm_bytes"] for r in trained if r["step"] % H == 0] == [2 * (dense + 8)] * (steps // H)
    assert all(math.isfinite(r["loss"]) for r in trained)
    # Up to the window's first step, the uninterrupted run's: that step's loss is of the outer parameters alone (the
    # survivor's restored, the joiner's taken from it), on the same shares
    assert losses(run_dir)[: start + 1] == losses(reference)[: start + 1]


def test_an_outer_step_whose_step_failed_is_undone_before_the_window_is_redone(make_cfg):
    """A rank whose outer step ran while its step as a whole failed (a peer lost after this rank's all-reduce) holds
    outer parameters and momentum the run never committed; rejoining restores the last committed ones exactly, as
    on the ranks that never got that far."""
    cfg = make_cfg(*BASE)
    engine = Diloco(cfg, torch.device("cpu"))
    engine.join(0, 1)
    manifest = resolve_data(cfg)
    reader = ShardReader(manifest, "train", cfg.data.cache_shards)

    def window(first: int) -> None:
        for step in range(first, first + H):
            engine.optimizer.zero_grad(set_to_none=True)
            engine.forward_backward(torch.from_numpy(reader.get(np.arange(8) + step).astype(np.int64)), 8, Injected())
            engine.update(8, 1.0, math.inf)
            engine.outer_step(step)
            if step < first + H - 1:
                engine.committed(step)

    window(1)
    engine.committed(H)  # the first outer step lands: momentum now nonzero
    committed = [o.clone() for o in engine.outer], engine.outer_optimizer.state_dict()["state"]
    committed_momentum = {k: v["momentum_buffer"].clone() for k, v in committed[1].items()}
    window(H + 1)  # the second outer step runs, but its step is not committed
    assert not all(torch.equal(a, b) for a, b in zip(engine.outer, committed[0]))
    engine.leave(failed=True)
    engine.join(0, 1)
    assert all(torch.equal(a, b) for a, b in zip(engine.outer, committed[0]))
    assert all(torch.equal(a, b) for a, b in zip(engine.trained, committed[0]))
    after = engine.outer_optimizer.state_dict()["state"]
    assert all(torch.equal(after[k]["momentum_buffer"], v) for k, v in committed_momentum.items())
