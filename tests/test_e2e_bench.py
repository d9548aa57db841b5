"""`benchmarks/training.py`: the training loop's kinds of segments (no checkpoints, a
snapshot every step, the copy floor and the guarded floor timed in the loop), on a small
MLP."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import training  # noqa: E402


def test_the_loop_times_its_copy_floor_after_each_step_of_segments_of_its_own(
    tmp_path: Path,
) -> None:
    out = training.run_e2e(tmp_path, steps=4, rounds=2, width=32, depth=1, batch=8)
    floor = out["floor_copy_s"]
    assert len(floor["samples"]) == 2 * 4 and floor["min"] == min(floor["samples"]) > 0
    assert len(out["floor_segment_s"]["samples"]) == 2
    base = out["baseline_segment_s"]["median"]
    assert out["floor_throughput_ratio"] == base / out["floor_segment_s"]["median"]
    # the checkpointed segments took a snapshot at every step
    assert len(out["snapshot_blocking_s"]["samples"]) == 2 * 4
    # ... and the guarded floor's segments took its snapshot after every step of theirs
    guarded = out["guarded_call_s"]
    assert len(guarded["samples"]) == 2 * 4 and guarded["min"] == min(guarded["samples"]) > 0
    assert out["guarded_throughput_ratio"] == base / out["guarded_segment_s"]["median"]
    assert not list(Path("/dev/shm").glob("resumable-e2e-*"))  # its slots removed
    # after the rounds: maybe_save and the copy, right after a step and straight after,
    # on alternate steps (2 * steps of them), a pair in which a persist started left out
    cold_warm = out["cold_warm"]
    assert set(cold_warm) == {
        "maybe_save_cold_s",
        "maybe_save_warm_s",
        "floor_cold_s",
        "floor_warm_s",
    }
    assert len(cold_warm["floor_cold_s"]["samples"]) == len(cold_warm["floor_warm_s"]["samples"])
    assert len(cold_warm["floor_cold_s"]["samples"]) == 4
    assert 1 <= len(cold_warm["maybe_save_cold_s"]["samples"]) <= 4
    for got in cold_warm.values():
        assert got["median"] > 0 and len(got["samples"]) <= 4


def test_overlap_mode_has_no_floor_segments(tmp_path: Path) -> None:
    out = training.run_e2e(tmp_path, steps=3, rounds=1, width=32, depth=1, batch=8, overlap=True)
    assert "floor_copy_s" not in out and "floor_segment_s" not in out
    assert "guarded_call_s" not in out and "cold_warm" not in out
