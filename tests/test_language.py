"""The language-consistency check of `etrain prepare` (etrain/data/language.py): the verdict on a document, and the
counts of a real prepare run on Ray Data."""

from __future__ import annotations

import json

import pytest

from etrain.cli import main
from etrain.core.config import ConfigError, load_config
from etrain.data.language import chunks, verdict
from etrain.data.prepare import prepare

EN = [
    "The river rose through the night and by morning the low fields beside the old mill were under water, so the "
    "farmers moved their animals to the ridge.",
    "Most of the town had never seen a flood like it, and the school opened its hall to families whose houses "
    "stood too close to the bank.",
    "When the rain finally stopped, volunteers cleared the roads, checked on elderly neighbours and counted the "
    "cost of the damage.",
]
DE = [
    "Der Fluss stieg in der Nacht, und am Morgen standen die niedrigen Felder neben der alten Mühle unter Wasser, "
    "sodass die Bauern ihre Tiere auf den Hügel brachten.",
    "Die meisten Bewohner der Stadt hatten noch nie ein solches Hochwasser erlebt, und die Schule öffnete ihre "
    "Halle für Familien, deren Häuser zu nah am Ufer standen.",
    "Als der Regen endlich aufhörte, räumten Freiwillige die Straßen, sahen nach den älteren Nachbarn und zählten "
    "die Kosten des Schadens.",
]
FR = [
    "La rivière a monté pendant la nuit et, au matin, les champs bas près du vieux moulin étaient sous l'eau, si "
    "bien que les fermiers ont conduit leurs bêtes sur la colline.",
    "La plupart des habitants n'avaient jamais vu une telle crue, et l'école a ouvert sa salle aux familles dont "
    "les maisons se trouvaient trop près de la berge.",
    "Quand la pluie a enfin cessé, des bénévoles ont dégagé les routes, rendu visite aux voisins âgés et compté "
    "le coût des dégâts.",
]


def doc(*paragraphs: str) -> str:
    return "\n".join(paragraphs)


def test_a_document_in_an_allowed_language_is_kept_and_another_is_rejected_naming_its_language():
    assert verdict(doc(*EN), ["en"], 0.8) is None
    said = verdict(doc(*DE), ["en"], 0.8)
    assert said is not None and said.startswith("0% in en") and "de 100%" in said
    assert verdict(doc(*DE), ["en", "de"], 0.8) is None


def test_a_mixed_document_follows_the_share_threshold():
    mixed = doc(EN[0], DE[1], EN[2])  # about two thirds English, by characters
    assert verdict(mixed, ["en"], 0.8) is not None
    assert verdict(mixed, ["en"], 0.5) is None


def test_short_lines_are_judged_together():
    lines = ["Yes.", "No, not today.", "The river rose through the night and the fields were under water by morning."]
    assert chunks("\n".join(lines)) == ["\n".join(lines)]
    assert chunks("") == []


def test_a_language_code_the_check_cannot_take_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="ISO 639-1"):
        load_config(None, ["prepare.languages=[english]"])
    cfg = load_config(None, ["prepare.languages=[en, xx]"])
    with pytest.raises(ConfigError, match=r"does not know \['xx'\]"):
        prepare([str(tmp_path)], str(tmp_path / "out"), cfg, progress=False)


@pytest.mark.usefixtures("ray_session")
def test_prepare_rejects_the_documents_not_in_an_allowed_language_and_counts_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    corpus = {
        "en0": doc(*EN),
        "en1": doc(EN[2], EN[0], EN[1]),
        "en2": doc(EN[1], EN[2], EN[0]),
        "de0": doc(*DE),
        "de1": doc(DE[2], DE[0], DE[1]),
        "fr0": doc(*FR),
        "mixed_en_de": doc(EN[0], DE[1], DE[2]),  # a third English: rejected
        "mostly_en": doc(EN[0], EN[1], EN[2], EN[0].replace("river", "stream"), FR[0][:90]),  # kept at 0.8
    }
    for name, text in corpus.items():
        (src / f"{name}.txt").write_text(text)
    out = tmp_path / "out"
    args = ["prepare", str(src), "--out", str(out), "--set", "prepare.languages=[en]", "--set", "prepare.min_words=10"]
    assert main([*args, "--set", "prepare.near_dup_threshold=1.0", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rejected_by_reason"] == {"language": 4}
    assert report["documents_kept"] == 4 and report["documents_read"] == 8
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    rejected = {q["path"].rsplit("/", 1)[-1]: q["detail"] for q in quarantine}
    assert set(rejected) == {"de0.txt", "de1.txt", "fr0.txt", "mixed_en_de.txt"}
    assert "de " in rejected["de0.txt"] and "fr " in rejected["fr0.txt"]
