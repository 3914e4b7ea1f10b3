"""``workbench report RUN_DIR``: write a run's report page (:mod:`workbench.viz.report`)."""

from __future__ import annotations

import argparse


def _report(args: argparse.Namespace) -> int:
    from workbench.viz.report import write_report

    print(write_report(args.run_dir, args.output))
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="write a run's report.html (what ran, errors per family, time per rank, packing)")
    p.add_argument("run_dir", help="a run directory (e.g. runs/demo)")
    p.add_argument("-o", "--output", help="where to write it (default: RUN_DIR/report.html)")
    p.set_defaults(func=_report)
