"""The several-rank section of docs/performance.md, rendered from committed results:
a run with interleaved loop segments and one from before them (no first-save column)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402


def _rows(text: str) -> dict[str, list[str]]:
    """The issue-11 table's cells by world size."""
    lines = text.splitlines()
    head = next(
        i for i, line in enumerate(lines) if line.startswith("| ranks | blocking s | snapshot s")
    )
    rows = {}
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_interleaved_segments_give_the_ratio_of_their_medians() -> None:
    raw = json.loads((BENCH / "results" / "dist-20261128T074116Z.json").read_text())
    rows = _rows("\n".join(report.dist_section(raw)))
    assert set(rows) == {"1", "2", "4"}
    for w, cells in rows.items():
        loop = raw["dist"]["worlds"][w]["loop"]
        base = statistics.median(loop["plain_segments_s"])
        ck = statistics.median(loop["checkpointed_segments_s"])
        assert cells[-2] == f"{100 * round(base / ck, 4):.1f} %"
        assert cells[-1] == "—"  # no overlap segments before 2026-11-28T14
        assert cells[8] == report._s(loop["first_save_s"])  # the first save, apart
        assert cells[2] == "—"  # no snapshot time recorded before 2026-11-28T14


def test_a_run_from_before_the_segments_still_renders() -> None:
    raw = json.loads((BENCH / "results" / "vm-20261127T093343Z.json").read_text())
    rows = _rows("\n".join(report.dist_section(raw)))
    assert rows and all(cells[8] == "—" for cells in rows.values())  # no first-save figure


def test_the_background_persist_lists_every_ranks_file_as_its_own() -> None:
    """Runs before the fix named rank 0's file only; the others' files went to *other*."""
    raw = json.loads((BENCH / "results" / "dist-20261128T074116Z.json").read_text())
    text = "\n".join(report.dist_section(raw))
    row = next(
        line
        for line in text.splitlines()
        if line.startswith('| 4 | resumable `save()`, `persist="process"')
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7] == "32.1 / 32.1 / 32.1 / 32.1"  # MiB per rank
    assert float(cells[8]) < 1000  # other KiB: the manifest alone
