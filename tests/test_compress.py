"""GradSync on a real two-rank gloo group: every mode agrees across ranks and counts what it sends; top-k loses nothing.

The ranks run every scenario in one spawn (a process start costs seconds) and save what
they saw; the tests below judge it. An exception in a rank fails the spawn, and so the tests.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from etrain.worker.compress import SEGMENT, GradSync, topk_compress, topk_decompress, topk_kept

WORLD = 2
BUCKET_MB = 0.1  # two buckets once DDP rebuilds them after step 0; the 256x256 one spans three top-k segments
STEPS = 4
POWERSGD_START = 2  # the least torch allows: DDP rebuilds its buckets after the first step; top-k's start too
EF_STEPS = 3  # top-k steps on each DDP in the error-feedback scenario


def make_model() -> nn.Module:
    torch.manual_seed(0)  # same weights on every rank and in the reference
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * rank + step))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@contextmanager
def wire_bytes():
    """Count the bytes handed to the collectives the hooks call: the truth GradSync's counters must match."""
    sent, originals = [], (dist.all_reduce, dist.all_gather_into_tensor)

    def all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.nbytes)
        return originals[0](tensor, *args, **kwargs)

    def all_gather_into_tensor(output, tensor, *args, **kwargs):
        sent.append(tensor.nbytes)
        return originals[1](output, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather_into_tensor = all_reduce, all_gather_into_tensor
    try:
        yield sent
    finally:
        dist.all_reduce, dist.all_gather_into_tensor = originals


def train_steps(ddp: DDP, sync: GradSync, rank: int, steps: range) -> list[dict]:
    """Backward only (no optimizer): each step's stats, with the bytes that really went out."""
    stats = []
    for step in steps:
        sync.begin(step + 1)
        ddp.module.zero_grad()
        with wire_bytes() as sent:
            loss_of(ddp, batch(rank, step)).backward()
        sync.commit(step + 1)
        stats.append({**sync.take_stats(), "wire": sum(sent)})
    return stats


def round_trip(rank: int, mode: str) -> dict:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    sync = GradSync(mode, topk_ratio=0.1, powersgd_rank=2, start=POWERSGD_START)
    sync.register(ddp)
    out = {"stats": train_steps(ddp, sync, rank, range(STEPS)), "grad": flat_grad(model)}
    if mode == "powersgd":  # a new group past the start: two steps of plain all-reduce, then compressed again
        ddp = DDP(model, process_group=dist.new_group(list(range(WORLD))), bucket_cap_mb=BUCKET_MB)
        sync.register(ddp)
        out["regrouped"] = train_steps(ddp, sync, rank, range(STEPS, STEPS + 3))
    return out


def error_feedback(rank: int) -> dict:
    """The same batch every step, so the true gradient is fixed; half the steps on a second DDP."""
    model, x = make_model(), batch(rank, 0)
    sync = GradSync("topk", topk_ratio=0.1)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    sync.register(ddp)
    with ddp.no_sync():  # no hook: the local gradient
        loss_of(ddp, x).backward()
    out = {"local": flat_grad(model), "synced": []}

    def residual() -> torch.Tensor:
        return torch.cat([sync.residuals[p] for p in model.parameters()])

    step = 0
    for phase in ("first", "second"):
        if phase == "second":
            out["before"] = residual()
            ddp = DDP(model, process_group=dist.new_group(list(range(WORLD))), bucket_cap_mb=BUCKET_MB)
            sync.register(ddp)
            sync.regroup(rank, WORLD, list(model.named_parameters()), step)
            out["carried"] = residual()
        for _ in range(EF_STEPS):
            sync.begin(step + 1)
            model.zero_grad()
            loss_of(ddp, x).backward()
            step += 1
            sync.commit(step)
            out["synced"].append(flat_grad(model))
    out["residual"] = residual()
    sync.begin(step + 1)  # a step that fails after its sync (a peer lost): redone later, from the residuals before it
    model.zero_grad()
    loss_of(ddp, x).backward()
    out["uncommitted"] = residual()
    return out


def rank_main(rank: int, meet: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo", init_method=f"file://{meet}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    results = {mode: round_trip(rank, mode) for mode in ("none", "fp16", "bf16", "powersgd", "topk")}
    results["error_feedback"] = error_feedback(rank)
    torch.save(results, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gradsync")
    mp.spawn(rank_main, args=(str(out / "meet"), str(out)), nprocs=WORLD)  # a file: no port to lose to a race
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def exact_grad() -> torch.Tensor:
    """The average of the ranks' gradients at the last step, in fp32 in one process."""
    model = make_model()
    for rank in range(WORLD):
        loss_of(model, batch(rank, STEPS - 1)).backward()
    return flat_grad(model) / WORLD


def ratios(stats: list[dict]) -> list[float]:
    return [s["comm_bytes"] / s["dense_bytes"] for s in stats]


def check_counted(result: dict) -> None:
    """Both ranks end with the same gradient; the counters match the wire, every step has a ready time."""
    a, b = result
    assert torch.equal(a["grad"], b["grad"])
    for stats in (a["stats"], b["stats"]):
        assert [s["comm_bytes"] for s in stats] == [s["wire"] for s in stats]
        assert all(s["dense_bytes"] == 4 * a["grad"].numel() for s in stats)
        assert all(isinstance(s["last_ready"], float) for s in stats)


@pytest.mark.parametrize("mode, ratio, tol", [("none", 1.0, 1e-6), ("fp16", 0.5, 1e-3), ("bf16", 0.5, 1e-2)])
def test_cast_modes_average_the_gradient(ranks, exact_grad, mode, ratio, tol):
    result = [r[mode] for r in ranks]
    check_counted(result)
    assert ratios(result[0]["stats"]) == [ratio] * STEPS
    torch.testing.assert_close(result[0]["grad"], exact_grad, rtol=tol, atol=tol * exact_grad.abs().max().item())


def test_topk_sends_a_tenth(ranks, exact_grad):
    result = [r["topk"] for r in ranks]
    check_counted(result)
    assert ratios(result[0]["stats"])[:POWERSGD_START] == [1.0] * POWERSGD_START  # plain all-reduce first
    assert all(0.1 <= r <= 0.11 for r in ratios(result[0]["stats"])[POWERSGD_START:])
    assert torch.cosine_similarity(result[0]["grad"], exact_grad, dim=0) > 0.5  # the largest entries carry most of it


def test_powersgd_compresses_after_its_start_and_again_after_a_new_group(ranks, exact_grad):
    result = [r["powersgd"] for r in ranks]
    check_counted(result)
    assert ratios(result[0]["stats"])[:POWERSGD_START] == [1.0] * POWERSGD_START
    assert all(r < 0.2 for r in ratios(result[0]["stats"])[POWERSGD_START:])
    assert ratios(result[0]["regrouped"])[:2] == [1.0, 1.0] and ratios(result[0]["regrouped"])[2] < 0.2
    assert torch.cosine_similarity(result[0]["grad"], exact_grad, dim=0) > 0.4  # rank 2 of a random-ish gradient: 0.61


def test_topk_keeps_the_largest_entries_of_each_segment():
    g = torch.randn(3 * SEGMENT + 1000, generator=torch.Generator().manual_seed(0))
    payload, residual = topk_compress(g, 0.1)
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * topk_kept(g.numel(), 0.1)
    sent = topk_decompress(payload, g.numel(), 0.1)  # what this one rank contributes
    assert torch.equal(sent + residual, g)  # the residual holds fp16's rounding too
    for start in range(0, g.numel(), SEGMENT):
        seg_g, seg_sent = g[start : start + SEGMENT], sent[start : start + SEGMENT]
        kept = seg_sent != 0
        assert kept.sum() == math.ceil(0.1 * len(seg_g))
        assert seg_g[kept].abs().min() >= seg_g[~kept].abs().max()


def test_topk_error_feedback_loses_nothing(ranks):
    """Per rank: what it sent over all steps + its residual = steps x its gradient; summed over ranks."""
    result = [r["error_feedback"] for r in ranks]
    assert torch.equal(result[0]["synced"][-1], result[1]["synced"][-1])
    sent = WORLD * torch.stack(result[0]["synced"]).sum(0)  # each step's result is the mean over ranks
    true = 2 * EF_STEPS * sum(r["local"] for r in result)
    torch.testing.assert_close(sent + sum(r["residual"] for r in result), true, rtol=1e-5, atol=1e-6)


def test_topk_residual_survives_a_new_ddp(ranks):
    for r in (rank["error_feedback"] for rank in ranks):
        assert r["before"].abs().sum() > 0
        assert torch.equal(r["carried"], r["before"])


def test_a_step_counts_in_the_residuals_only_once_committed(ranks):
    for r in (rank["error_feedback"] for rank in ranks):
        assert torch.equal(r["uncommitted"], r["residual"])


def residual_sync(values: list[float], world: int, applied: int = 5) -> tuple[GradSync, list]:
    """A top-k GradSync of a group of `world` holding one residual per parameter, as committed at `applied`."""
    named = [(f"p{i}", torch.zeros(2)) for i in range(len(values))]
    sync = GradSync("topk")
    sync.regroup(0, world, named, applied)
    sync.residuals = {p: torch.full((2,), v) for (_, p), v in zip(named, values)}
    return sync, named


def test_a_resize_keeps_each_staying_ranks_share_of_the_unsent_mean():
    """The mean over ranks carries residual/world of each rank: at 3 ranks instead of 2, a rank's residual is
    1.5x, so residual/world is unchanged; a joiner has none."""
    sync, named = residual_sync([2.0, -4.0], world=2)
    sync.regroup(1, 3, named, applied=5)
    assert [r.tolist() for r in sync.residuals.values()] == [[3.0, 3.0], [-6.0, -6.0]]
    sync.regroup(0, 3, named, applied=5)  # same size: unchanged
    assert sync.residuals[named[0][1]].tolist() == [3.0, 3.0]


def test_residuals_of_another_state_are_dropped():
    sync, named = residual_sync([2.0], world=2, applied=5)
    sync.loaded(5)  # a state at the step they belong to (a ZeRO-1 re-shard): kept
    assert sync.residuals
    sync.regroup(0, 2, named, applied=7)  # the worker trained alone since (no hook, no residuals made)
    assert sync.residuals == {}
    sync, named = residual_sync([2.0], world=2, applied=5)
    sync.loaded(3)  # a peer's state at another step
    assert sync.residuals == {}


def test_a_checkpoints_residuals_go_back_to_their_ranks_or_their_mean_at_another_size():
    saved = [{"p0": torch.tensor([1.0, 1.0])}, {"p0": torch.tensor([3.0, 5.0])}]
    for rank, world, expected in [(1, 2, [3.0, 5.0]), (0, 2, [1.0, 1.0]), (2, 3, [2.0, 3.0])]:  # at 3: the mean
        sync, named = residual_sync([9.0], world=world, applied=1)
        sync.loaded(12, saved)
        sync.regroup(rank, world, named, applied=12)
        assert sync.residuals[named[0][1]].tolist() == expected and sync.held_at == 12
        assert sync.saved(named, 12)["p0"].tolist() == expected and sync.saved(named, 13) == {}


def test_a_rank_that_saved_no_residuals_counts_as_zero_in_their_mean():
    """A joiner that had sent nothing yet when the checkpoint was taken saved an empty file: the mean over the
    saving ranks keeps the sum the averaged update carries (3 ranks' sum over 3, not over the 2 with residuals)."""
    saved = [{"p0": torch.tensor([3.0, 3.0])}, {}, {"p0": torch.tensor([6.0, 0.0])}]
    sync, named = residual_sync([9.0], world=2, applied=1)
    sync.loaded(12, saved)
    sync.regroup(0, 2, named, applied=12)
    assert sync.residuals[named[0][1]].tolist() == [3.0, 1.0]


def test_alone_in_a_group_the_residuals_are_dropped():
    sync, named = residual_sync([2.0], world=2)
    sync.drop()
    sync.regroup(0, 2, named, applied=5)  # back in a group of 2 at the same step: nothing from before
    assert sync.residuals == {}


def test_an_outliers_skipped_step_leaves_the_residuals_as_they_were():
    sync, named = residual_sync([2.0], world=2)
    sync.begin(6)
    sync._next = {named[0][1]: torch.full((2,), 7.0)}  # what the hook made of the spike
    sync.commit(6, sent=False)
    assert sync.residuals[named[0][1]].tolist() == [2.0, 2.0] and sync.held_at == 6


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown gradient compression"):
        GradSync("int8")
