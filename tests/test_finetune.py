"""Fine-tuning on a real local Ray, from a tiny model trained here: a LoRA run trains its adapters alone (its
checkpoints hold them and a reference to the base), recovers a killed worker and resumes bit for bit, and exports
merged weights that give its logits; a base that changed is refused before anything runs."""

from __future__ import annotations

import io
import math
import shutil
from pathlib import Path

import pytest
import torch

from etrain.cli import main
from etrain.control.control import JobError
from etrain.core import checkpoint
from etrain.core.checkpoint import checkpoint_uri, load_latest
from etrain.core.config import ConfigError
from etrain.core.finetune import build_model, finetune_config, load_trained_state
from etrain.core.models.gpt.model import GPT
from etrain.driver.job import new_run_dir, train

from helpers.runs import records, run

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 12
LORA = ["train.steps=12", "checkpoint.every=4", "finetune.lora.rank=4", "optim.lr=1e-2", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def base_run(make_cfg_module) -> Path:
    return run(make_cfg_module, "ft-base", "train.steps=24")


@pytest.fixture(scope="module")
def reference(base_run) -> Path:
    cfg = finetune_config(str(base_run), None, [*LORA, "run.name=lora"])
    run_dir = new_run_dir(cfg)
    train(cfg, run_dir, progress=False)
    return run_dir


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir, "train")]


def test_a_lora_run_starts_from_its_base_and_checkpoints_its_adapters_alone(base_run, reference):
    base_losses, lora = losses(base_run), losses(reference)
    assert len(lora) == STEPS and lora[0] < 0.8 * base_losses[0]  # the base's weights, not a fresh model's
    assert lora[-1] < lora[0]
    cfg = finetune_config(str(base_run), None, LORA)
    saved = load_latest(checkpoint_uri(cfg, reference))
    adapters = checkpoint.deserialize(saved.parts["model.pt"])
    assert adapters and all(n.endswith(("lora_a", "lora_b")) for n in adapters)
    base_bytes = len(load_latest(checkpoint_uri(cfg, base_run)).parts["model.pt"])
    assert len(saved.parts["model.pt"]) < 0.1 * base_bytes
    assert saved.meta["step"] == STEPS


def test_lora_under_zero1_is_lora_and_under_top_k_sends_less(base_run, reference):
    """The adapters are the only parameters: ZeRO-1 shards their state (the no-decay group is empty) and the
    losses are the unsharded run's; top-k compresses their gradients alone."""
    zero = finetune_config(str(base_run), None, [*LORA, "run.name=lora-zero", "comm.zero=true"])
    train(zero, zero_dir := new_run_dir(zero), progress=False)
    assert losses(zero_dir) == losses(reference)
    topk = [*LORA, "run.name=lora-topk", "comm.compression=topk", "comm.compress_start=2"]
    train(cfg := finetune_config(str(base_run), None, topk), topk_dir := new_run_dir(cfg), progress=False)
    last = records(topk_dir, "train")[-1]
    assert last["comm_bytes"] < 0.2 * last["dense_bytes"] and all(math.isfinite(x) for x in losses(topk_dir))
    adapters = sum(p.numel() for p in build_model(cfg).parameters() if p.requires_grad)
    assert last["dense_bytes"] == 4 * adapters * 2  # fp32 gradients of the adapters alone, from both workers


def test_a_lora_run_recovers_a_killed_worker_and_resumes_bitwise(base_run, reference):
    faults = "faults=[{rank: 1, step: 3, kind: kill}, {rank: 0, step: 10, kind: kill}]"
    cfg = finetune_config(str(base_run), None, [*LORA, "run.name=lora-faults", "cluster.max_recoveries=1", faults])
    run_dir = new_run_dir(cfg)
    with pytest.raises(JobError, match="max_recoveries"):
        train(cfg, run_dir, progress=False)
    assert len(records(run_dir, "membership")) >= 1 and max(r["step"] for r in records(run_dir, "train")) == 9
    assert main(["train", "--resume", str(run_dir), "--no-progress", "--set", "faults=[]"]) == 0
    assert losses(run_dir) == losses(reference)
    assert records(run_dir, "resume")[0]["step"] == 8


def test_export_merges_the_adapters_into_weights_that_give_the_runs_logits(base_run, reference, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["export", str(reference), "--merge", "--out", str(out)]) == 0
    exported = load_latest(str(out / "checkpoints"))
    merged = torch.load(io.BytesIO(exported.parts["model.pt"]), weights_only=True)
    cfg = finetune_config(str(base_run), None, LORA)
    plain = GPT(cfg.model).eval()
    plain.load_state_dict(merged)
    adapted = build_model(cfg).eval()
    load_trained_state(adapted, checkpoint.model_weights(load_latest(checkpoint_uri(cfg, reference)).parts))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain.logits(tokens), adapted.logits(tokens), rtol=0, atol=1e-5)
    base = checkpoint.model_weights(load_latest(checkpoint_uri(cfg, base_run)).parts)
    targets = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.proj.weight")
    assert all(torch.equal(merged[n], base[n]) == (not n.endswith(targets)) for n in base)
    # the export is a base in its turn, not a run to resume; the LoRA run itself is no base (adapters only)
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2  # refused before Ray starts (issue 27, defect 7)
    assert "is an export of" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="holds a LoRA run's adapters, not a whole model"):
        finetune_config(str(reference), None, [])
    again = finetune_config(str(out), None, [])
    assert again.finetune.base == str(out / "checkpoints" / Path(exported.path).name) and again.model == cfg.model


def test_a_resume_whose_base_changed_is_refused_before_anything_runs(base_run, tmp_path, capsys):
    moved = tmp_path / "base-copy"
    shutil.copytree(base_run, moved)
    cfg = finetune_config(str(moved), None, [*LORA, f"run.root={tmp_path}", "run.name=orphan"])
    run_dir = new_run_dir(cfg)
    step = Path(cfg.finetune.base)
    shutil.rmtree(step)
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 2
    assert f"finetune.base: {step}" in capsys.readouterr().err
    shutil.copytree(base_run / "checkpoints" / step.name, step)
    weights = checkpoint.model_weights(load_latest(str(moved / "checkpoints")).parts)
    weights["norm.bias"] = weights["norm.bias"] + 0.5  # another model now sits where the base was
    shutil.rmtree(step)
    checkpoint.save(str(step.parent), int(step.name.split("-")[1]), {"model.pt": weights}, {"cursor": 0}, keep=3)
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 2
    assert "is not the checkpoint this run was made from" in capsys.readouterr().err
