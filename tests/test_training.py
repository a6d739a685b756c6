"""Training on a real local Ray instance: gradient equality, learning, exact resume, failure."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from etrain.core import checkpoint
from etrain.core.models.gpt.model import GPT
from etrain.core.records import START_PHASES, read_jsonl
from etrain.data import order
from etrain.data.cache import ShardCache
from etrain.data.embedded import ensure_corpus
from etrain.data.shards import ShardReader, read_manifest
from etrain.driver.job import new_run_dir, train
from etrain.worker import spawn

pytestmark = pytest.mark.usefixtures("ray_session")


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def form_group(workers: list, cfg, manifest: str, cache_dir: Path) -> None:
    sizes = tuple(s["samples"] for s in read_manifest(manifest)["splits"]["train"]["shards"])
    layout = order.Layout(cfg.train.seed, sizes, cfg.data.shuffle_shards)
    cache = ray.remote(ShardCache).options(num_cpus=0, max_concurrency=8).remote(manifest, layout, 3, str(cache_dir))
    ray.get([w.attach_cache.remote(cache, layout) for w in workers])
    host, port = ray.get(workers[0].host_store.remote())
    ray.get([w.join.remote(r, len(workers), host, port, 1) for r, w in enumerate(workers)])


@pytest.mark.parametrize("weights", [[1.0, 1.0], [1.0, 3.0]])
def test_two_workers_gradient_equals_single_process(make_cfg, weights, tmp_path):
    cfg = make_cfg("optim.grad_clip=0", "train.global_batch=12", "train.micro_batch=4")
    manifest = ensure_corpus(cfg)
    ids = np.random.default_rng(0).choice(len(ShardReader(manifest, "train")), 12, replace=False)
    workers = spawn(cfg, manifest, 2)
    try:
        form_group(workers, cfg, manifest, tmp_path)
        shares = order.split(ids, weights)
        ray.get([w.step.remote(0, {"ids": s, "global_batch": 12, "cursor": 0}) for w, s in zip(workers, shares)])
        grads = ray.get([w.flat_grad.remote() for w in workers])
    finally:
        for w in workers:
            ray.kill(w)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    rows = torch.from_numpy(ShardReader(manifest, "train").get(ids).astype(np.int64))
    _, loss = model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grads[0], grads[1]), "ranks must hold the same synchronised gradient"
    assert (grads[0] - reference).abs().max().item() < 1e-5
    assert reference.abs().max().item() > 1e-3  # the comparison is not between zeros


@ray.remote(num_cpus=0)
class HandleHolder:
    """A process that is handed worker handles, as the coordinator is."""

    def __init__(self, workers: list):
        import sys

        self.workers, self.torch = workers, "torch" in sys.modules

    def ask(self) -> tuple[bool, list[int]]:
        import sys

        pids = ray.get([w.info.remote() for w in self.workers])
        return self.torch or "torch" in sys.modules, [p["pid"] for p in pids]


def test_a_process_handed_worker_handles_calls_them_without_importing_torch(make_cfg):
    """Ray loads an actor's class wherever a handle to it arrives: the worker's module imported torch there, ~2 s
    of the coordinator's start and 180 MB it never used."""
    cfg = make_cfg()
    workers = spawn(cfg, ensure_corpus(cfg), 1)
    holder = HandleHolder.remote(workers)
    try:
        imported, pids = ray.get(holder.ask.remote())
        assert not imported and pids[0] > 0
    finally:
        ray.kill(holder)
        for w in workers:
            ray.kill(w)


def test_loss_drops_and_run_dir_is_complete(make_cfg):
    cfg = make_cfg("train.steps=60", "train.eval_every=30", "checkpoint.every=30")
    run_dir = new_run_dir(cfg)
    summary = train(cfg, run_dir, progress=False)
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    assert summary["final_eval_loss"] < 0.7 * summary["first_loss"]
    for key in ("steps", "samples", "tokens", "tokens_per_s", "wall_s", "world_size", "config_hash"):
        assert summary[key], key
    assert (summary["steps"], summary["samples"], summary["world_size"]) == (60, 60 * 16, 2)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 61))
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "world_size"} <= set(records[0])
    assert (run_dir / "config.yaml").read_text() == cfg.to_yaml()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "cursor.json",
        "step-00000030",
        "step-00000060",
    ]
    assert checkpoint.read_cursor(str(run_dir / "checkpoints"))["step"] == 60


