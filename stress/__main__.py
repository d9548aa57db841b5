"""``python -m stress --size small|full [--only NAME ...]``: run the campaigns, merge
their results into ``docs/reliability.json`` and rewrite ``docs/reliability.md``'s
generated blocks (`stress.report`). Exits 1 if a campaign failed, or a broken save path
went uncaught."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from stress import DONE
from stress.report import COMMAND, render

HERE = Path(__file__).resolve().parent.parent


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_one(name: str, size: str) -> dict[str, Any]:
    commit = _commit()  # the code that runs, not what HEAD is when it ends
    module = importlib.import_module(f"stress.{name}")
    result: dict[str, Any] = module.run(size)
    result["able_to_fail"] = module.able_to_fail()
    result["size"] = size
    result["command"] = COMMAND.format(size=size, name=name)
    result["when"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["commit"] = commit
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stress", description=__doc__)
    p.add_argument("--size", choices=("small", "full"), default="small")
    p.add_argument("--only", action="append", choices=DONE, help="a campaign (repeatable)")
    p.add_argument("--results", type=Path, default=HERE / "docs" / "reliability.json")
    p.add_argument("--doc", type=Path, default=HERE / "docs" / "reliability.md")
    p.add_argument(
        "--render", action="store_true", help="only rewrite the page from the stored results"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    results: dict[str, Any] = {}
    if args.results.exists():
        results = json.loads(args.results.read_text())
    if args.render:
        args.doc.write_text(render(args.doc.read_text(), results))
        return 0
    bad = []
    for name in args.only or DONE:
        print(f"stress: {name} ({args.size}) ...", file=sys.stderr, flush=True)
        r = run_one(name, args.size)
        results[name] = r
        print(
            f"stress: {name}: {r['trials']} trials, {r['failures']} failures, {r['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
        if r["failures"] or not all(v["failures"] for v in r["able_to_fail"].values()):
            bad.append(name)
        args.results.write_text(json.dumps(results, indent=1, default=str) + "\n")
        if args.doc.exists():
            args.doc.write_text(render(args.doc.read_text(), results))
    if bad:
        print(f"stress: failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
