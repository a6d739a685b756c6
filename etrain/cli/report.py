"""`etrain report`: a run's plots (loss, throughput with scale events, data wait, world size, grad norms) as PNG and
HTML (etrain/driver/report.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from etrain.cli.options import command


def add_command(sub) -> None:
    p = command(
        sub,
        "report",
        cmd_report,
        "plots of a run (loss, throughput with scale events, data wait, world size, grad norms): PNG + HTML",
        "etrain report runs/20261129-123456",
    )
    p.add_argument("run", help="the run directory")
    p.add_argument("--out", help="where to write the plots (none: RUN/report)")


def cmd_report(args, started_at: float) -> int:
    from etrain.driver.report import write_report

    report = write_report(Path(args.run), Path(args.out) if args.out else None)
    print(json.dumps(report["summary"], indent=1))
    print(f"report: {report['html']}", file=sys.stderr)
    for name, path in report["plots"].items():
        print(f"{name}: {path}", file=sys.stderr)
    return 0
