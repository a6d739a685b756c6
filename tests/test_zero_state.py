"""ZeRO-1 state saved by parts on a real two-rank gloo group: merged, it is the consolidated state,
and it loads into a plain AdamW or a fresh ZeRO that then step exactly as the original does. LAMB
under ZeRO-1 steps exactly as unsharded LAMB, and its parts resume a plain LAMB exactly.

The ranks run everything in one spawn (a process start costs seconds) and save what they saw;
the tests below judge it. An exception in a rank fails the spawn, and so the tests.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from etrain.core.config import load_config
from etrain.core.models.gpt.model import GPT
from etrain.core.optim import make_optimizer, make_param_groups, make_scheduler, optimizer_class, optimizer_defaults
from etrain.worker.zero_state import local_part, merge, param_groups

WORLD = 2
STEPS = 3  # before the state is saved; then one more
CFG = load_config("tiny")
LAMB = load_config("tiny", ["optim.name=lamb"]).optim


def make_model() -> nn.Module:
    torch.manual_seed(0)  # same weights on every rank and in the reference
    return GPT(CFG.model)


def set_grads(model: nn.Module, step: int) -> None:
    """The same gradient on every rank (ZeRO does not average them); the final norm's bias gets none,
    so it never has optimizer state: merge must accept a parameter without state."""
    for i, (name, p) in enumerate(model.named_parameters()):
        seeded = torch.Generator().manual_seed(100 * step + i)
        p.grad = None if name == "norm.bias" else torch.randn(p.shape, generator=seeded)


def make_zero(model: nn.Module) -> ZeroRedundancyOptimizer:
    """As etrain/worker/data_parallel.py builds it."""
    return ZeroRedundancyOptimizer(
        make_param_groups(model, CFG.optim),
        optimizer_class=torch.optim.AdamW,
        lr=CFG.optim.lr,
        betas=(CFG.optim.beta1, CFG.optim.beta2),
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def lamb(rank: int) -> dict:
    """LAMB sharded and not, on the same gradients; then the shards' parts merged into a plain LAMB, one step on."""
    models = {"zero": make_model(), "plain": make_model(), "resumed": make_model()}
    zero = ZeroRedundancyOptimizer(
        make_param_groups(models["zero"], LAMB), optimizer_class=optimizer_class(LAMB), **optimizer_defaults(LAMB)
    )
    plain = make_optimizer(models["plain"], LAMB)
    for step in range(STEPS):
        for name in ("zero", "plain"):
            set_grads(models[name], step)
        zero.step()
        plain.step()
    out = {"steps": {k: params_of(models[k]) for k in ("zero", "plain")}}
    parts = [None] * WORLD
    dist.all_gather_object(parts, local_part(zero))
    with torch.no_grad():
        for p, q in zip(models["resumed"].parameters(), models["zero"].parameters()):
            p.copy_(q)
    resumed = make_optimizer(models["resumed"], LAMB)
    resumed.load_state_dict(merge(parts, param_groups(zero)))
    for name in ("zero", "resumed"):
        set_grads(models[name], STEPS)
    zero.step()
    resumed.step()
    return out | {"one_more": {k: params_of(models[k]) for k in ("zero", "resumed")}}


def rank_main(rank: int, meet: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo", init_method=f"file://{meet}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    model = make_model()
    opt = make_zero(model)
    scheduler = make_scheduler(opt, CFG.optim, CFG.train.steps)  # lr in the param groups changes each step
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        scheduler.step()

    out = {"part": local_part(opt), "groups": param_groups(opt), "weights": params_of(model)}
    opt.consolidate_state_dict(to=0)
    if rank == 0:  # deep: on CPU the consolidated state shares rank 0's live tensors
        out["consolidated"] = copy.deepcopy(opt.state_dict())
    set_grads(model, STEPS)  # train on: the part must not change with it
    opt.step()
    out["after"] = params_of(model)
    torch.save(out, f"{out_dir}/{rank}.pt")

    dist.barrier()  # every part written: as a loader would, each rank merges them and keeps its shard
    parts = [torch.load(f"{out_dir}/{r}.pt")["part"] for r in range(WORLD)]
    fresh = make_model()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(out["weights"][name])
    resumed = make_zero(fresh)
    resumed.load_state_dict(merge(parts, out["groups"]))
    set_grads(fresh, STEPS)
    resumed.step()
    torch.save({**out, "resumed": params_of(fresh), "lamb": lamb(rank)}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero_state")
    mp.spawn(rank_main, args=(str(out / "meet"), str(out)), nprocs=WORLD)  # a file: no port to lose to a race
    return [torch.load(out / f"{rank}.pt") for rank in range(WORLD)]


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a["state"]) == list(b["state"])
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    assert a["param_groups"] == b["param_groups"]


def test_merged_parts_are_the_consolidated_state(ranks):
    parts = [r["part"] for r in ranks]
    assert all(p["state"] for p in parts)  # both ranks hold some of it
    merged = merge(parts, ranks[0]["groups"])
    assert ranks[1]["groups"] == ranks[0]["groups"]
    assert_same_state(merged, ranks[0]["consolidated"])  # taken before training on: the part is a copy
    frozen = [n for n, _ in make_model().named_parameters()].index("norm.bias")
    n_params = sum(len(g["params"]) for g in merged["param_groups"])
    assert sorted(merged["state"]) == [i for i in range(n_params) if i != frozen]  # plain order: matrices first
    assert merged["param_groups"][0]["lr"] != CFG.optim.lr  # the scheduler's lr, not the default


def test_merged_state_resumes_a_plain_optimizer_exactly(ranks):
    merged = merge([r["part"] for r in ranks], ranks[0]["groups"])
    model = make_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ranks[0]["weights"][name])
    plain = make_optimizer(model, CFG.optim)
    plain.load_state_dict(merged)
    assert_same_state(plain.state_dict(), merged)
    set_grads(model, STEPS)
    plain.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, ranks[0]["after"][name]), name


def test_merged_state_resumes_a_fresh_zero_exactly(ranks):
    for r in ranks:
        for name, p in r["resumed"].items():
            assert torch.equal(p, r["after"][name]), name


def test_merge_names_duplicate_and_missing_parameters():
    groups = [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.1, "params": [2]}]
    a = {"owned": [0, 2], "state": {0: {"step": torch.tensor(1.0)}}}
    b = {"owned": [1], "state": {}}  # owns a parameter that has no state yet: fine
    assert list(merge([a, b], groups)["state"]) == [0]
    with pytest.raises(ValueError, match=r"more than one part: \[0, 2\]"):
        merge([a, a, b], groups)
    with pytest.raises(ValueError, match=r"in no part .*: \[1\]"):
        merge([a], groups)
    with pytest.raises(ValueError, match=r"do not list: \[3\]"):
        merge([a, {"owned": [1, 3], "state": {}}], groups)
    with pytest.raises(ValueError, match=r"part 1 has state for parameters it does not own: \[0\]"):
        merge([a, {"owned": [1], "state": {0: {}}}], groups)


def test_lamb_under_zero1_steps_as_unsharded_lamb_and_its_parts_resume_it_exactly(ranks):
    """ZeRO-1 gives each rank whole tensors, so LAMB's per-tensor trust ratio is the unsharded one."""
    for r in ranks:
        steps, one_more = r["lamb"]["steps"], r["lamb"]["one_more"]
        assert any(not torch.equal(steps["zero"][n], make_model().state_dict()[n]) for n in steps["zero"])
        for name in steps["zero"]:
            assert torch.equal(steps["zero"][name], steps["plain"][name]), name
            assert torch.equal(one_more["zero"][name], one_more["resumed"][name]), name
