"""Where samples come from (data: the corpus, its shards and the node caches) and how raw documents become a
corpus (prepare: reading, tokenizer, quality filters, dedup)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from etrain.core.config.base import Section


class DataConfig(Section):
    source: str = Field("embedded", description="'embedded' (stdlib corpus) or a manifest.json path/URI")
    cache_dir: str = Field("~/.cache/etrain/data", description="where the embedded corpus is built (path or URI)")
    corpus_bytes: int = Field(6_000_000, ge=10_000, description="cap on the embedded corpus' raw text")
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="documents held out for evaluation")
    shard_bytes: int = Field(128 * 2**20, ge=4096, description="target physical shard size")
    cache_shards: int = Field(3, ge=2, description="shards each node keeps on local disk (the node cache)")
    shuffle_shards: int = Field(1, ge=1, description="shards whose samples are shuffled together; < cache_shards")
    node_cache_dir: str = Field("/tmp/etrain-cache", description="local directory of each node's shard cache")

    @model_validator(mode="after")
    def _room_to_prefetch(self) -> DataConfig:
        if self.shuffle_shards >= self.cache_shards:
            raise ValueError(
                f"data.shuffle_shards={self.shuffle_shards} must be below data.cache_shards={self.cache_shards}: "
                "the cache needs a free slot to prefetch the next shard"
            )
        return self


class TrainedTokenizer(Section):
    """A byte-level BPE learned by `etrain prepare` from the corpus it keeps (after the filters and dedup)."""

    train: Literal["bpe"] = "bpe"
    vocab_size: int = Field(ge=257, le=2**32, description="tokens, <|endoftext|> and the 256 bytes among them")
    sample_bytes: int = Field(100_000_000, ge=1, description="the corpus text it learns from, at most")


class PrepareConfig(Section):
    """`etrain prepare`: reading, quality filters and dedup. See etrain/data/quality.py."""

    tokenizer: str | TrainedTokenizer = Field(
        "bytes",
        description="bytes (every byte a token); a tokenizer.json or a directory holding one (a Hugging Face "
        "model's); or {train: bpe, vocab_size: N} to learn one from the corpus. Kept with the shards",
    )

    engine: Literal["auto", "ray", "local"] = Field(
        "auto",
        description="ray (Ray Data, across the cluster), local (in this process: no Ray start-up per stage), or auto "
        "(local for inputs up to 8 MiB). The output is the same byte for byte",
    )
    jsonl_field: str = Field("text", description="JSONL key holding a document's text")
    parquet_column: str = Field("text", description="Parquet column holding a document's text")
    min_words: int = Field(20, ge=1, description="shorter documents are rejected as too_short")
    max_symbol_ratio: float = Field(0.25, gt=0, le=1, description="non-letters among visible characters")
    max_code_symbol_ratio: float = Field(
        0.45, gt=0, le=1, description="non-letters among visible characters of source code (etrain/data/scripts.py)"
    )
    max_separator_ratio: float = Field(
        0.05, ge=0, le=1, description="lone separators (| • » / ...) per word, as a navigation menu has them"
    )
    min_mean_word_length: float = Field(2.5, gt=0)
    max_mean_word_length: float = Field(10.0, gt=0)
    max_repeated_line_ratio: float = Field(0.3, ge=0, le=1, description="lines repeating an earlier line")
    max_repeated_ngram_ratio: float = Field(0.2, ge=0, le=1, description="word n-grams repeating an earlier one")
    ngram: int = Field(5, ge=1, description="word n-gram size for the repetition filter and MinHash shingles")
    near_dup_threshold: float = Field(
        0.85, gt=0, le=1, description="MinHash Jaccard above which documents are near-duplicates"
    )
    minhash_perms: int = Field(128, ge=16)
    length_buckets: list[int] = Field(
        [2_000, 20_000], description="character counts splitting short/medium/long logical shards"
    )
    languages: list[str] = Field(
        [], description="ISO 639-1 codes of the languages kept, e.g. [en]; other documents are rejected as language"
    )
    language_min_share: float = Field(
        0.8, gt=0, le=1, description="share of a document's characters that must be in an allowed language"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PrepareConfig:
        if self.min_mean_word_length >= self.max_mean_word_length:
            raise ValueError("prepare.min_mean_word_length must be below prepare.max_mean_word_length")
        if self.length_buckets != sorted(self.length_buckets) or len(self.length_buckets) != 2:
            raise ValueError("prepare.length_buckets must be two increasing character counts, e.g. [2000, 20000]")
        odd = [code for code in self.languages if not re.fullmatch(r"[a-z]{2,3}", code)]
        if odd:
            raise ValueError(f"prepare.languages takes ISO 639-1 codes such as en, de, zh; got {odd}")
        return self
