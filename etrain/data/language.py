"""The language-consistency check of `etrain prepare` (seed 002's cleaning): how much of a document is written in
an allowed language.

py3langid (langid.py's naive Bayes model over byte n-grams, 97 languages) ships its model inside the package, so
nothing is downloaded at run time, and classifies thousands of documents a second on one core. lingua was the
other candidate: more accurate on short text, but a 96 MB wheel whose high-accuracy models take about a GB of
memory in every Ray Data worker; documents here are paragraphs and longer, where langid's accuracy holds.

A document is judged paragraph by paragraph, so a mixed-language one is kept only when at least
`prepare.language_min_share` of its characters are in an allowed language.
"""

from __future__ import annotations

MIN_CHUNK = 80  # characters: a shorter paragraph says little about its language, so it joins the next one


def known() -> set[str]:
    """The language codes the model tells apart."""
    from py3langid.langid import _get_identifier

    return set(_get_identifier().nb_classes)


def chunks(text: str) -> list[str]:
    """Paragraphs (lines), joined until each is at least MIN_CHUNK characters; the short rest joins the last."""
    out, current = [], ""
    for line in text.split("\n"):
        current = f"{current}\n{line}" if current else line
        if len(current) >= MIN_CHUNK:
            out.append(current)
            current = ""
    if current.strip():
        if out:
            out[-1] += "\n" + current
        else:
            out.append(current)
    return out


def languages_of(text: str) -> dict[str, int]:
    """Characters per detected language (ISO 639-1), paragraph by paragraph."""
    from py3langid import classify  # its model loads on first use, in the worker that needs it

    found: dict[str, int] = {}
    for chunk in chunks(text):
        lang, _ = classify(chunk)
        found[lang] = found.get(lang, 0) + len(chunk)
    return found


def verdict(text: str, allowed: list[str], min_share: float) -> str | None:
    """None when at least `min_share` of the text is in an allowed language; else why not, for the quarantine."""
    found = languages_of(text)
    total = sum(found.values())
    if not total:
        return None
    share = sum(n for lang, n in found.items() if lang in allowed) / total
    if share >= min_share:
        return None
    mix = ", ".join(f"{lang} {n / total:.0%}" for lang, n in sorted(found.items(), key=lambda kv: -kv[1])[:3])
    return f"{share:.0%} in {'/'.join(allowed)} (below {min_share:.0%}): {mix}"


def check(doc: dict, allowed: list[str], min_share: float) -> dict:
    """An inspected document: a kept one in no allowed language is rejected as `language`, its text dropped (as
    every rejected document's is)."""
    if doc["reason"] is None and (why := verdict(doc["text"], allowed, min_share)) is not None:
        doc.update(reason="language", detail=why, text="")
    return doc
