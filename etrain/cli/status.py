"""`etrain status`: a live view of a job, read from the status.json its coordinator keeps in the run directory (no
Ray needed, and an ended run shows its last state), or asked of the Ray cluster by the job's name."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from etrain.cli.options import command
from etrain.core.errors import UsageError


def add_command(sub) -> None:
    p = command(
        sub,
        "status",
        cmd_status,
        "a live view of a job, running or ended (or, without RUN, the jobs running on this cluster)",
        "etrain status",
        "etrain status runs/20261129-123456",
        "etrain status runs/20261129-123456 --json",
    )
    p.add_argument(
        "run", nargs="?", help="the run directory (read from its status.json), or a running job's name (asked of Ray)"
    )
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--json", action="store_true", help="print the status as JSON once (for scripts)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between refreshes of the live view")


def cmd_status(args, started_at: float) -> int:
    """RUN, a run directory: read from the status.json its coordinator keeps (no Ray needed, and a finished
    or failed run shows its last state). A run's name, or no RUN: asked of the Ray cluster."""
    if args.every <= 0:
        raise UsageError(f"--every must be positive, got {args.every}")
    if args.run is None:
        from etrain.driver import api

        names = api.runs()
        print(
            "\n".join(_status_line(api.status(n)) for n in names)
            if names
            else "no etrain job is running on this Ray cluster"
        )
        return 0
    live = not args.once and not args.json
    clear = "\033[H\033[J" if live and sys.stdout.isatty() else ""
    while True:
        st = _read_status(args.run)
        print(clear + (json.dumps(st, indent=1) if args.json else _status_text(st)), flush=True)
        if not live or st["phase"] in ("finished", "failed"):
            return 0
        time.sleep(args.every)


def _read_status(run: str) -> dict:
    path = Path(run) / "status.json"
    if path.is_file():
        from etrain.core.records import read_json

        st = read_json(path)
        st["updated_s_ago"] = time.time() - st["updated"]
        return st
    if Path(run).is_dir():
        raise UsageError(
            f"{run} has no status.json: its job has not started a coordinator (the driver failed before it, or it "
            f"is starting now); `etrain report {run}` summarises its records"
        )
    from etrain.driver import api

    return api.status(run)


def _status_line(st: dict) -> str:
    loss = f"{st['loss']:.3f}" if st["loss"] is not None else "-"
    progress = f"step {st['step']}/{st['total_steps']} loss {loss} workers {st['world_size']}"
    return f"{st['run']}: {st['phase']} {progress} ETA {_duration(st['eta_s'])}"


def _status_text(st: dict) -> str:
    """What `etrain status RUN` shows: progress, model, throughput, membership, last checkpoint, members."""
    lines = _progress_lines(st)
    if st.get("communication"):
        lines.append(f"  communication: {st['communication']}")
    health = st.get("health") or {"nodes": {}, "lemons": []}
    node = _node_names(
        [*st["draining_nodes"], *health["nodes"], *health["lemons"], *(m["node"] for m in st["members"])]
    )
    lines += _layout_lines(st.get("layout"))
    if st["draining_nodes"]:
        lines.append(f"  draining nodes (preemption or health): {', '.join(map(node, st['draining_nodes']))}")
    lines += _health_lines(health, node)
    lines += _member_lines(st["members"], node)
    return "\n".join(lines)


def _progress_lines(st: dict) -> list[str]:
    """The run and its phase; step, loss and speed; the workers; the last checkpoint."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    done = st["step"] / st["total_steps"]
    ckpt = st["last_checkpoint"]
    ended = {"finished": "  (the job has ended)", "failed": f"  (the job failed: {st.get('failure')})"}.get(
        st["phase"], ""
    )
    quiet = st.get("updated_s_ago", 0) > 30 and not ended
    return [
        f"run {st['run']}  ({st['run_dir']}){ended}"
        + (f"  (no update for {_duration(st['updated_s_ago'])}: is its driver alive?)" if quiet else ""),
        f"  {st['phase']:<13} step {st['step']}/{st['total_steps']} ({done:.0%})  elapsed {_duration(st['elapsed_s'])} "
        f" ETA {_duration(st['eta_s'])}",
        f"  loss {num(st['loss'], '.4f')}  eval loss {num(st['eval_loss'], '.4f')}  tokens/s "
        f"{num(st['tokens_per_s'], ',.0f')}  MFU {num(st['mfu'], '.1%')}",
        f"  workers {st['world_size']} (wanted {st['wanted']}{', autoscaling' if st['autoscaling'] else ''})  warm "
        f"pool {st['warm_pool_ready']} ready"
        f"  recoveries {st['recoveries']}  group generation {st['generation']}  sync {st['comm']}",
        "  last checkpoint: " + (f"step {ckpt['step']} ({ckpt['level']}) {ckpt['path']}" if ckpt else "none yet"),
    ]


def _layout_lines(lay: dict | None) -> list[str]:
    """A laid-out run's replicas and their shape; nothing for plain data parallelism."""
    if not lay or lay["ranks"] <= 1:
        return []
    pipeline = f", {lay['schedule']} over {lay['microbatches']} micro-batches" if lay["pp"] > 1 else ""
    shape = f"tp {lay['tp']} × pp {lay['pp']} × shard {lay.get('shard', 1)} = {lay['ranks']} ranks"
    return [f"  layout: {lay['replicas']} replica(s) of {shape}{pipeline}"]


def _member_lines(members: list[dict], node: Callable[[str | None], str]) -> list[str]:
    """One line per rank: its node and process, its place in a layout, its speed."""
    lines = []
    for m in members:
        speed = f"{m['speed']:.1f} samples/s" if m["speed"] else "speed not measured yet"
        place = ""
        if "replica" in m:
            place = f"  replica {m['replica']} stage {m['stage']} shard {m['shard']} tp_rank {m['tp_rank']}"
        lines.append(f"    rank {m['rank']}: node {node(m['node'])} pid {m['pid']}{place}  {speed}")
    return lines


def _node_names(nodes: list[str | None]) -> Callable[[str | None], str]:
    """Node ids as short as tells them apart, 8 characters at least, as git shortens commits: Ray's fake nodes (and
    some real ones) share their first 8."""
    ids = sorted({n for n in nodes if n})
    common = max((len(os.path.commonprefix(pair)) for pair in zip(ids, ids[1:])), default=0)
    width = max(8, common + 1)
    return lambda n: n[:width] if n else "?"


def _health_lines(health: dict, node: Callable[[str | None], str]) -> list[str]:
    """Each node's failure risk and its reasons, worst first; the lemons."""
    lines = []
    for name, h in sorted(health["nodes"].items(), key=lambda kv: -kv[1]["risk"]):
        why = "; ".join(h["reasons"]) or "no signal"
        cool = f", cooling down {_duration(h['cooldown_s'])}" if h.get("cooldown_s") else ""
        drill = " [synthetic]" if h["synthetic"] else ""
        lines.append(f"  node {node(name)} risk {h['risk']:.2f} {h['state']}{cool}{drill}: {why}")
    if health["lemons"]:
        lines.append(f"  lemons (drained repeatedly): {', '.join(map(node, health['lemons']))}")
    return lines


def _duration(seconds: float | None) -> str:
    from tqdm import tqdm

    return "-" if seconds is None else tqdm.format_interval(seconds)
