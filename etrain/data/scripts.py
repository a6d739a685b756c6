"""What a word is in each script: Chinese, Japanese, Thai and the other scripts written without spaces between words
have each of their characters counted as a word, so that the quality filters and the near-duplicate shingles hold
for them as for text with spaces; whether a document is source code, which the filters judge apart; and the script a
document is written in (or `code`), by which `report.json` splits its counts."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter

# Scripts written without spaces between words, by the first word of a character's Unicode name
UNSEGMENTED = {"CJK", "HIRAGANA", "KATAKANA", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN", "YI"}
# How a line of source code ends or starts (C, Python, Go, JavaScript, Java, Rust, shell...) and prose's rarely does
CODE_ENDS = (";", "{", "}", "(", ")", "[", "]", ":", ",", "*/", "\\")
CODE_STARTS = ("#", "//", "/*", "* ", "import ", "from ", "def ", "class ", "return", "func ", "fn ", "function ",
               "const ", "let ", "var ", "package ", "for ", "if ", "while ", "}", "@", "pub ", "use ")  # fmt: skip


@functools.lru_cache(maxsize=1 << 16)
def script(ch: str) -> str:
    """A letter's script, as the first word of its Unicode name: LATIN, CJK, HIRAGANA, THAI, CYRILLIC..."""
    return unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0].split("-", 1)[0]


@functools.lru_cache(maxsize=1 << 16)
def unsegmented(ch: str) -> bool:
    return _unsegmented().fullmatch(ch) is not None


@functools.cache
def _unsegmented() -> re.Pattern:
    """One letter of a script written without spaces, as a character class read from the Unicode tables once (the
    Basic Multilingual Plane, and CJK's supplementary planes whole)."""
    found = [c for c in map(chr, range(0x80, 0x10000)) if c.isalpha() and script(c) in UNSEGMENTED]
    return re.compile(f"[{_ranges(found)}\U00020000-\U0003ffff]")


@functools.cache
def _splitter() -> re.Pattern:
    """Where a token holding such letters splits: at each of them, and at each punctuation mark."""
    marks = [c for c in map(chr, range(0x10000)) if unicodedata.category(c)[0] == "P"]
    return re.compile(f"({_unsegmented().pattern}|[{_ranges(marks)}])")


def _ranges(chars: list[str]) -> str:
    """Sorted characters as a regex class's body of ranges."""
    out, first, last = [], None, None
    for c in chars:
        if last is not None and ord(c) == ord(last) + 1:
            last = c
            continue
        if first is not None:
            out.append(_span(first, last))
        first = last = c
    if first is not None:
        out.append(_span(first, last))
    return "".join(out)


def _span(first: str, last: str) -> str:
    return re.escape(first) if first == last else f"{re.escape(first)}-{re.escape(last)}"


def words(text: str) -> list[str]:
    """The text's words: the runs between spaces, except that each character of a script written without spaces is
    a word of its own, and so is a punctuation mark beside them, the runs around them words too ("用Ray训练。" is 用,
    Ray, 训, 练, 。). Text with none of those characters is split exactly as str.split() splits it."""
    out: list[str] = []
    letter, splitter = _unsegmented(), _splitter()
    for token in text.split():
        if token.isascii() or not letter.search(token):
            out.append(token)
        else:
            out += [part for part in splitter.split(token) if part]
    return out


def spaced(words_: list[str]) -> list[str]:
    """The words that stood between spaces (not a character of an unsegmented script)."""
    return [w for w in words_ if not (len(w) == 1 and unsegmented(w))]


def looks_like_code(text: str) -> bool:
    """Most of its lines (of three or more) end or start as a line of source code does. Code's brackets, operators
    and digits are what code is made of, not a page's junk: the filters hold code to its own symbol share."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) < 3:
        return False
    return 2 * sum(line.endswith(CODE_ENDS) or line.startswith(CODE_STARTS) for line in lines) >= len(lines)


def of_document(text: str) -> str:
    """`code` for source code (`looks_like_code`), else the script most of a document's letters are in, lower-case
    (latin, cyrillic, hangul, thai...); `han` for Chinese characters alone, `kana` for Japanese (kana among them);
    `none` without letters."""
    if looks_like_code(text):
        return "code"
    counts: Counter = Counter()
    for c, n in Counter(text).items():  # each distinct character once
        if c.isalpha():
            counts["LATIN" if c.isascii() else script(c)] += n
    if not counts:
        return "none"
    kana = counts["HIRAGANA"] + counts["KATAKANA"]
    if kana >= 0.05 * sum(counts.values()) and kana + counts["CJK"] >= max(counts.values()):
        return "kana"
    top = counts.most_common(1)[0][0]
    return "han" if top == "CJK" else top.lower()
