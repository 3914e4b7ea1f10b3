"""``workbench report RUN_DIR``: write a run's report page (:mod:`workbench.viz.report`)."""

from __future__ import annotations

import argparse
import sys
import warnings


def _report(args: argparse.Namespace) -> int:
    from workbench.viz.report import ReportInputWarning, write_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReportInputWarning)
        path = write_report(args.run_dir, args.output)
    for w in caught:  # one line per input file the report left out; other warnings as usual
        if issubclass(w.category, ReportInputWarning):
            print(f"workbench: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="write a run's report.html (what ran, errors per family, time per rank, packing)")
    p.add_argument("run_dir", help="a run directory (e.g. runs/demo)")
    p.add_argument("-o", "--output", help="where to write it (default: RUN_DIR/report.html)")
    p.set_defaults(func=_report)
