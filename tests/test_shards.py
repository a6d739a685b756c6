import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from etrain.data import tokenizer
from etrain.data.embedded import ensure_corpus, stdlib_files
from etrain.data.shards import (
    ShardError,
    ShardReader,
    pack_rows,
    read_manifest,
    row_sources,
)


@pytest.fixture
def corpus(make_cfg) -> str:
    return ensure_corpus(make_cfg())


def test_manifest_describes_every_shard(corpus):
    manifest = read_manifest(corpus)
    assert (manifest["token_dtype"], manifest["seq_len"], manifest["vocab_size"]) == ("uint8", 128, 256)
    train = manifest["splits"]["train"]
    assert len(train["shards"]) >= 3, "small shard_bytes must give several shards"
    assert train["samples"] == sum(s["samples"] for s in train["shards"])
    root = Path(corpus).parent
    for shard in train["shards"] + manifest["splits"]["eval"]["shards"]:
        assert (root / shard["path"]).stat().st_size == shard["bytes"]
        assert shard["bytes"] <= 200_000 * 1.1  # target size, plus Parquet's footer


def test_rows_are_the_packed_token_stream(corpus):
    reader = ShardReader(corpus, "train")
    rows = reader.get(np.arange(len(reader)))
    assert rows.shape == (len(reader), 129) and rows.dtype == np.uint8
    text = tokenizer.decode(rows[:4].reshape(-1))
    first = stdlib_files()[0].read_text()
    assert text[:200] in first or first[:200] in text  # the first document, byte for byte


def test_pack_rows_names_every_document_a_row_overlaps():
    docs = [np.full(3, 1, np.uint8), np.full(5, 2, np.uint8), np.full(2, 3, np.uint8), np.full(4, 4, np.uint8)]
    rows, sources = pack_rows(docs, ["a#0", "b#0", "c#0", "d#0"], 4)
    assert rows.tolist() == [[1, 1, 1, 2], [2, 2, 2, 2], [3, 3, 4, 4]]  # two tokens of d fill no row: dropped
    assert sources == [["a#0", "b#0"], ["b#0"], ["c#0", "d#0"]]


def test_rows_name_the_documents_they_were_packed_from(corpus):
    """Trace a row back: its bytes lie in its documents, joined as they were packed."""
    manifest = read_manifest(corpus)
    shard = manifest["splits"]["train"]["shards"][1]
    reader = ShardReader(corpus, "train")
    start = manifest["splits"]["train"]["shards"][0]["samples"]
    root = Path(sysconfig.get_paths()["stdlib"])
    for row, names in zip(
        [0, 7, shard["samples"] - 1],
        row_sources(str(Path(corpus).parent / shard["path"]), np.array([0, 7, shard["samples"] - 1])),
    ):
        assert names and all(n.startswith("stdlib/") and n.endswith("#0") for n in names)
        joined = b"".join(
            (root / n.removeprefix("stdlib/").removesuffix("#0")).read_bytes() + bytes([tokenizer.EOT]) for n in names
        )
        assert reader.get(np.array([start + row]))[0].tobytes() in joined


def test_random_access_matches_sequential(corpus):
    reader = ShardReader(corpus, "train", cache_shards=1)
    everything = reader.get(np.arange(len(reader)))
    ids = np.random.default_rng(0).integers(0, len(reader), 300)
    assert np.array_equal(reader.get(ids), everything[ids])


def test_rebuild_is_identical(make_cfg, tmp_path, corpus):
    again = ensure_corpus(make_cfg(f"data.cache_dir={tmp_path / 'again'}"))
    assert json.loads(Path(again).read_text())["splits"] == json.loads(Path(corpus).read_text())["splits"]


def test_eval_split_is_disjoint_documents(corpus):
    source = read_manifest(corpus)["source"]
    assert source["documents"]["eval"] > 0 and source["documents"]["train"] > 10 * source["documents"]["eval"]


def test_corrupt_shard_is_named(corpus, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(Path(corpus).parent, copy)
    shard = copy / read_manifest(corpus)["splits"]["train"]["shards"][1]["path"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = ShardReader(str(copy / "manifest.json"), "train")
    reader.get([0])  # shard 0 is intact
    with pytest.raises(ShardError, match="train-00001.parquet"):
        reader.get([len(reader) - 1, reader.starts[1]])


def test_missing_manifest_says_what_to_do(tmp_path):
    with pytest.raises(ShardError, match="etrain prepare"):
        read_manifest(str(tmp_path / "manifest.json"))


def test_embedded_corpus_on_s3_reads_like_local(make_cfg, s3_bucket, corpus):
    remote = ensure_corpus(make_cfg(f"data.cache_dir={s3_bucket}/data"))
    assert remote.startswith(s3_bucket) and remote.endswith("manifest.json")
    local, far = ShardReader(corpus, "eval"), ShardReader(remote, "eval")
    assert np.array_equal(far.get(np.arange(len(far))), local.get(np.arange(len(local))))
    assert ensure_corpus(make_cfg(f"data.cache_dir={s3_bucket}/data")) == remote  # reused, not rebuilt
