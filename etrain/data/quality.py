"""Normalisation and the non-natural-language filters (the first line of defence).

Each filter returns the reason a document is rejected, or None; the reasons are
the keys of `report.json` and the quarantine file. Thresholds live in the
config's `prepare` section. The statistics follow Gopher's quality rules
(Rae et al., 2021), simplified.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

from etrain.core.config import PrepareConfig

_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANK_RUNS = re.compile(r"\n{3,}")
_CONTROL = {c for c in map(chr, range(32)) if c not in "\n\t"}


def normalise(text: str) -> str:
    """NFC, unified newlines, no control characters, single spaces, at most one blank line in a row."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "".join(ch for ch in text if ch not in _CONTROL)
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


def decode(data: bytes) -> tuple[str | None, str | None]:
    """Text of a raw file, or the reason it is not text."""
    if b"\x00" in data[:65536]:
        return None, "binary"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "invalid_utf8"


def reject_reason(text: str, cfg: PrepareConfig) -> str | None:
    words = text.split()
    if len(words) < cfg.min_words:
        return "too_short"
    visible = [c for c in text if not c.isspace()]
    if sum(not c.isalpha() for c in visible) / len(visible) > cfg.max_symbol_ratio:
        return "symbols_digits"
    mean = sum(map(len, words)) / len(words)
    if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
        return "word_length"
    if repeated_line_ratio(text) > cfg.max_repeated_line_ratio:
        return "repeated_lines"
    if repeated_ngram_ratio(words, cfg.ngram) > cfg.max_repeated_ngram_ratio:
        return "repeated_ngrams"
    return None


def repeated_line_ratio(text: str) -> float:
    lines = [line for line in text.split("\n") if line]
    counts = Counter(lines)
    return sum(c - 1 for c in counts.values()) / max(1, len(lines))


def repeated_ngram_ratio(words: list[str], n: int) -> float:
    """Share of word n-grams that repeat an earlier one."""
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1 - len(set(grams)) / len(grams)
