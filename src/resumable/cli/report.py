"""``resumable report``: one self-contained HTML page (or ``--json``) of a run's history."""

from __future__ import annotations

import argparse
from pathlib import Path

from resumable.cli.common import (
    PROG,
    add_dir,
    open_root,
    print_json,
    rich_text,
    say_err,
    stdout_console,
)
from resumable.cli.progress import progress_bar
from resumable.export import write_atomic


def report_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument(
        "--out", default="report.html", help="the HTML file to write (default: report.html)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the figures as JSON instead of writing HTML"
    )


def run_report(args: argparse.Namespace) -> int:
    """One self-contained HTML page (or ``--json``) of the run's history."""
    from resumable.report import build_report
    from resumable.report_html import render_html

    storage = open_root(args)
    report = build_report(storage, progress=progress_bar)
    for warning in report.warnings:
        say_err(f"{PROG}: warning: {warning}")
    if args.json:
        print_json(report.to_json())
        return 0
    out = Path(args.out)
    write_atomic([render_html(report).encode()], out)
    what = (
        "nothing to report yet (no audit entries, no checkpoints)"
        if report.empty
        else (
            f"{len(report.launches)} launch(es), {len(report.saves)} save(s), "
            f"{len(report.checkpoints)} checkpoint(s)"
        )
    )
    stdout_console().print(rich_text(f"wrote {out}: {what}"))
    return 0
