"""A sharded run's checkpoints (etrain/core/sharded_checkpoint.py): each rank's shards written with torch DCP in the
background, under the checkpoint's commit; a failed write, a tampered file and a hostile metadata file."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from etrain.core import checkpoint, sharded_checkpoint
from etrain.core.config import ConfigError, load_config, override
from etrain.core.finetune import check_base, model_only
from etrain.core.models.gpt.model import GPT
from etrain.core.sharded_checkpoint import SavedWeights, read_metadata, state_dict, whole_state, written

from helpers import hostile
from helpers.runs import records, run


@pytest.mark.usefixtures("ray_session")
def test_a_failed_shard_write_is_recorded_and_a_tampered_shard_is_named_on_load(make_cfg, s3_bucket, s3_faults):
    """shard=2 on S3, a save every 2 steps: storage refuses rank 1's shard of step 4 mid-save. That save is recorded
    as failed and never committed, training goes on, the later saves commit each rank's files. Then a byte of a
    committed shard changes: loading that checkpoint names the file, and the newest good one is taken instead."""
    s3_faults.fail("PUT", r"step-00000004/dcp/__1_0\.distcp")
    uri = f"{s3_bucket}/ck"
    run_dir = run(
        make_cfg,
        "dcp-failed",
        "cluster.num_workers=2",
        "parallel.shard=2",
        "train.steps=8",
        "checkpoint.every=2",
        "checkpoint.keep=4",
        f"checkpoint.uri={uri}",
    )
    assert [f["step"] for f in records(run_dir, "checkpoint_failed")] == [4]
    assert [c["step"] for c in records(run_dir, "checkpoint")] == [0, 2, 6, 8]  # 0: a layout's start
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 9))
    newest = checkpoint.load_latest(uri)
    assert newest.meta["step"] == 8
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "extra.pt"} == set(newest.meta["files"])
    assert set(newest.parts) == {"extra.pt", checkpoint.DCP}  # shards verified, not read by the coordinator

    fs, root = fsspec.core.url_to_fs(newest.path)
    shard = f"{root}/dcp/__1_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"dcp/__1_0\.distcp does not match its sha256"):
        checkpoint.load_at(newest.path)
    assert checkpoint.load_latest(uri).meta["step"] == 6


MARK = "MARKER"  # the crafted pickles' command touches this file; each case names its own in tmp_path


def dcp_run(tmp_path, step: int = 6):
    """A run directory as a laid-out run leaves it: config.yaml, and a committed checkpoint of DCP files (the tiny
    GPT's weights and AdamW state) with extra.pt. Its step directory."""
    cfg = load_config("tiny", [f"run.root={tmp_path}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9)))[1].backward()
    optimizer.step()
    path = checkpoint.prepare(str(run_dir / "checkpoints"), step)
    torch_dcp.save(state_dict(model, optimizer), checkpoint_id=f"{path}/dcp", no_dist=True)
    files = written(f"{path}/dcp", 0) | {"extra.pt": checkpoint.write_part(path, "extra.pt", {"scheduler": {}})}
    meta = {"level": "full", "step": step, "cursor": 0, "config_hash": cfg.hash(), "config": cfg.model_dump()}
    checkpoint.commit(path, meta, files)
    return run_dir, path.removeprefix("file://")


def replace_file(step_dir: str, name: str, body: bytes) -> None:
    """What someone who can write the checkpoint does: a file replaced, its sha256 in commit.json to match."""
    (Path(step_dir) / name).write_bytes(body)
    commit = json.loads((Path(step_dir) / checkpoint.COMMIT).read_text())
    commit["files"][name] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (Path(step_dir) / checkpoint.COMMIT).write_text(json.dumps(commit))


def one_line_naming(error: BaseException, file: str) -> str:
    text = str(error)
    assert "\n" not in text and file in text, text
    return text


@pytest.mark.parametrize("case", sorted(hostile.crafted(MARK)))
def test_a_crafted_metadata_pickle_runs_nothing_and_is_refused_in_one_line_naming_the_file(tmp_path, case):
    """Issue 41, defect 1: the `.metadata` unpickler allowed by module, and a dotted name through an allowed module
    reached os.system. Each crafted pickle runs its command in a plain pickle.loads (so it is hostile); our reader
    builds exact classes only, and refuses each with one line naming the file, running nothing."""
    marker = tmp_path / "ran"
    body = hostile.crafted(str(marker))[case]
    with contextlib.suppress(Exception):
        pickle.loads(body)
    assert marker.exists(), f"{case}: not hostile after all"
    marker.unlink()
    with pytest.raises(checkpoint.CheckpointError) as refused:
        read_metadata("dcp/.metadata", io.BytesIO(body))
    one_line_naming(refused.value, "dcp/.metadata")
    assert not marker.exists()


@pytest.mark.parametrize("case", sorted(hostile.refused_only("/etc/passwd")))
def test_a_metadata_of_dcps_own_classes_that_no_save_writes_is_refused(case):
    """Built of the very classes DCP writes, but not a save of tensors in this directory: a read pointed at another
    file or at one the commit does not list, a transform, an entry of pickled bytes (DCP would torch.load it with
    weights_only=False), a tensor larger than its stored bytes (a reader would allocate it), a size of another type,
    and malformed pickles."""
    with pytest.raises(checkpoint.CheckpointError) as refused:
        read_metadata("dcp/.metadata", io.BytesIO(hostile.refused_only("/etc/passwd")[case]), {"__0_0.distcp"})
    one_line_naming(refused.value, "dcp/.metadata")


def test_a_hostile_metadata_rehashed_into_the_commit_is_refused_by_every_reader(tmp_path, capsys):
    """The attack end to end: the crafted `.metadata` written into a committed checkpoint, commit.json re-hashed to
    match. Finding the newest checkpoint names it and its cause (a resume's path), and `etrain generate` and
    `etrain export` stop with exit 2 in one line; nothing runs."""
    from etrain.cli import main

    run_dir, step_dir = dcp_run(tmp_path)
    marker = tmp_path / "ran"
    replace_file(step_dir, "dcp/.metadata", hostile.crafted(str(marker))["dotted name through an allowed module"])
    with pytest.raises(checkpoint.CheckpointsCorrupt) as refused:
        checkpoint.load_latest(str(run_dir / "checkpoints"))
    assert "step-00000006" in str(refused.value) and "dcp/.metadata" in refused.value.skipped[0]["error"]
    assert "os.system" in refused.value.skipped[0]["error"]
    assert main(["generate", step_dir, "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert main(["generate", str(run_dir), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("dcp/.metadata") == 3 and "Traceback" not in err
    with pytest.raises(checkpoint.CheckpointError, match=r"dcp/\.metadata"):
        whole_state(f"{step_dir}/dcp")  # a reader handed the directory without its commit refuses it too
    assert not marker.exists()


def test_a_crafted_tensor_file_is_refused_by_weights_only(tmp_path):
    """DCP reads each tensor of a `.distcp` with torch.load(weights_only=True): a torch file whose pickle calls
    os.system, appended to a shard and pointed at by the metadata (in DCP's own classes), is refused, naming the
    checkpoint, and runs nothing."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    _, step_dir = dcp_run(tmp_path)
    marker = tmp_path / "ran"
    data = hostile.in_torch_file(hostile.crafted(str(marker))["os.system"])
    shard, index = Path(step_dir) / "dcp" / "__0_0.distcp", Path(step_dir) / "dcp" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    sizes = {k: m.size.numel() for k, m in metadata.state_dict_metadata.items()}
    smallest = min(metadata.storage_data, key=lambda index: sizes[index.fqn])  # a step count: its bytes hold it
    metadata.storage_data[smallest] = _StorageInfo("__0_0.distcp", shard.stat().st_size, len(data))
    shard.write_bytes(shard.read_bytes() + data)
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(checkpoint.CheckpointError) as refused:
        whole_state(f"{step_dir}/dcp")
    assert "what weights_only refuses" in one_line_naming(refused.value, f"{step_dir}/dcp")
    assert not marker.exists()


def test_a_base_in_dcp_files_is_checked_one_tensor_at_a_time(tmp_path):
    """The driver's check of a base a layout wrote (finetune.check_base) reads it tensor by tensor: the digest is the
    whole weights' (a PPO value head left out), a changed base and another model shape are refused by name."""
    cfg = load_config("tiny", [])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    model.add_value_head()
    path = checkpoint.prepare(str(tmp_path / "ckpts"), 6)
    torch_dcp.save({"model": model.state_dict()}, checkpoint_id=f"{path}/dcp", no_dist=True)
    checkpoint.commit(path, {"level": "full", "step": 6}, written(f"{path}/dcp", 0) | written(f"{path}/dcp", 1))
    whole = model_only(model.state_dict())
    lazy = SavedWeights(f"{path}/dcp", keep=lambda name: not name.startswith("value_head."))
    assert sorted(lazy) == sorted(whole) and lazy.shapes() == {n: t.shape for n, t in whole.items()}
    assert torch.equal(lazy["blocks.1.mlp.0.weight"], whole["blocks.1.mlp.0.weight"])
    digest = checkpoint.weights_digest(whole)
    assert checkpoint.weights_digest(lazy) == digest

    tuned = override(cfg, {"finetune.base": path, "finetune.base_digest": digest, "finetune.method": "full"})
    check_base(tuned)  # the base it was made from, and its shape
    with pytest.raises(ConfigError, match="not the checkpoint this run was made from"):
        check_base(override(tuned, {"finetune.base_digest": "0" * 64}))
    with pytest.raises(ConfigError, match=r"another model shape .*: \(128, 128\) here, \(96, 96\) in the run's model"):
        check_base(override(tuned, {"model.d_model": 96}))


def test_a_checkpoint_from_before_the_first_step_loads_into_a_trained_optimizer(tmp_path):
    """A layout's run writes a checkpoint at its start, before AdamW has any state. A rollback to it, from workers
    whose optimizer has stepped, asked for moments it does not hold (`Missing key in checkpoint state_dict:
    optim.embed.weight.step`; found by the fault campaign): it now restores the weights and a fresh optimizer."""
    cfg = load_config("tiny", [])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    start = {n: t.clone() for n, t in model.state_dict().items()}
    torch_dcp.save(state_dict(model, optimizer), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9)))[1].backward()
    optimizer.step()
    assert optimizer.state and not torch.equal(model.state_dict()["embed.weight"], start["embed.weight"])
    sharded_checkpoint.load(model, optimizer, str(tmp_path / "dcp"))
    assert not optimizer.state
    assert all(torch.equal(t, start[n]) for n, t in model.state_dict().items())


def test_an_entry_of_pickled_bytes_is_refused_by_the_planner_even_past_the_metadata_check(tmp_path):
    """DCP loads an entry of bytes with torch.load(weights_only=False). read_metadata admits no such entry; behind
    it, every load's planner refuses one too: here a metadata read by DCP's own reader (no check at all) points
    `model.w` at a crafted pickle, and nothing runs."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    marker = tmp_path / "ran"
    torch_dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    payload = hostile.crafted(str(marker))["os.system"]
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(payload)
    index = MetadataIndex("model.w")
    crafted = Metadata(
        {"model.w": BytesStorageMetadata()}, storage_data={index: _StorageInfo("__0_0.distcp", 0, len(payload))}
    )
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(crafted))
    with pytest.raises(checkpoint.CheckpointError, match="holds model.w as pickled bytes, which etrain never writes"):
        sharded_checkpoint._load({"model": {"w": torch.zeros(4)}}, FileSystemReader(str(tmp_path / "dcp")))
    assert not marker.exists()


def test_a_checkpoint_missing_some_optimizer_state_is_refused_naming_the_parameters(tmp_path):
    """A save that left some parameters' moments out (as the final save after an evaluation did, before FSDP's
    root was resharded) is refused by a load, naming them, before any state is touched: starting those moments
    afresh would leave the run's trajectory without a word."""
    cfg = load_config("tiny", [])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9)))[1].backward()
    optimizer.step()
    state = state_dict(model, optimizer)
    for name in ("embed.weight", "norm.weight", "norm.bias"):
        del state["optim"][name]
    torch_dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fresh = torch.optim.AdamW(model.parameters())
    with pytest.raises(checkpoint.CheckpointError, match=r"holds no optimizer state for embed\.weight, norm\.bias"):
        sharded_checkpoint.load(model, fresh, str(tmp_path / "dcp"))
    assert not fresh.state  # refused before any moment was made
    names = {n for n, _ in model.named_parameters()}
    with pytest.raises(checkpoint.CheckpointError, match="norm.weight"):  # a whole model's worker's load, alike
        sharded_checkpoint.check_optimizer_state(names, set(whole_state(str(tmp_path / "dcp"))["optim"]), "x")
