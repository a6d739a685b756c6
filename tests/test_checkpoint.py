"""The checkpoint store on its own: commit protocol, verification, fallback, levels, retention."""

import json

import fsspec
import pytest
import torch

from etrain.core import checkpoint
from etrain.core.errors import UsageError

from helpers import hostile


def parts(value: float) -> dict:
    return {
        "model.pt": {"w": torch.full((4,), value), "b": torch.zeros(2)},
        "extra.pt": {"scheduler": {"last_epoch": 3}},
    }


def weights(ck: checkpoint.Checkpoint) -> torch.Tensor:
    return checkpoint.deserialize(ck.parts["model.pt"])["w"]


def save_light(uri: str, step: int, base_step: int, value: float) -> None:
    path = checkpoint.prepare(uri, step)
    files = {"model.pt": checkpoint.write_part(path, "model.pt", {"w": torch.full((4,), value, dtype=torch.bfloat16)})}
    checkpoint.commit(
        path, {"level": "light", "step": step, "base": f"step-{base_step:08d}", "base_step": base_step}, files
    )


def corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_verifies_and_loads(tmp_path):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {"cursor": 80}, keep=3)
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5 and ck.meta["cursor"] == 80 and ck.meta["level"] == "full"
    assert torch.equal(weights(ck), torch.ones(4))
    assert sorted(ck.meta["files"]) == ["extra.pt", "model.pt"] and ck.base is None


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    path = checkpoint.prepare(uri, 10)
    checkpoint.write_part(path, "model.pt", parts(2.0)["model.pt"])  # crash before the commit marker
    assert checkpoint.load_latest(uri).meta["step"] == 5


def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    corrupt(tmp_path / "ck" / "step-00000010" / "model.pt")
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5
    assert "step-00000010" in caplog.text and "sha256" in caplog.text


def test_truncated_commit_marker_is_skipped_and_named(tmp_path, caplog):
    """A commit is written whole (one PUT, or a rename): a truncated one is corruption, not a save in flight. The
    load falls back and names it, in the log and in what it returns."""
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    marker = tmp_path / "ck" / "step-00000010" / checkpoint.COMMIT
    marker.write_bytes(marker.read_bytes()[:40])
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5
    assert [s["path"].rsplit("/", 1)[1] for s in ck.skipped] == ["step-00000010"]
    assert "commit.json does not parse as JSON" in ck.skipped[0]["error"]
    assert "step-00000010" in caplog.text


def test_light_checkpoint_completes_from_its_base(tmp_path):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 10, parts(1.0), {}, keep=3)
    save_light(uri, 15, 10, 3.0)
    ck = checkpoint.load_latest(uri)
    assert ck.meta["level"] == "light" and ck.base.endswith("step-00000010")
    assert torch.equal(
        checkpoint.deserialize(ck.parts[checkpoint.LIGHT])["w"], torch.full((4,), 3.0, dtype=torch.bfloat16)
    )
    assert torch.equal(weights(ck), torch.ones(4)) and "extra.pt" in ck.parts  # the rest is the base's


def test_light_checkpoint_with_a_corrupt_base_is_skipped(tmp_path, caplog):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    save_light(uri, 15, 10, 3.0)
    corrupt(tmp_path / "ck" / "step-00000010" / "model.pt")
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5 and "step-00000015" in caplog.text


def test_retention_keeps_last_k_full_and_the_light_ones_after_them(tmp_path):
    uri = str(tmp_path / "ck")
    (tmp_path / "ck" / "step-00000001").mkdir(parents=True)  # debris of a crashed save
    for step in (2, 4, 6, 8):
        checkpoint.save(uri, step, parts(step), {}, keep=2)
    save_light(uri, 7, 6, 7.0)  # superseded by the full one at 8
    save_light(uri, 9, 8, 9.0)
    save_light(uri, 10, 8, 10.0)
    (tmp_path / "ck" / "step-00000011").mkdir()  # a save in flight: not debris yet
    checkpoint.retain(uri, keep=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "step-00000006",
        "step-00000008",
        "step-00000009",
        "step-00000010",
        "step-00000011",
    ]


