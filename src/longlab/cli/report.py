"""``longlab report DIR``: tables and plots from a results directory."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_report_arguments", "cmd_report"]


def add_report_arguments(sub: Any) -> None:
    r = sub.add_parser("report", help="tables and plots from a results directory")
    r.add_argument("dir", metavar="DIR", help="results directory (its results.sqlite is only read)")
    r.add_argument("--no-html", action="store_true")
    r.add_argument("--baseline", default="full", help="recipe the difference tables subtract (default: full)")
    r.add_argument(
        "--all-configs", action="store_true",
        help="count every row, also older ones of the same sample and recipe under other config hashes",
    )
    r.add_argument("--report-dir", metavar="OUT", help="write report.md and the plots here (default: DIR)")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from ..eval.report import main as report_main

    return report_main(
        args.dir, html=not args.no_html, baseline=args.baseline, all_configs=args.all_configs,
        report_dir=args.report_dir,
    )
