"""Write ``tests/file_seconds.json``: each test file's seconds in a `make test` run.

`conftest.py` hands the files to pytest-xdist's workers longest first, so that no long file
starts last and keeps one worker busy after the others are done. The seconds come from a
JUnit XML report of a whole run on the machine the budget is kept on (of several reports, each
file's median: one run's file may have waited on something once, a compile, a busy disk)::

    .venv/bin/python -m pytest -q -m "not slow and not gpu" -n 3 --dist loadfile \\
        --junitxml=/tmp/tests.xml
    .venv/bin/python tests/file_seconds.py /tmp/tests.xml [build/test-report.xml ...]

A file missing from the table (a new one) runs after the files it holds; a stale table only
costs balance, never a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("file_seconds.json")


def main(reports: list[str]) -> None:
    runs: dict[str, list[float]] = defaultdict(list)
    for report in reports:
        seconds: dict[str, float] = defaultdict(float)
        for case in ET.parse(report).iter("testcase"):
            path = case.get("classname", "").replace(".", "/") + ".py"
            seconds[path] += float(case.get("time") or 0)
        for path, s in seconds.items():
            runs[path].append(s)
    table = {p: round(statistics.median(s), 1) for p, s in runs.items()}
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