@pytest.mark.parametrize("case", sorted(hostile.crafted("M")))
@pytest.mark.parametrize("wrapped", [True, False], ids=["torch-file", "bare-pickle"])
def test_a_crafted_part_runs_nothing_and_is_refused_in_one_line_naming_it(tmp_path, case, wrapped):
    """Every part but a layout's is read with torch.load(weights_only=True): each crafted pickle, inside a torch file
    or bare, is refused with one line naming the part, and its command never runs."""
    marker = tmp_path / "ran"
    body = hostile.crafted(str(marker))[case]
    data = hostile.in_torch_file(body) if wrapped else body
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.read_part({"optim.pt": data}, "optim.pt")
    assert "\n" not in str(refused.value) and str(refused.value).startswith(
        "optim.pt is not a file of tensors etrain reads"
    )
    assert not marker.exists()


def test_no_checkpoint_gives_none(tmp_path):
    assert checkpoint.load_latest(str(tmp_path / "nothing")) is None


def test_tensor_hash_sees_one_changed_element():
    t = torch.randn(1000)
    before = checkpoint.tensor_hash(t)
    assert checkpoint.tensor_hash(t.clone()) == before
    t[500] += 1e-6
    assert checkpoint.tensor_hash(t) != before


def test_cursor_log_keeps_the_newest_record(tmp_path):
    log = checkpoint.CursorLog(str(tmp_path / "ck"))
    for step in range(1, 101):
        log.update({"step": step, "cursor": step * 16})
    log.close()
    assert checkpoint.read_cursor(str(tmp_path / "ck")) == {"step": 100, "cursor": 1600}


def test_round_trip_and_fallback_on_s3(s3_bucket):
    uri = f"{s3_bucket}/run/checkpoints"
    checkpoint.save(uri, 5, parts(1.0), {"cursor": 80}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {"cursor": 160}, keep=3)
    save_light(uri, 12, 10, 3.0)
    fs, _ = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()
    fs.rm(f"{uri}/step-00000010/model.pt")  # as if the data write had been lost
    path = checkpoint.prepare(uri, 15)
    checkpoint.write_part(path, "model.pt", parts(4.0)["model.pt"])  # a save that never committed
    ck = checkpoint.load_latest(uri)
    assert ck.meta["cursor"] == 80 and ck.path == f"{uri}/step-00000005"
    assert torch.equal(weights(ck), torch.ones(4))


@pytest.mark.parametrize("cut", [0, 1, 100, -1])
def test_part_cut_short_is_detected(tmp_path, cut):
    """A write cut off at any length (a kill mid-part) fails verification; the previous checkpoint is used."""
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    target = tmp_path / "ck" / "step-00000010" / "extra.pt"
    data = target.read_bytes()
    target.write_bytes(data[:cut] if cut >= 0 else data[: len(data) + cut])
    assert checkpoint.load_latest(uri).meta["step"] == 5


def test_light_weights_are_the_changed_tensors_in_the_compact_dtype():
    base = {"frozen": torch.randn(8), "trained": torch.randn(8), "count": torch.tensor([3])}
    base_hashes = {k: checkpoint.tensor_hash(v) for k, v in base.items()}
    now = {**base, "trained": base["trained"] + 1}
    hashes = {k: checkpoint.tensor_hash(v) for k, v in now.items()}
    light = checkpoint.light_weights(now, hashes, base_hashes, "bfloat16")
    assert set(light) == {"trained"} and light["trained"].dtype == torch.bfloat16
    assert checkpoint.light_weights(now, hashes, {}, "float32").keys() == now.keys()  # no base: everything


SHA = "0" * 64


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("cursor", -5, "cursor is -5, not a whole number"),
        ("cursor", True, "cursor is True, not a whole number"),
        ("cursor", 1.5, "cursor is 1.5, not a whole number"),
        ("step", "10", "step is '10', not a step number"),
        ("step", 9, "step is 9, not the step of its directory step-00000010"),
        ("level", "huge", "level is 'huge', not full or light"),
        ("files", [], "files is not a mapping of its parts"),
        ("files", {"../../etc/passwd": {"bytes": 1, "sha256": SHA}}, "names a part '../../etc/passwd'"),
        ("files", {"/etc/passwd": {"bytes": 1, "sha256": SHA}}, "names a part '/etc/passwd'"),
        ("files", {"model.pt": {"bytes": -1, "sha256": SHA}}, "part model.pt has no size and sha256"),
        ("files", {"model.pt": {"bytes": 1, "sha256": "beef"}}, "part model.pt has no size and sha256"),
        ("files", {"dcp": {"bytes": 1, "sha256": SHA}}, "names a part 'dcp'"),
    ],
)
def test_a_tampered_commit_is_skipped_in_one_line_naming_its_field(tmp_path, field, value, said):
    """Issue 41, defect 7: a commit.json whose fields no save writes (a negative or fractional cursor, a step that
    is a string or another directory's, a part outside the step directory) raised a raw ValueError or TypeError,
    or was read from. Now the checkpoint is skipped, the field named."""
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {"cursor": 80}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {"cursor": 160}, keep=3)
    commit = tmp_path / "ck" / "step-00000010" / checkpoint.COMMIT
    commit.write_text(json.dumps(json.loads(commit.read_text()) | {field: value}))
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5
    (skipped,) = ck.skipped
    assert skipped["path"].endswith("step-00000010") and skipped["error"].startswith(f"commit.json: {said}")
    assert "\n" not in skipped["error"]


