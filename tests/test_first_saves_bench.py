"""The first-saves benchmark (``benchmarks/first_saves.py``) at a toy size: every
variant runs whole launches, its results hold a row per save and the launch's total,
and its table renders. A smoke test of the harness, not a timed test: no figure is
checked."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import first_saves  # noqa: E402


def test_every_variant_runs_and_reports_each_save() -> None:
    out = first_saves.run(1, mib=0.25, every=2, log=lambda _: None)
    assert set(out["summary"]) == set(first_saves.VARIANTS)
    for variant in ("wait", "wait-torch", "wait-all"):  # every due persist starts: three saves
        rows = out["summary"][variant]
        assert [r["save"] for r in rows] == [1, 2, 3, "all"], rows
        assert all(r["block_s"] >= r["snapshot_s"] > 0 for r in rows)
    assert out["summary"]["skip"][0]["save"] == 1
    table = first_saves.table(out)
    assert table.count("\n") == 2 + sum(len(r) for r in out["summary"].values()) - 1
