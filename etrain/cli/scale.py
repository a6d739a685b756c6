"""`etrain scale`: a running job resized at its next step boundary."""

from __future__ import annotations

import json

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "scale",
        cmd_scale,
        "resize a running job at its next step boundary",
        "etrain scale runs/20261129-123456 --workers 3   (or --replicas 2 with a layout: parallel.tp, pp or shard > 1)",
    )
    p.add_argument("run", help="the run directory (or its name)")
    wanted = p.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--workers", type=int, help="workers wanted (with a layout, a multiple of tp × pp × shard)")
    wanted.add_argument("--replicas", type=int, help="model replicas wanted, tp × pp × shard workers each")


def cmd_scale(args, started_at: float) -> int:
    from etrain.driver import api

    print(json.dumps(api.scale(args.run, args.workers, args.replicas)))
    return 0
