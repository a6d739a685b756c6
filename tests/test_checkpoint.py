import torch

from app import checkpoint


def state(value: float) -> bytes:
    return checkpoint.serialize({"w": torch.full((4,), value), "step": 3})


def test_round_trip_verifies_and_loads(tmp_path):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, state(1.0), {"cursor": 80}, keep=3)
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5 and ck.meta["cursor"] == 80
    assert torch.equal(checkpoint.deserialize(ck.state)["w"], torch.ones(4))


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, state(1.0), {}, keep=3)
    partial = tmp_path / "ck" / "step-00000010"
    partial.mkdir()
    (partial / "state.pt").write_bytes(state(2.0))  # crash before the commit marker
    assert checkpoint.load_latest(uri).meta["step"] == 5


def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog):
    uri = str(tmp_path / "ck")
    checkpoint.save(uri, 5, state(1.0), {}, keep=3)
    checkpoint.save(uri, 10, state(2.0), {}, keep=3)
    target = tmp_path / "ck" / "step-00000010" / "state.pt"
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF
    target.write_bytes(bytes(data))
    ck = checkpoint.load_latest(uri)
    assert ck.meta["step"] == 5
    assert "step-00000010" in caplog.text and "sha256" in caplog.text


def test_retention_keeps_last_k_and_clears_debris(tmp_path):
    uri = str(tmp_path / "ck")
    (tmp_path / "ck" / "step-00000001").mkdir(parents=True)  # debris of a crashed save
    for step in (2, 4, 6, 8):
        checkpoint.save(uri, step, state(step), {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000006", "step-00000008"]


def test_weights_only_refuses_arbitrary_pickles():
    import io
    import pickle

    import pytest

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.deserialize(buf.getvalue())


def test_no_checkpoint_gives_none(tmp_path):
    assert checkpoint.load_latest(str(tmp_path / "nothing")) is None


def test_round_trip_and_fallback_on_s3(s3_bucket):
    import fsspec

    uri = f"{s3_bucket}/run/checkpoints"
    checkpoint.save(uri, 5, state(1.0), {"cursor": 80}, keep=3)
    checkpoint.save(uri, 10, state(2.0), {"cursor": 160}, keep=3)
    fs, _ = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()
    fs.rm(f"{uri}/step-00000010/state.pt")  # as if the data write had been lost
    fs.pipe_file(f"{uri}/step-00000015/state.pt", state(3.0))  # a save that never committed
    ck = checkpoint.load_latest(uri)
    assert ck.meta["cursor"] == 80
    assert torch.equal(checkpoint.deserialize(ck.state)["w"], torch.ones(4))
