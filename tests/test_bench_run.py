"""`benchmarks/run.py`'s core phases on a small state: the cold restores of resumable
and the fastest peer timed again in rounds beside the cold read floor (`run.cold_ab`),
and the page it renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import floors  # noqa: E402
import goals  # noqa: E402
import run  # noqa: E402


def test_core_phases_time_the_cold_restore_again_in_pairs(tmp_path: Path) -> None:
    code = run.main(
        [
            "--quick",
            "--size-mb=8",
            "--reps=2",
            "--cold-ab-pairs=3",
            "--no-dlrover",
            "--no-dcp-process",
            *(f"--no-{p}" for p in run_phases()),
            f"--bench-dir={tmp_path / 'bench'}",
            f"--results-dir={tmp_path / 'results'}",
            f"--docs={tmp_path / 'performance.md'}",
        ]
    )
    assert code == 0
    (result,) = (tmp_path / "results").glob("*.json")
    out = json.loads(result.read_text())
    page = (tmp_path / "performance.md").read_text()
    if out["restore_page_cache"] != ["cold", "warm"]:  # no permission to drop the cache
        assert "restore_cold_ab" not in out
        assert floors.drop_page_cache() is False
        return
    ab = out["restore_cold_ab"]
    peers = {
        name: m["restore_cold"]["median"]
        for name, m in out["methods"].items()
        if name != "resumable" and isinstance(m.get("restore_cold"), dict)
    }
    assert ab["peer"] == min(peers, key=lambda n: peers[n])  # the round-robin's fastest
    assert ab["pairs"] == 3 and ab["restored_equal"] is True
    assert len(ab["resumable"]["samples"]) == len(ab["peer_restore"]["samples"]) == 3
    # the plain read of as many bytes in the same rounds, each from the same cold start
    assert len(ab["read_floor"]["samples"]) == 3 and ab["cold_start"].startswith("flush")
    assert "unrelated file" in out["restore_cold_start"]
    row = next(r for r in goals.goals(out) if r["path"].startswith("cold restore"))
    assert row["measured"] == ab["ratio_of_medians"]
    assert "Cold restores timed again" in page


def run_phases() -> list[str]:
    return ["e2e", "s3", "cloud", "dist", "ds", "mcore", "hf", "data", "small", "incr", "scale"]