def test_every_checkpoint_corrupt_is_refused_naming_each_with_its_cause(tmp_path):
    """Issue 41, defect 3: with every committed checkpoint corrupt, the newest one was None (\"no committed
    checkpoint\") and a resume trained from scratch. Now: CheckpointsCorrupt, a usage error (exit 2), naming each."""
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    corrupt(tmp_path / "ck" / "step-00000010" / "model.pt")
    (tmp_path / "ck" / "step-00000005" / "extra.pt").write_bytes(b"")  # truncated to nothing
    with pytest.raises(checkpoint.CheckpointsCorrupt) as refused:
        checkpoint.load_latest(uri)
    assert isinstance(refused.value, UsageError)
    text = str(refused.value)
    assert "step-00000010: model.pt does not match its sha256" in text
    assert "step-00000005: extra.pt does not match its sha256" in text
    assert [s["path"].rsplit("/", 1)[1] for s in refused.value.skipped] == ["step-00000010", "step-00000005"]
    assert checkpoint.newest_meta(uri)["step"] == 10  # how far it got: unverified, as `etrain status` reads it


def test_a_crafted_part_rehashed_into_its_commit_is_skipped_and_named_before_any_load(tmp_path):
    """A part replaced by a crafted torch file, its sha256 rewritten to match: the checkpoint verifies by hash, so its
    pickle is read too (onto the meta device, before any worker loads it): the checkpoint is skipped, named with the
    part, and the one before is taken. Nothing runs."""
    import hashlib

    uri, marker = str(tmp_path / "ck"), tmp_path / "ran"
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    body = hostile.in_torch_file(hostile.crafted(str(marker))["os.system"])
    step = tmp_path / "ck" / "step-00000010"
    (step / "extra.pt").write_bytes(body)
    commit = json.loads((step / checkpoint.COMMIT).read_text())
    commit["files"]["extra.pt"] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (step / checkpoint.COMMIT).write_text(json.dumps(commit))
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5 and ck.skipped[0]["error"].startswith("extra.pt is not a file of tensors etrain reads")
    assert not marker.exists()


@pytest.mark.parametrize(
    "body",
    [
        b"\x80\x02.",
        b"\x80\x02ccollections\nOrderedDict\nK\x01\x85R.",
        b"",
        b"PK\x03\x04 not a zip",
        b"\x80\x02]q\x00(K\x01",
    ],
    ids=["stop-on-empty-stack", "allowed-class-bad-args", "empty", "broken-zip", "cut-short"],
)
def test_a_malformed_part_is_refused_in_one_line_whatever_the_unpickler_raises(body):
    """weights_only's unpickler raises more than UnpicklingError for a malformed file (IndexError, TypeError, ...):
    every one is a refusal naming the part, never a raw exception out of the load."""
    for data in (body, hostile.in_torch_file(body)):
        with pytest.raises(checkpoint.CheckpointError, match=r"^model\.pt is not a file of tensors etrain reads: "):
            checkpoint.read_part({"model.pt": data}, "model.pt")


def test_retention_after_a_skipped_newer_checkpoint_keeps_the_good_ones(tmp_path):
    """A resume that skipped a corrupt step 10 and went on from step 5 saves step 6: with checkpoint.keep=1, counting
    the corrupt 10 as the newest would remove 5 and 6 and leave only it. Directories past the step just saved are
    neither counted nor removed."""
    uri = str(tmp_path / "ck")
    for step in (5, 10):
        checkpoint.save(uri, step, parts(float(step)), {}, keep=3)
    corrupt(tmp_path / "ck" / "step-00000010" / "model.pt")
    assert checkpoint.load_latest(uri).meta["step"] == 5
    checkpoint.save(uri, 6, parts(6.0), {}, keep=1)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000006", "step-00000010"]
    assert checkpoint.load_latest(uri).meta["step"] == 6
