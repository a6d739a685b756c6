"""Tensor and pipeline parallelism (etrain/core/parallel.py) against one process: gloo ranks in processes on this
machine, the same model, seed and global batch; losses step by step, and the first step's gradients tensor by
tensor (TP's backward collectives, the pipeline's, the tied weights' and the replicas' all-reduce)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.distributed as dist

from etrain.cli import main
from etrain.core import hf, sharded_checkpoint
from etrain.core.config import ModelConfig, OptimConfig, ParallelConfig, load_config
from etrain.core.layout_state import full_state, load_full, whole
from etrain.core.local_ranks import local_group, rank_context
from etrain.core.models import make_model
from etrain.core.models.gpt.model import GPT
from etrain.core.models.shared import InitialWeights, inputs_and_targets
from etrain.core.optim import make_optimizer
from etrain.core.parallel import Replica, make_mesh, stage_layers

MODEL = ModelConfig(n_layer=4, n_head=4, d_model=32, seq_len=16, vocab_size=64)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0, grad_clip=0.5)
STEPS, BATCH = 20, 8


def batches(masked: bool = False) -> list[torch.Tensor]:
    """Random rows; `masked`: as chat data stores them, about half the positions context (-t - 1: no loss), some
    rows context alone."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len + 1), generator=g) for _ in range(STEPS)]
    if not masked:
        return rows
    context = [torch.rand(r.shape, generator=g) < 0.5 for r in rows]
    for c in context:
        c[torch.randint(0, BATCH, (2,), generator=g)] = True
    return [torch.where(c, -r - 1, r) for r, c in zip(rows, context)]


@pytest.fixture(scope="module")
def single() -> tuple[list[float], dict]:
    return single_process(MODEL)