def test_resume_on_another_world_size_stays_on_the_trajectory(make_cfg):
    """A world-size change alters float reduction order only: losses agree closely, not bitwise."""
    steps = ["train.steps=10", "checkpoint.every=5", "train.eval_every=0"]
    ref_dir = new_run_dir(make_cfg(*steps, "run.name=two"))
    train(make_cfg(*steps, "run.name=two"), ref_dir, progress=False)
    cfg = make_cfg(*steps, "run.name=mixed")
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000010")  # as if it had stopped after step 5
    summary = train(make_cfg(*steps, "run.name=mixed", "cluster.num_workers=1"), run_dir, resume=True, progress=False)
    assert summary["world_size"] == 1
    a, b = losses(ref_dir), losses(run_dir)
    assert sorted(b) == list(range(1, 11))
    assert max(abs(a[s] - b[s]) for s in a) < 1e-4


def test_bf16_autocast_trains(make_cfg):
    cfg = make_cfg("train.precision=bf16", "train.steps=6", "cluster.num_workers=1")
    summary = train(cfg, new_run_dir(cfg), progress=False)
    assert np.isfinite(summary["final_loss"]) and summary["final_loss"] < summary["first_loss"]
    assert abs(summary["first_loss"] - np.log(256)) < 0.5  # bf16 keeps the untrained model near uniform


def test_exact_resume_with_checkpoints_on_s3(make_cfg, s3_bucket):
    """Bitwise, as train.deterministic promises (an equal split). It failed once in a run of this file (stop 53; the
    assertion's text was not kept) without it: the speed-based split is the one input here that depends on timing
    (a straggler in the reference's first steps changes its split, not the resume's)."""
    steps = ["train.steps=6", "checkpoint.every=3", "train.eval_every=0", f"checkpoint.uri={s3_bucket}/ck"]
    steps.append("train.deterministic=true")
    cfg = make_cfg(*steps)
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    reference = losses(run_dir)
    import fsspec

    fs, _ = fsspec.core.url_to_fs(s3_bucket)
    fs.rm(f"{s3_bucket}/ck/step-00000006", recursive=True)  # as if it had stopped after step 3
    train(cfg, run_dir, resume=True, progress=False)
    assert losses(run_dir) == reference
    events = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "resume"]
    assert events[-1]["step"] == 3 and events[-1]["path"].endswith("step-00000003")


def test_cli_trains_then_resumes_for_longer(make_cfg, tmp_path, capsys):
    from etrain.cli import main

    base = [
        "--set",
        f"data.cache_dir={make_cfg().data.cache_dir}",
        "--set",
        "data.corpus_bytes=1500000",
        "--set",
        "data.shard_bytes=200000",
        "--set",
        f"run.root={tmp_path}",
        "--set",
        "run.name=cli",
    ]
    assert main(["train", "-c", "tiny", *base, "--set", "train.steps=4", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert '"steps": 4' in out.out and str(tmp_path / "cli" / "summary.json") in out.err
    assert main(["train", "--resume", str(tmp_path / "cli"), "--set", "train.steps=6", "--no-progress"]) == 0
    assert sorted(losses(tmp_path / "cli")) == list(range(1, 7))
    assert "steps: 6" in (tmp_path / "cli" / "config.yaml").read_text()
    # each start, from the CLI to its first step, by phase: the first run's, then the resume's (with its load)
    starts = [r for r in read_jsonl(tmp_path / "cli" / "metrics.jsonl") if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, 4]  # filed under the step each started from
    for start in starts:
        assert list(start["phases"]) == list(START_PHASES) and min(start["phases"].values()) >= 0
        assert sum(start["phases"].values()) == pytest.approx(start["total_s"])
        assert start["phases"]["workers"] > 0 and start["phases"]["first_step"] > 0
    assert starts[1]["phases"]["load"] > 0
