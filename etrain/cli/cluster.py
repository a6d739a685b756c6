"""`etrain cluster`: a Ray head on this machine, with token authentication and the autoscaler on Ray's fake
multi-node provider (etrain/driver/local_cluster.py)."""

from __future__ import annotations

import sys

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "cluster",
        cmd_cluster,
        "a Ray head on this machine, with token authentication and the autoscaler on Ray's fake multi-node provider",
        'etrain cluster up && eval "$(etrain cluster env)"',
        "ray job submit -- etrain train --config tiny --set cluster.max_workers=2",
        "etrain cluster down",
    )
    p.add_argument(
        "action",
        choices=["up", "env", "down"],
        help="start it, print the exports its clients need, or stop it (its processes only, never `ray stop`)",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=1,
        help="CPUs of the head (the autoscaler adds 2-CPU nodes: etrain/driver/local_cluster.yaml)",
    )
    p.add_argument("--no-autoscaler", action="store_true", help="a plain head, without the fake multi-node autoscaler")
    p.add_argument(
        "--reachable",
        action="store_true",
        help="listen on this machine's network address too (default: 127.0.0.1 alone); its Prometheus metrics "
        "endpoints take no token",
    )


def cmd_cluster(args, started_at: float) -> int:
    from etrain.driver import local_cluster

    if args.action == "up":
        cluster = local_cluster.up(args.cpus, fake=not args.no_autoscaler, reachable=args.reachable)
        print(local_cluster.exports(cluster))
        print(
            f"Ray head at {cluster.address} (dashboard {cluster.dashboard}); its clients need the variables above: "
            f'eval "$(etrain cluster env)"; stop it with `etrain cluster down`',
            file=sys.stderr,
        )
    elif args.action == "env":
        print(local_cluster.exports(local_cluster.current()))
    else:
        cluster = local_cluster.down()
        print(f"stopped the Ray head at {cluster.address} and its nodes", file=sys.stderr)
    return 0
