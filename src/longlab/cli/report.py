"""``longlab report DIR``: tables and plots from a results directory; ``longlab report --docs``: every
generated table and plot of the documentation site (``docs/``) from the committed result data."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_report_arguments", "cmd_docs", "cmd_report"]


def add_report_arguments(sub: Any) -> None:
    r = sub.add_parser("report", help="tables and plots from a results directory")
    r.add_argument("dir", metavar="DIR", nargs="?",
                   help="results directory (its results.sqlite is only read); with --docs: the repository "
                        "(default: the current directory)")
    r.add_argument("--no-html", action="store_true")
    r.add_argument("--baseline", default="full", help="recipe the difference tables subtract (default: full)")
    r.add_argument(
        "--all-configs", action="store_true",
        help="count every row, also older ones of the same sample and recipe under other config hashes",
    )
    r.add_argument("--report-dir", metavar="OUT", help="write report.md and the plots here (default: DIR)")
    r.add_argument("--docs", action="store_true",
                   help="rewrite the generated blocks and plots of docs/ from bench/results/ (make results)")
    r.add_argument("--check", action="store_true",
                   help="with --docs: write nothing; exit 1 naming each page that differs from its data")
    r.add_argument("--page", metavar="NAME",
                   help="with --docs: only this page (results/compression, families/position)")
    r.set_defaults(func=cmd_report)


def cmd_docs(args: argparse.Namespace) -> int:
    """``longlab report --docs [--check]``: regenerate (or compare) the site's generated blocks."""
    from ..eval.docs_tables import check_docs, generate_docs

    root = args.dir or "."
    if args.check:
        diffs = check_docs(root, page=args.page)
        for d in diffs:
            print(f"{d.page}: generated block(s) {', '.join(d.blocks)} differ from the data "
                  "(run `longlab report --docs` or `make results`)")
        if not diffs:
            print("every generated block matches its data")
        return 1 if diffs else 0
    diffs = generate_docs(root, page=args.page)
    for d in diffs:
        print(f"rewrote {d.page}: {', '.join(d.blocks)}")
    if not diffs:
        print("every generated block was current (plots rewritten)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ..errors import LonglabError
    from ..eval.report import main as report_main

    if args.docs:
        return cmd_docs(args)
    if args.check or args.page:
        raise LonglabError("--check / --page: only with --docs")
    if args.dir is None:
        raise LonglabError("report DIR: give a results directory (or --docs for the documentation site)")

    return report_main(
        args.dir, html=not args.no_html, baseline=args.baseline, all_configs=args.all_configs,
        report_dir=args.report_dir,
    )
