"""Byte-level tokenizer: no vocabulary file, no download, every byte is a token.

Token 0 (NUL, which normalised text never contains) separates documents, so
tokens fit in uint8 and a shard stores one byte per token.
"""

from __future__ import annotations

import numpy as np

EOT = 0
VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    data = text.replace("\x00", "").encode("utf-8", errors="replace")
    return np.frombuffer(data, dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if t != EOT).decode("utf-8", errors="replace")
