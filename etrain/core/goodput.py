"""Where a run's wall time went, from its records: the productive time of the steps it kept, and the badput by
cause, as Google's goodput accounting splits it (scheduling, runtime, program): the start-up, a lost member's
detection, the group's re-forming, steps redone after a rollback or a resume, checkpoint stalls inside steps,
evaluations, and what no record accounts for (the gaps between steps: the control path, a slow refill's share of
the cores shows in the steps themselves). `etrain report` and bench/chaos.py show it."""

from __future__ import annotations

import bisect

CAUSES = ("start_up", "detection", "re_forming", "redone_steps", "checkpoint_stall", "evaluation", "unaccounted")
REWINDS = ("resume", "rollback", "outer")


def time_split(records: list[dict]) -> dict:
    """{wall_s, productive_s, goodput, badput_s: {cause: seconds}} of a run's records (metrics.jsonl, in order).
    Wall time is each driver's session, from its `etrain train` (a start record's time less its total) to its last
    record: the time between a crash and its resume is no one's."""
    badput = dict.fromkeys(CAUSES, 0.0)
    kept: list[dict] = []
    begins = sorted(r["time"] - r["total_s"] for r in records if r.get("kind") == "start")
    ends = list(begins)  # each session's last record (a resume's records come before its start record)
    for r in records:
        kind = r.get("kind")
        if "time" in r and (at := bisect.bisect_right(begins, r["time"])):
            ends[at - 1] = max(ends[at - 1], r["time"])
        if kind == "start":
            badput["start_up"] += r["total_s"] - r["phases"].get("first_step", 0.0)
        elif kind == "train" and r.get("step_time_s") is not None:
            kept.append(r)
        elif kind in REWINDS:  # the steps after the one it went back to are redone: their first time was lost
            redone = [t for t in kept if t["step"] > r["step"]]
            badput["redone_steps"] += sum(t["step_time_s"] for t in redone)
            kept = [t for t in kept if t["step"] <= r["step"]]
            badput["re_forming"] += (r.get("load_s") or 0.0) if kind != "resume" else 0.0
        elif kind == "membership" and r.get("reason") != "start":
            phases = r.get("phases", {})
            badput["detection"] += phases.get("detect", 0.0)
            badput["re_forming"] += sum(phases.get(p, 0.0) for p in ("acquire", "migrate", "reform"))
        elif kind == "eval":
            badput["evaluation"] += r.get("eval_s") or 0.0
    badput["checkpoint_stall"] = sum(t.get("checkpoint_stall_s") or 0.0 for t in kept)
    productive = sum(t["step_time_s"] for t in kept) - badput["checkpoint_stall"]
    wall = sum(end - begin for begin, end in zip(begins, ends))
    badput["unaccounted"] = wall - productive - sum(v for k, v in badput.items() if k != "unaccounted")
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall if wall > 0 else None,
        "badput_s": badput,
    }