def single_process(model_cfg: ModelConfig, masked: bool = False) -> tuple[list[float], dict]:
    """The whole model in this process: its per-step losses and its first step's clipped gradients."""
    torch.manual_seed(0)
    model = make_model(model_cfg)
    optimizer = make_optimizer(model, OPTIM)
    losses, first = [], {}
    for rows in batches(masked):
        optimizer.zero_grad()
        _, loss = model(*inputs_and_targets(rows))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        first = first or {n: whole(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, first


def train_rank(
    rank: int,
    world: int,
    layout: dict,
    steps: range = range(STEPS),
    state: dict | str | None = None,
    save: bool | str = False,
    model_cfg: ModelConfig = MODEL,
    masked: bool = False,
) -> tuple[list[float], dict, dict | None]:
    """Per-step losses, the first step's clipped gradients (whole tensors) and, with `save`, the whole state after
    the last step (on the replica's first rank), or with a directory every rank's tensors saved there with DCP, as
    a laid-out run saves them; `state` is such a whole state or directory. No rank holds the whole model: its part
    starts on the meta device."""
    cfg = ParallelConfig(**layout)
    with torch.device("meta"):  # as a worker does: the structure only, then its part made and given its values
        model = make_model(model_cfg)
    replica = Replica(model, make_mesh(world, cfg, "cpu"), cfg, torch.device("cpu"))
    replica.model.materialize(torch.device("cpu"))
    optimizer = make_optimizer(replica.model, OPTIM)
    load_full(
        replica, optimizer, state if isinstance(state, dict) else {"model": InitialWeights(model_cfg, 0), "optim": {}}
    )
    if isinstance(state, str):
        sharded_checkpoint.load(replica.model, optimizer, state, replica.tied)
    mine, replicas = cfg.place(rank).replica, cfg.replicas(world)
    losses, first, every = [], {}, batches(masked)
    for i in steps:
        rows = every[i].chunk(replicas)[mine]
        optimizer.zero_grad()
        losses.append(replica.forward_backward(*inputs_and_targets(rows)))
        replica.sync_and_clip(OPTIM.grad_clip)
        first = first or {n: whole(p.grad) for n, p in replica.model.named_parameters()}
        optimizer.step()
    if save:  # as a run's end does: an evaluation, then the final checkpoint
        replica.evaluate(every[0][:, :-1], every[0][:, 1:], BATCH)
    if isinstance(save, str):
        state = sharded_checkpoint.state_dict(replica.model, optimizer, replica.tied)
        sharded_checkpoint.save(state, save, dist.group.WORLD).result()
        return losses, first, None
    return losses, first, full_state(replica, optimizer) if save else None


@pytest.mark.parametrize(
    "replicas, layout",
    [
        (1, dict(tp=2)),
        (1, dict(pp=2, microbatches=4)),
        (1, dict(pp=2, microbatches=4, schedule="gpipe")),
        (1, dict(tp=2, pp=2, microbatches=2)),
        (2, dict(tp=2)),
        (1, dict(shard=2)),
        (1, dict(tp=2, shard=2)),
        (2, dict(shard=2)),
    ],
    ids=["tp2", "pp2-1f1b", "pp2-gpipe", "tp2xpp2", "2-replicas-of-tp2", "shard2", "tp2xshard2", "2-replicas-shard2"],
)
def test_a_layout_follows_the_single_process_losses_and_gradients(single, replicas, layout):
    expected_losses, expected_grads = single
    results = local_group(replicas * ParallelConfig(**layout).ranks, train_rank, layout)
    held = set()
    for rank, (losses, grads, _) in results.items():
        assert losses == pytest.approx(expected_losses, rel=1e-4), f"rank {rank}"
        for name, grad in grads.items():
            twin = "embed.weight" if name == "head.weight" else name  # the last stage's copy of the tied weight
            torch.testing.assert_close(grad, expected_grads[twin], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")
            held.add(twin)
    assert held == set(expected_grads)  # every tensor of the model is held by some rank


MASKED_LAYOUTS = {
    "tp2": (1, dict(tp=2)),
    "pp2-1f1b": (1, dict(pp=2, microbatches=4)),
    "tp2xpp2": (1, dict(tp=2, pp=2, microbatches=2)),
    "2-replicas-shard2": (2, dict(shard=2)),
    "tp2xshard2": (1, dict(tp=2, shard=2)),
}


def test_chat_rows_train_the_answers_alone_alike_in_a_drawn_layout(rng):
    """Chat data's loss (the answers alone, each row's mean) goes through a layout's forward, pipeline schedule and
    sharded batch: the same losses and first gradients as one process, which differ from training on every token."""
    drawn = rng.choice(sorted(MASKED_LAYOUTS))
    print("masked rows in", drawn)
    replicas, layout = MASKED_LAYOUTS[drawn]
    expected_losses, expected_grads = single_process(MODEL, masked=True)
    assert expected_losses != pytest.approx(single_process(MODEL)[0], rel=1e-3)
    results = local_group(
        replicas * ParallelConfig(**layout).ranks, train_rank, layout, range(STEPS), None, False, MODEL, True
    )
    for rank, (losses, grads, _) in results.items():
        assert losses == pytest.approx(expected_losses, rel=1e-4), f"rank {rank}"
        for name, grad in grads.items():
            twin = "embed.weight" if name == "head.weight" else name
            torch.testing.assert_close(grad, expected_grads[twin], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")


LLAMA = ModelConfig(family="llama", n_layer=4, n_head=4, n_kv_head=2, d_model=32, seq_len=16, vocab_size=64)
LLAMA_LAYOUTS = {"pp2": dict(pp=2, microbatches=4), "shard2": dict(shard=2), "tp2xshard2": dict(tp=2, shard=2)}


def train_from_directory(rank: int, world: int, layout: dict, directory: str) -> tuple[list[float], dict, int]:
    """train_rank from the initial weights written as a Hugging Face directory; the bytes of tensors this rank read."""
    weights = hf.Weights(directory)
    losses, grads, _ = train_rank(rank, world, layout, range(STEPS), {"model": weights, "optim": {}}, False, LLAMA)
    return losses, grads, weights.read_bytes()


def test_the_llama_family_follows_the_single_process_at_tp2_and_a_drawn_layout(rng, tmp_path):
    """Llama's own tensor-parallel plan (q, k, v, gate, up by column; o, down by row; two key/value heads, one per
    rank), then a layout drawn from a printed seed: the same losses and first gradients as one process. The ranks
    start from the initial weights written as a Hugging Face directory, each reading what it holds: rows of a
    tensor cut on dim 0 alone, so no rank reads the whole model."""
    expected_losses, expected_grads = single_process(LLAMA)
    with torch.device("meta"):
        names = list(make_model(LLAMA).state_dict())
    initial = InitialWeights(LLAMA, 0)
    hf.write({n: initial[n] for n in names}, LLAMA, tmp_path)
    whole_bytes = json.loads((tmp_path / hf.INDEX).read_text())["metadata"]["total_size"]
    drawn = rng.choice(sorted(LLAMA_LAYOUTS))
    print("llama in tp2 and", drawn)
    for layout in (dict(tp=2), LLAMA_LAYOUTS[drawn]):
        results = local_group(ParallelConfig(**layout).ranks, train_from_directory, layout, str(tmp_path))
        for rank, (losses, grads, read) in results.items():
            if not ("tp" in layout and "shard" in layout):  # a tensor cut on two mesh dimensions: read whole, cut
                assert read < whole_bytes * 0.8, f"{layout} rank {rank} read {read} of {whole_bytes} bytes"
            assert losses == pytest.approx(expected_losses, rel=1e-4), f"{layout} rank {rank}"
            for name, grad in grads.items():
                twin = "embed.weight" if name == "head.weight" else name
                torch.testing.assert_close(grad, expected_grads[twin], rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")


TP2_PP2 = dict(tp=2, pp=2, microbatches=2)
TP2_SHARD2 = dict(tp=2, shard=2)


@pytest.mark.parametrize(
    "saved_by, resumed_by",
    [(TP2_PP2, {}), ({}, TP2_PP2), (TP2_SHARD2, dict(shard=2)), (dict(shard=2), TP2_PP2), (dict(shard=2), {})],
    ids=["tp2xpp2-to-1", "1-to-tp2xpp2", "tp2xshard2-to-shard2", "shard2-to-tp2xpp2", "shard2-to-1"],
)
def test_a_state_saved_by_one_layout_resumes_in_another_on_the_same_trajectory(single, saved_by, resumed_by, tmp_path):
    """Weights and AdamW moments by whole-model name: halfway through, the state moves to the other layout, and
    the second half's losses are the single process's. A layout saves each rank's tensors with DCP, which the other
    layout reads resharded, as the trainer does (a pipeline's tied head written once); one process, the whole
    state, as a data-parallel run does. An evaluation comes just before the save, as at a run's end (FSDP's root
    once kept its gathered parameters after a forward alone, and their moments were left out of the save)."""
    half = STEPS // 2
    sharded = ParallelConfig(**saved_by).ranks > 1
    save = str(tmp_path / "dcp") if sharded else True
    saved = local_group(ParallelConfig(**saved_by).ranks, train_rank, saved_by, range(half), None, save)
    state = save if sharded else saved[0][2]
    names = {n for n, _ in GPT(MODEL).named_parameters()}
    whole_state = sharded_checkpoint.whole_state(state) if sharded else state
    assert set(whole_state["model"]) == set(GPT(MODEL).state_dict())
    optim = whole_state["optim"] if sharded else {n for n, st in whole_state["optim"].items() if st}
    assert set(optim) == names  # every parameter's moments, an evaluation just before the save or not
    resumed = local_group(ParallelConfig(**resumed_by).ranks, train_rank, resumed_by, range(half, STEPS), state)
    for rank, (losses, _, _) in resumed.items():
        assert losses == pytest.approx(single[0][half:], rel=1e-4), f"rank {rank}"


def test_stages_split_the_blocks_evenly_middle_stages_first():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 3) == [range(0, 1), range(1, 3), range(3, 4)]  # the ends also hold embedding and head
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3"], "parallel.tp=3 must divide model.n_head=4"),
        (["parallel.pp=3", "model.n_layer=2"], "parallel.pp=3 exceeds model.n_layer=2"),
        (["parallel.pp=2", "parallel.microbatches=1"], "parallel.microbatches=1 is below parallel.pp=2"),
        (["parallel.tp=2", "cluster.num_workers=3"], "cluster.num_workers=3 is not a whole number of replicas"),
        (["parallel.pp=2", "train.global_batch=30"], "train.global_batch=30 must split into 1 replica"),
        (["parallel.tp=2", "comm.mode=ps"], "comm.mode=ps with parallel.tp × parallel.pp × parallel.shard > 1 is not"),
        (["parallel.tp=2", "comm.compression=topk"], "comm.compression=topk with parallel"),
        (["parallel.pp=2", "parallel.shard=2"], "parallel.pp=2 with parallel.shard=2 is not supported yet"),
        (["parallel.shard=2", "comm.zero=true"], "comm.zero with parallel.tp × parallel.pp × parallel.shard > 1"),
        (["parallel.shard=2", "cluster.num_workers=3"], "parallel.tp × parallel.pp × parallel.shard = 2 ranks"),
        (["parallel.shard=4", "cluster.num_workers=4", "train.global_batch=6"], "a multiple of 4"),
        (["parallel.shard=2", "checkpoint.light_every=5"], "checkpoint.light_every=5 with parallel.tp × parallel.pp"),
        (["parallel.pp=2", "checkpoint.light_every=3"], "× parallel.shard = 2 is not supported: a laid-out run's"),
    ],
)
def test_a_layout_the_model_or_batch_cannot_take_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config("tiny", overrides)


def test_etrain_train_refuses_a_layout_the_model_cannot_take_before_making_a_run_directory(capsys, tmp_path):
    """The refusal the library's config gives reaches `etrain train` as a usage error: exit 2, the key named."""
    assert main(["train", "--config", "tiny", "--set", "parallel.tp=3", "--set", f"run.root={tmp_path}"]) == 2
    assert "parallel.tp=3 must divide model.n_head=4" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _generations(plan: list[tuple[int, int, int, str]], out) -> None:
    """One process through several groups in turn, as a warm worker goes: (generation, rank, world, rendezvous
    file) each; each group's step (loss, grad norm) put on `out`, or the traceback."""
    import traceback

    torch.set_num_threads(1)
    cfg = ParallelConfig(tp=2)
    rows = batches()[0]
    for generation, rank, world, meet in plan:
        try:  # a file to meet at, not a port chosen ahead: nothing else on the machine can take it meanwhile
            dist.init_process_group("gloo", init_method=f"file://{meet}", rank=rank, world_size=world)
        except Exception:
            out.put((generation, rank, traceback.format_exc()))
            return
        try:
            torch.manual_seed(0)
            replica = Replica(GPT(MODEL), make_mesh(world, cfg, "cpu"), cfg, torch.device("cpu"))
            mine = rows.chunk(cfg.replicas(world))[cfg.place(rank).replica]
            loss = replica.forward_backward(mine[:, :-1], mine[:, 1:])
            out.put((generation, rank, (loss, replica.sync_and_clip(math.inf))))
        except Exception:
            out.put((generation, rank, traceback.format_exc()))
            return
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("lost_replica", [0, 1])
def test_survivors_renumbered_into_a_new_mesh_reach_its_groups_not_a_stale_one(lost_replica, tmp_path):
    """Two replicas of tp=2; one replica is lost, the other goes on alone as ranks 0 and 1, then a new replica
    joins as ranks 2 and 3. Issue 27's defect 1: when replica 0 was lost, the survivors (ranks 2 and 3 before)
    failed in the third group with "Could not resolve the process group registered under the name 8": DTensor's
    sharding cache handed back the first group's mesh, whose groups were gone. Every group's step must equal one
    whole-model process's on the same batch, on every rank."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    rows = batches()[0]
    _, want_loss = model(rows[:, :-1], rows[:, 1:])
    want_loss.backward()
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item()

    ctx = rank_context()
    out = ctx.Queue()
    meet = [str(tmp_path / f"generation-{g}") for g in range(3)]
    survivors = [r for r in range(4) if r // 2 != lost_replica]
    plans = {old: [(0, old, 4, meet[0])] for old in range(4)}
    for new, old in enumerate(survivors):
        plans[old] += [(1, new, 2, meet[1]), (2, new, 4, meet[2])]
    plans |= {f"joiner{r}": [(2, r, 4, meet[2])] for r in (2, 3)}
    procs = [ctx.Process(target=_generations, args=(plan, out), daemon=True) for plan in plans.values()]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in range(4 + 2 + 4)]
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    failed = [r for r in results if isinstance(r[2], str)]
    assert not failed, failed[0][2]
    assert sorted((g, r) for g, r, _ in results) == [(0, r) for r in range(4)] + [(1, 0), (1, 1)] + [
        (2, r) for r in range(4)
    ]
    for generation, rank, (loss, norm) in results:
        assert loss == pytest.approx(want_loss.item(), rel=1e-5), (generation, rank)
        assert norm == pytest.approx(want_norm, rel=1e-4), (generation, rank)
