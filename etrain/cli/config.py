"""`etrain config`: the resolved config, and the model's size and memory per worker (no Ray, no torch)."""

from __future__ import annotations

import os
import sys

from etrain.cli.options import add_config, command


def add_command(sub) -> None:
    p = command(
        sub,
        "config",
        cmd_config,
        "print the resolved config, and the model's size and memory per worker",
        "etrain config --config small --set optim.lr=1e-3",
    )
    add_config(p)


def cmd_config(args, started_at: float) -> int:
    from etrain.core.config import load_config

    cfg = load_config(args.config, args.set)
    print(cfg.to_yaml(), end="")
    need, here = cfg.worker_memory(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    par = cfg.parallel
    layout = f" in a layout of tp {par.tp} × pp {par.pp} × shard {par.shard}" if par.ranks > 1 else ""
    parts = ", ".join(f"{part} {size / 2**30:,.2f}" for part, size in cfg.rank_memory().items() if size)
    print(
        f"model: {cfg.model.param_count():,} parameters; about {need / 2**30:,.2f} GiB per worker{layout} "
        f"({parts} GiB; activations of one micro-batch)",
        file=sys.stderr,
    )
    if need > here and not cfg.cluster.gpus_per_worker:
        print(f"warning: that is more than this machine's {here / 2**30:,.1f} GiB of memory", file=sys.stderr)
    return 0
