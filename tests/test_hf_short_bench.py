"""The short-run benchmark (``benchmarks/hf_short_run.py``) at a toy size: both variants
train in launches of their own, save what the Trainer asked for, and the results hold
each launch and the medians. A smoke test of the harness, not a timed test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import hf_short_run  # noqa: E402


def test_both_variants_train_save_and_report() -> None:
    out = hf_short_run.run(1, steps=4, save_steps=2, layers=1, log=lambda _: None)
    assert set(out["launches"]) == set(hf_short_run.VARIANTS)
    for variant, launches in out["launches"].items():
        assert len(launches) == 1
        assert launches[0]["train_s"] > 0
        assert launches[0]["bytes_saved"] > 0, f"{variant} saved nothing"
    assert out["ratio"] == out["median_train_s"]["resumable"] / out["median_train_s"]["plain"]
