"""Normalisation and the non-natural-language filters (the first line of defence).

Each filter returns the reason a document is rejected, or None; the reasons are
the keys of `report.json` and the quarantine file. Thresholds live in the
config's `prepare` section. The statistics follow Gopher's quality rules
(Rae et al., 2021), simplified, and hold for every script: Chinese, Japanese,
Thai and the others written without spaces between words have each of their
characters counted as a word (etrain/data/scripts.py), the mean word length is judged on the
words between spaces alone, and a letter is any character of a letter or mark
category (Thai's vowel signs and Devanagari's are marks, not symbols). Source code
has its own symbol share; a page's navigation (items between lone separators) is
rejected in any script.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

from etrain.core.config import PrepareConfig
from etrain.data import scripts

SEPARATORS = {"|", "｜", "•", "·", "»", "›", "/", ">"}  # standing alone between a menu's or a breadcrumb's items
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
    words = scripts.words(text)
    if len(words) < cfg.min_words:
        return "too_short"
    code = scripts.looks_like_code(text)
    chars = [(c, n) for c, n in Counter(text).items() if not c.isspace()]  # each distinct character once
    symbols = sum(n for c, n in chars if not c.isalpha() and unicodedata.category(c)[0] != "M")
    symbols /= sum(n for _, n in chars)
    if symbols > (cfg.max_code_symbol_ratio if code else cfg.max_symbol_ratio):
        return "symbols_digits"
    if not code and sum(t in SEPARATORS for t in text.split()) / len(words) > cfg.max_separator_ratio:
        return "separators"
    spaced = scripts.spaced(words)
    if 2 * len(spaced) >= len(words):  # judged where most words stand between spaces
        mean = sum(map(len, spaced)) / len(spaced)
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
