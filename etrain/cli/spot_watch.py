"""`etrain spot-watch`: on a spot worker node, the interruption notice turned into a Ray drain
(etrain/driver/spot.py; cluster.yaml runs it)."""

from __future__ import annotations

import json

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "spot-watch",
        cmd_spot_watch,
        "on a spot worker node: turn the interruption notice into a Ray drain (cluster.yaml runs it)",
        "etrain spot-watch --every 5",
    )
    p.add_argument("--imds", default="http://169.254.169.254", help="instance metadata endpoint")
    p.add_argument("--node-id", help="node to drain; none: the node this runs on")
    p.add_argument("--every", type=float, default=5.0, help="seconds between polls (AWS gives 120 s notice)")


def cmd_spot_watch(args, started_at: float) -> int:
    from etrain.driver.spot import watch

    print(json.dumps(watch(args.imds, args.node_id, args.every)))
    return 0
