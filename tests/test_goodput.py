"""A run's wall time split into productive step time and badput by cause (etrain/core/goodput.py), on records
drawn from a seed: every second is someone's, each cause is the records' own figure, and a step redone after a
rollback or a resume counts once as productive and once as redone."""

from __future__ import annotations

import random

import pytest

from etrain.core.goodput import CAUSES, time_split


def drawn_run(seed: int) -> tuple[list[dict], dict]:
    """Two driver sessions (a crash between them), each with steps, evaluations, recoveries and a rollback drawn
    at random; and the split they must give, summed as the records are written."""
    rng = random.Random(seed)
    records, expected = [], dict.fromkeys(CAUSES, 0.0)
    productive, wall, now, step = 0.0, 0.0, 1_000.0, 0
    for session in range(2):
        if session:  # down for an hour (no one's time); the new driver's resume record comes before its start's
            now += 3_600
            records.append({"kind": "resume", "step": step, "load_s": 0.7, "time": now})
        start_total, first = rng.uniform(2, 9), rng.uniform(0.1, 1)
        now += start_total
        begun = now - start_total
        records.append({"kind": "start", "step": step, "phases": {"load": 1.0, "first_step": first},
                        "total_s": start_total, "time": now})  # fmt: skip
        expected["start_up"] += start_total - first
        done: list[dict] = []
        for _ in range(rng.randint(5, 12)):
            step += 1
            took, stall = rng.uniform(0.1, 1), rng.choice([0.0, rng.uniform(0, 0.05)])
            now += took
            done.append(r := {"kind": "train", "step": step, "step_time_s": took, "checkpoint_stall_s": stall,
                              "time": now})  # fmt: skip
            records.append(r)
            if rng.random() < 0.2:
                detect, acquire, reform = rng.uniform(0.1, 1), rng.uniform(0, 1), rng.uniform(0, 0.3)
                now += detect + acquire + reform
                phases = {"detect": detect, "acquire": acquire, "reform": reform, "first_step": 0.3}
                records.append({"kind": "membership", "reason": "recover", "step": step, "phases": phases,
                                "time": now})  # fmt: skip
                expected["detection"] += detect
                expected["re_forming"] += acquire + reform
            if rng.random() < 0.2:
                took = rng.uniform(0.5, 2)
                now += took
                records.append({"kind": "eval", "step": step, "eval_loss": 3.0, "eval_s": took, "time": now})
                expected["evaluation"] += took
            if rng.random() < 0.15 and step > 2:  # back to a drawn earlier step: the steps since, lost
                back, load = rng.randint(max(done[0]["step"] - 1, step - 4), step - 1), rng.uniform(0.1, 0.5)
                now += load
                records.append({"kind": "rollback", "step": back, "load_s": load, "time": now})
                lost = [d for d in done if d["step"] > back]
                expected["redone_steps"] += sum(d["step_time_s"] for d in lost)
                expected["re_forming"] += load
                done, step = [d for d in done if d["step"] <= back], back
        gap = rng.uniform(0, 0.5)  # the driver's own last moments
        now += gap
        records.append({"kind": "warning", "step": step, "text": "x", "time": now})
        wall += now - begun
        if session == 0 and done:  # the next driver's resume goes back to a step of this session
            cut = rng.randint(1, len(done))
            step = done[cut - 1]["step"]
            expected["redone_steps"] += sum(d["step_time_s"] for d in done[cut:])
            done = done[:cut]
        productive += sum(d["step_time_s"] - d["checkpoint_stall_s"] for d in done)
        expected["checkpoint_stall"] += sum(d["checkpoint_stall_s"] for d in done)
    expected["unaccounted"] = wall - productive - sum(v for k, v in expected.items() if k != "unaccounted")
    return records, {"wall_s": wall, "productive_s": productive, "badput_s": expected}


@pytest.mark.parametrize("seed", range(6))
def test_every_second_of_a_run_is_productive_or_a_named_cause_of_badput(seed):
    records, expected = drawn_run(seed)
    print(f"seed {seed}: {len(records)} records")
    split = time_split(records)
    assert split["wall_s"] == pytest.approx(expected["wall_s"])
    assert split["productive_s"] == pytest.approx(expected["productive_s"])
    for cause in CAUSES:
        assert split["badput_s"][cause] == pytest.approx(expected["badput_s"][cause], abs=1e-9), cause
    assert split["productive_s"] + sum(split["badput_s"].values()) == pytest.approx(split["wall_s"])
    assert split["goodput"] == pytest.approx(split["productive_s"] / split["wall_s"])


def test_a_run_without_a_start_record_has_no_wall_time_to_split():
    split = time_split([{"kind": "train", "step": 1, "step_time_s": 0.5, "time": 1.0}])
    assert split["wall_s"] == 0 and split["goodput"] is None
