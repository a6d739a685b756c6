"""The checkpoint store on its own: commit protocol, verification, fallback, levels, retention."""

import io
import pickle

import fsspec
import pytest
import torch

from app.core import checkpoint


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


def test_truncated_commit_marker_is_not_a_checkpoint(tmp_path, caplog):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, parts(1.0), {}, keep=3)
    checkpoint.save(uri, 10, parts(2.0), {}, keep=3)
    marker = tmp_path / "ck" / "step-00000010" / checkpoint.COMMIT
    marker.write_bytes(marker.read_bytes()[:40])
    assert checkpoint.load_latest(uri).meta["step"] == 5
    assert "unreadable" in caplog.text


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


def test_weights_only_refuses_arbitrary_pickles():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.deserialize(buf.getvalue())


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
