"""Tokenizers: bytes (the embedded demo's default: no vocabulary file, every byte a token), a Hugging Face
`tokenizer.json` (the `tokenizers` library), or a byte-level BPE trained on the corpus and kept with its shards.

With bytes, token 0 (NUL, which normalised text never contains) separates documents, so tokens fit in uint8 and a
shard stores one byte per token. A tokenizer file's documents start and end as the file defines: its
post-processor's BOS, then its EOS (tokenizer_config.json's eos_token when one is beside it), and shards store
uint16 or uint32 tokens as its vocabulary needs.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOT = 0
VOCAB_SIZE = 256
BYTES = "bytes"
FILE = "tokenizer.json"  # the name a tokenizer is kept under beside the shards
COMPANIONS = ("tokenizer_config.json", "chat_template.jinja")  # kept beside it: its specials, a chat model's template
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")  # by convention, when nothing says


def encode(text: str) -> np.ndarray:
    data = text.replace("\x00", "").encode("utf-8", errors="replace")
    return np.frombuffer(data, dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if t != EOT).decode("utf-8", errors="replace")


class TokenizerFile:
    """A Hugging Face tokenizer (its JSON text): what prepare packs with and a run decodes with."""

    def __init__(self, text: str, eos_name: str | None = None):
        from tokenizers import Tokenizer  # only where a tokenizer file is used

        self.text = text
        self.tokenizer = Tokenizer.from_str(text)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = "uint16" if self.vocab_size <= 2**16 else "uint32"
        self.eos = self._eos(eos_name)
        self.eos_name = self.tokenizer.id_to_token(self.eos)
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()

    def _eos(self, name: str | None) -> int:
        for candidate in [name] if name else EOS_NAMES:
            if (token := self.tokenizer.token_to_id(candidate)) is not None:
                return token
        if name:
            raise ValueError(f"the tokenizer has no token {name} (tokenizer_config.json's eos_token)")
        raise ValueError(
            f"the tokenizer names no end-of-document token (none of {', '.join(EOS_NAMES)}, and no "
            "tokenizer_config.json with eos_token beside it)"
        )

    def encode_document(self, text: str) -> np.ndarray:
        """A document's tokens: the tokenizer's own specials (a BOS its post-processor adds), then EOS."""
        return self.encode_documents([text])[0]

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's tokens, as encode_document's: encoded together, on the library's threads (one call per
        document leaves all but one core idle: bench/models.py measures both)."""
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        return [np.array([*e.ids, self.eos], dtype=self.dtype) for e in encoded]

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def manifest(self) -> dict:
        return {"file": FILE, "sha256": self.sha256, "eos": self.eos, "vocab_size": self.vocab_size}


def _located(path: str | Path):
    """(filesystem, path of the tokenizer file): `path` is the file, or a directory holding it."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(path) if "://" in str(path) else str(Path(path).expanduser()))
    return fs, posixpath.join(root, FILE) if fs.isdir(root) else root


def with_companions(path: str | Path) -> dict[str, bytes]:
    """The tokenizer file at `path` (the file, or a directory holding it) and the COMPANIONS beside it, by name:
    what travels with a tokenizer from a model to a corpus, and from a run's data to an exported model, so that a
    chat model keeps its template."""
    fs, file = _located(path)
    beside = {name: posixpath.join(posixpath.dirname(file), name) for name in COMPANIONS}
    return {FILE: fs.cat_file(file)} | {name: fs.cat_file(p) for name, p in beside.items() if fs.isfile(p)}


def read_file(path: str | Path) -> TokenizerFile:
    """`tokenizer.json`, or a directory holding one (and perhaps tokenizer_config.json, which names its EOS), on
    local disk or at an fsspec URI; ValueError naming what is missing or wrong."""
    fs, file = _located(path)
    if not fs.isfile(file):
        raise ValueError(f"prepare.tokenizer {path}: no {FILE} there (give the file, or a directory holding it)")
    named = None
    config = posixpath.join(posixpath.dirname(file), "tokenizer_config.json")
    if fs.isfile(config):
        named = json.loads(fs.cat_file(config)).get("eos_token")
        named = named.get("content") if isinstance(named, dict) else named
    try:
        return TokenizerFile(fs.cat_file(file).decode(), named)
    except ValueError as e:
        raise ValueError(f"prepare.tokenizer {file}: {e}") from None
    except Exception as e:  # the library's own parse error: say which file
        raise ValueError(f"prepare.tokenizer {file} is not a tokenizer file `tokenizers` reads: {e}") from None


@dataclass(frozen=True)
class Codec:
    """Text to a run's token ids and back, and its end of document (a response's end, a prompt's left padding):
    what generation and PPO's rollouts go through, so that they speak the model's vocabulary."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos: int
    vocab_size: int
    name: str  # bytes, or the tokenizer file it was read from


BYTE_CODEC = Codec(lambda text: [int(t) for t in encode(text)], decode, EOT, VOCAB_SIZE, BYTES)


def file_codec(directory: str) -> Codec:
    """The codec of the tokenizer.json in `directory` (a Hugging Face model's, or a prepared corpus'); ValueError
    naming what is missing or wrong."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(directory))
    if not fs.isfile(posixpath.join(root, FILE)):
        raise ValueError(f"{directory} holds no {FILE}")
    tok = read_file(directory)
    return Codec(
        lambda text: tok.tokenizer.encode(text, add_special_tokens=True).ids,
        tok.decode,
        tok.eos,
        tok.vocab_size,
        posixpath.join(str(directory), FILE),
    )


def for_run(cfg) -> Codec:
    """The tokenizer a run's text goes through: its base's when that is a Hugging Face directory (its own
    tokenizer.json), else the one its data was prepared with (bytes, or the file kept beside the shards).
    ValueError naming what is missing."""
    from etrain.core import hf

    base = cfg.finetune.base
    if base is not None and hf.is_model_dir(base):
        return file_codec(base)
    if cfg.data.source == "embedded":
        return BYTE_CODEC
    import fsspec

    with fsspec.open(cfg.data.source) as f:
        manifest = json.load(f)
    if manifest.get("tokenizer", BYTES) == BYTES:
        return BYTE_CODEC
    return file_codec(posixpath.dirname(cfg.data.source))


def train_bpe(texts: Iterable[str], vocab_size: int) -> TokenizerFile:
    """A byte-level BPE of `vocab_size` tokens learned from `texts`, <|endoftext|> (id 0) its end of document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return TokenizerFile(tokenizer.to_str())
