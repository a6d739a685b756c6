"""A sharded run's checkpoints (app/core/sharded_checkpoint.py): each rank's shards written with torch DCP in the
background, under the checkpoint's commit; a failed write, a tampered file and a hostile metadata file."""

from __future__ import annotations

import io
import os
import pickle

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from app.core import checkpoint
from app.core.config import ConfigError, load_config, override
from app.core.finetune import check_base, model_only
from app.core.model import GPT
from app.core.sharded_checkpoint import SavedWeights, _MetadataUnpickler, written

from runs import records, run


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


class _Hostile:
    def __reduce__(self):
        return (os.getcwd, ())


def test_a_metadata_file_that_would_build_anything_else_is_refused():
    """DCP's `.metadata` is a pickle: from storage it may build DCP's metadata classes and torch's sizes and dtypes,
    not a call to anything else."""
    with pytest.raises(pickle.UnpicklingError, match="may not build posix.getcwd"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(_Hostile()))).load()


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
