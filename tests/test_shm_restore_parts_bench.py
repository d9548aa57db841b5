"""The shared-memory restore breakdown (``benchmarks/shm_restore_parts.py``) at a toy
size: each restore takes the fused path (one checked copy timed inside each), and the
restore's own work is what is left of it. A smoke test of the harness, not a timed
test: no figure is checked against a bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import shm_restore_parts  # noqa: E402


def test_each_restore_is_split_into_its_checked_copy_and_its_own_work(tmp_path: Path) -> None:
    assert (
        shm_restore_parts.main(["--size-mb", "4", "--rounds", "2", "--results-dir", str(tmp_path)])
        == 0
    )
    [path] = tmp_path.glob("shm-restore-parts-*.json")
    out = json.loads(path.read_text())
    samples = out["samples"]
    assert len(samples["restore"]) == len(samples["checked_copy_in_restore"]) == 2
    assert all(r > c > 0 for r, c in zip(samples["restore"], samples["checked_copy_in_restore"]))
    assert out["median_s"]["own_work"] > 0 and out["tensors"] > 10
