"""`benchmarks/training.py`: the training loop's kinds of segments (no checkpoints, a
snapshot every step, the copy floor and the guarded floor timed in the loop), on a small
MLP."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import pytest  # noqa: E402
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


def test_without_overlap_the_kinds_take_turns_step_by_step_in_abba_order(tmp_path: Path) -> None:
    out = training.run_e2e(tmp_path, steps=4, rounds=2, width=32, depth=1, batch=8, persist_every=4)
    assert out["interleaved"] == "step"
    base, ckpt = out["baseline_segment_s"]["samples"], out["checkpointed_segment_s"]["samples"]
    assert len(base) == len(ckpt) == 2
    assert out["total_ratio"] == sum(base) / sum(ckpt)
    assert len(out["maybe_save_s"]["samples"]) == 2 * 4 and len(out["wait_s"]) == 2
    for kind in ("floor", "fused", "guarded"):
        assert out[f"{kind}_total_ratio"] == sum(base) / sum(out[f"{kind}_segment_s"]["samples"])
        assert out[f"{kind}_step_s"]["median"] > 0
    # persists started (every 4 steps from step 2): the steps beside each, one of each kind
    assert out["persists"] >= 1
    spill = out["persist_spill"]
    assert 1 <= spill["steps_beside"] <= 5 * out["persists"]
    assert spill["per_checkpointed_step_s"] == spill["excess_s"] / 8
    assert sum(spill["moved_s"].values()) == pytest.approx(spill["excess_s"])


class _Waits:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")


def test_the_order_of_the_kinds_alternates_each_step_and_each_round() -> None:
    log: list[str] = []
    kinds = [training._Kind("a", None)] + [
        training._Kind(n, lambda n=n: log.append(n)) for n in ("b", "c")
    ]
    training._interleave(kinds, 2, 3, lambda k: None, _Waits(log), overlap=False)  # type: ignore[arg-type]
    # the baseline calls nothing: its turns show as the gaps between the others' calls
    assert log == ["b", "c", "c", "b", "b", "c", "wait", "c", "b", "b", "c", "c", "b", "wait"]
    assert [len(k.steps) for k in kinds] == [6, 6, 6] and [len(k.rounds) for k in kinds] == [2] * 3
    log.clear()
    kinds = [training._Kind("a", None), training._Kind("b", lambda: log.append("b"))]
    training._interleave(kinds, 2, 3, lambda k: None, _Waits(log), overlap=True)  # type: ignore[arg-type]
    # with overlap each kind runs its steps in a row, the checkpointed ones ending in a wait
    assert log == ["b", "b", "b", "wait", "b", "b", "b", "wait"]


def test_the_steps_beside_a_persist_are_charged_to_the_checkpointed_kind() -> None:
    base, ckpt, floor = (training._Kind(n, None) for n in ("base", "ckpt", "floor"))
    base.steps, base.rounds = [1.0, 1.0, 1.0, 3.0], [3.0, 3.0]
    ckpt.steps, ckpt.rounds = [1.0, 1.5, 1.0, 1.0], [3.0, 2.5]
    floor.steps, floor.rounds = [2.0, 2.0, 2.0, 2.0], [4.0, 4.0]
    # a persist started in round 1: the base step of 3.0 (its mean elsewhere 1.0) and the
    # checkpointed step of 1.5 (1.0 elsewhere) ran beside it, and a floor step as usual
    got = training._charge_persists([base, ckpt, floor], [(0, 1, 3.0), (1, 1, 1.5), (2, 1, 2.0)])
    assert base.rounds == [3.0, 1.0] and floor.rounds == [4.0, 4.0]
    assert ckpt.rounds == [3.0, 4.5]  # its own excess stays, the baseline's moves to it
    assert got["excess_s"] == 2.5 and got["moved_s"] == {"base": 2.0, "ckpt": 0.5, "floor": 0.0}
    assert got["steps_beside"] == 3 and got["per_checkpointed_step_s"] == 2.5 / 4
