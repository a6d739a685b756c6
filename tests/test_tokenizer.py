"""Tokenizers (etrain/data/tokenizer.py): a byte-level BPE learned from text, a tokenizer file and the directory
holding it, its end-of-document token as the file defines it, and the refusals naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from etrain.data import tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Pack my box with five dozen liquor jugs; héllo wörld, 東京.",
    "def main():\n    return 42\n",
] * 20


def test_a_learned_bpe_round_trips_text_and_ends_documents(tmp_path):
    tok = tokenizer.train_bpe(iter(TEXTS), 300)
    assert tok.vocab_size == 300 and tok.dtype == "uint16" and tok.eos == 0
    ids = tok.encode_document(TEXTS[1])
    assert ids.dtype == np.uint16 and ids[-1] == tok.eos and len(ids) < len(TEXTS[1].encode())  # merges learned
    assert tok.decode(ids) == TEXTS[1]  # every byte representable: nothing lost, the EOS not shown
    (tmp_path / "tokenizer.json").write_text(tok.text)
    again = tokenizer.read_file(tmp_path)  # the directory that holds it
    assert again.sha256 == tok.sha256 and list(again.encode_document(TEXTS[0])) == list(tok.encode_document(TEXTS[0]))
    together = tok.encode_documents(TEXTS)  # as prepare packs: in one call, each document as the library encodes it
    assert [list(ids) for ids in together] == [[*tok.tokenizer.encode(t).ids, tok.eos] for t in TEXTS]


def test_a_tokenizer_config_beside_the_file_names_its_eos(tmp_path):
    from tokenizers import AddedToken

    tok = tokenizer.train_bpe(iter(TEXTS), 300)
    tok.tokenizer.add_special_tokens([AddedToken("<|stop|>", special=True)])
    (tmp_path / "tokenizer.json").write_text(tok.tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|stop|>"}}))
    read = tokenizer.read_file(tmp_path / "tokenizer.json")
    assert read.eos == read.tokenizer.token_to_id("<|stop|>") == 300 and read.vocab_size == 301

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"has no token <\|nope\|> \(tokenizer_config.json's eos_token\)"):
        tokenizer.read_file(tmp_path)


def test_what_is_not_a_tokenizer_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        tokenizer.read_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizer file `tokenizers` reads"):
        tokenizer.read_file(tmp_path)
    bare = json.loads(tokenizer.train_bpe(iter(TEXTS), 300).text)
    bare["added_tokens"] = []
    bare["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(bare))
    with pytest.raises(ValueError, match="names no end-of-document token"):
        tokenizer.read_file(tmp_path)


def test_pack_ends_documents_with_the_eos_the_driver_read(tmp_path):
    """A Ray Data worker packs with the tokenizer's text and the EOS the driver read (tokenizer_config.json's here,
    not the conventional <|endoftext|> the file also has): each document's tokens, that EOS after each."""
    import pandas as pd
    from tokenizers import AddedToken

    from etrain.core.config import load_config
    from etrain.data.prepare import pack
    from etrain.data.shards import load_shard

    tok = tokenizer.train_bpe(iter(TEXTS), 300)
    tok.tokenizer.add_special_tokens([AddedToken("<|stop|>", special=True)])
    (tmp_path / "tokenizer.json").write_text(tok.tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|stop|>"}))
    read = tokenizer.read_file(tmp_path)
    group = pd.DataFrame({"doc_id": [1, 0], "text": TEXTS[:2], "name": ["b", "a"], "group": ["train/x.short"] * 2})
    cfg = load_config("tiny", ["model.seq_len=8"])
    packed = pack(group, str(tmp_path / "out"), cfg, {}, (read.text, read.eos_name))
    entry = json.loads(packed["entries"][0])[0]
    rows = load_shard(str(tmp_path / "out" / entry["path"]), entry, 9, np.dtype(read.dtype))
    want = np.concatenate([read.encode_document(TEXTS[1]), read.encode_document(TEXTS[0])])  # in id order
    assert read.eos == 300 and list(rows.ravel()) == list(want[: rows.size])
