import random

import pytest

from etrain.core.config import load_config
from etrain.data import dedup, quality

CFG = load_config("tiny").prepare


def test_normalise_unifies_unicode_and_whitespace():
    assert quality.normalise("Cafe\u0301  au\tlait \r\n\r\n\r\n\r\nnext\x07 line  ") == "Café au lait\n\nnext line"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("word " * 5, "too_short"),
        ("#$%^ 1234 &*() 5678 " * 40, "symbols_digits"),
        ("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "word_length"),
        ("buy now and save big today\n" * 30, "repeated_lines"),
        ("one two three four five six " * 30, "repeated_ngrams"),
        (
            "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches in the old "
            "town hall near the river",
            None,
        ),
    ],
)
def test_filters_name_the_reason(text, reason):
    assert quality.reject_reason(quality.normalise(text), CFG) == reason


def test_binary_and_bad_utf8_are_caught():
    assert quality.decode(b"\x00\x01\x02abc") == (None, "binary")
    assert quality.decode("café".encode("latin-1")) == (None, "invalid_utf8")
    assert quality.decode("café".encode()) == ("café", None)


@pytest.mark.parametrize("changed", [0, 3, 10, 30, 80])
def test_minhash_estimates_jaccard(changed):
    rng = random.Random(changed)
    words = [f"w{rng.randrange(10**6)}" for _ in range(400)]
    other = list(words)
    for i in rng.sample(range(400), changed):
        other[i] = f"x{i}"
    a, b = " ".join(words), " ".join(other)
    sa, sb = set(dedup.shingles(a, 5).tolist()), set(dedup.shingles(b, 5).tolist())
    truth = len(sa & sb) / len(sa | sb)
    keys = dedup.permutations(256)
    estimate = dedup.similarity(dedup.signature(a, 5, keys), dedup.signature(b, 5, keys))
    assert abs(estimate - truth) < 0.1  # ~3 standard errors at 256 keys


def test_lsh_bands_sit_at_the_threshold():
    bands, rows = dedup.bands_for(0.85, 128)
    assert bands * rows <= 128 and 0.75 < (1 / bands) ** (1 / rows) <= 0.85


def test_clusters_keep_the_smallest_id():
    assert dedup.clusters([(5, 9), (9, 2), (7, 8)]) == {5: 2, 9: 2, 2: 2, 7: 7, 8: 7}
