"""`benchmarks/ab_shared_copy.py`, short: both ways measured at every width, in one run."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from resumable.snapshot import SHARED_COPY_MIN_BYTES, copy_threads

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(copy_threads() < 2, reason="one copy thread here: nothing to compare")
def test_the_ab_records_both_ways_at_every_width(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "ab_shared_copy.py"),
            *("--widths", "32", "64", "--rounds", "3", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["threshold_mib"] == SHARED_COPY_MIN_BYTES / 2**20
    assert got["copy_threads"] == copy_threads() and got["rounds"] == 3
    assert [w["width"] for w in got["widths"]] == [32, 64]
    for w in got["widths"]:
        assert set(w["samples_ms"]) == {"one", "shared"}
        assert all(len(v) == 3 and min(v) > 0 for v in w["samples_ms"].values())
        assert w["state_mib"] > 0 and w["step_ms"] > 0
        for way in ("one", "shared"):
            median = statistics.median(w["samples_ms"][way])
            assert w["maybe_save_ms"][way]["median"] == pytest.approx(median, abs=1e-3)
        # the ratio of the unrounded medians: the samples' (to 0.1 µs), not the medians'
        # (to 1 µs, which moves the ratio of two 0.2 ms medians by up to 0.005)
        ratio = statistics.median(w["samples_ms"]["shared"]) / statistics.median(
            w["samples_ms"]["one"]
        )
        assert w["shared_over_one"] == pytest.approx(ratio, rel=2e-3, abs=1e-3)
    assert "| 64 |" in done.stdout  # the table
