"""A Hugging Face base's digest is hashed once per change of its files (etrain/core/digests.py): the same value as
hashing its tensors, read from this process or the node's cache without reading a tensor, and hashed again after
any rewrite, even one that puts the file's mtime back; a cache entry that is not one the module wrote is ignored."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from etrain.core import checkpoint, digests, finetune, hf
from etrain.core.config import ConfigError, ModelConfig, load_config
from etrain.core.models import make_model

LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=32, vocab_size=97)


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A tiny Llama directory (shards drawn small or whole), and a node cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_known", {})
    seed = random.randrange(1 << 30)
    print("seed", seed)
    torch.manual_seed(seed)
    out = tmp_path / "base"
    hf.write(make_model(LLAMA).state_dict(), LLAMA, out, shard_bytes=random.Random(seed).choice([16 << 10, 2 << 30]))
    return out


def settled(directory) -> None:
    """The files' times moved past digests.SETTLE_S: as they are a few seconds after they were written."""
    for f in directory.iterdir():
        s = f.stat()
        os.utime(f, ns=(s.st_atime_ns - 10**10, s.st_mtime_ns - 10**10))


def reads(monkeypatch) -> list[str]:
    """The tensors read from safetensors files from now on."""
    seen: list[str] = []
    tensor = hf.SafetensorsFile.tensor
    monkeypatch.setattr(hf.SafetensorsFile, "tensor", lambda self, name: seen.append(name) or tensor(self, name))
    return seen


def test_the_digest_is_the_tensors_and_is_not_hashed_again_while_the_files_are_unchanged(base, monkeypatch):
    expected = checkpoint.weights_digest(hf.Weights(base))
    assert digests.digest(str(base)) == expected
    assert list(digests.cache_dir().glob("*.json")) == []  # just written: not kept (its times may not move yet)
    settled(base)
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)  # utime moved the ctime to now
    assert digests.digest(str(base)) == expected
    seen = reads(monkeypatch)
    assert digests.digest(str(base)) == expected and seen == []  # this process's
    monkeypatch.setattr(digests, "_known", {})  # another process on the node: a worker
    assert digests.digest(str(base)) == expected and seen == []
    assert len(list(digests.cache_dir().glob("*.json"))) == 1


def test_a_rewritten_file_is_hashed_again_even_with_its_mtime_put_back(base, monkeypatch):
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    before = digests.digest(str(base))
    time.sleep(0.05)  # past the clock tick of the files' times (SETTLE_S is 0 here: the cache kept them)
    shard = sorted(base.glob("*.safetensors"))[-1]
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a weight's last byte: same size, same header
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = digests.digest(str(base))
    assert after != before and after == checkpoint.weights_digest(hf.Weights(base))


def test_a_cache_entry_that_is_not_the_modules_is_ignored(base, monkeypatch):
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    expected = digests.digest(str(base))
    (entry,) = digests.cache_dir().glob("*.json")
    key = json.loads(entry.read_text())["key"]
    crafted_entries = [
        "not json",
        json.dumps([1]),
        json.dumps({"key": "another", "digest": "0" * 64}),
        json.dumps({"key": key, "digest": "../../etc"}),
        json.dumps({"key": key, "digest": 7}),
    ]
    for crafted in crafted_entries:
        entry.write_text(crafted)
        monkeypatch.setattr(digests, "_known", {})
        assert digests.digest(str(base)) == expected, crafted


def test_a_changed_base_is_refused_at_build_after_the_cache_knew_it(base, monkeypatch):
    """The run records the digest; a worker building it after the base changed refuses it by name."""
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)  # the worst case: the cache kept the digest of the files as written
    source, recorded, _, model = finetune.resolve_base(str(base))
    cfg = load_config("tiny", [f"finetune.base={source}", f"finetune.base_digest={recorded}", "finetune.method=full"])
    cfg = cfg.model_copy(update={"model": model})
    built = finetune.build_model(cfg)
    assert all(torch.equal(built.state_dict()[n], t) for n, t in hf.read_weights(base).items())
    shard = sorted(base.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="not the checkpoint this run was made from"):
        finetune.build_model(cfg)
