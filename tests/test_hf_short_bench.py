"""The short-run benchmark (``benchmarks/hf_short_run.py``) at a toy size: the plain
Trainer and `ResumableTrainer` train in launches of their own, save what the Trainer
asked for, and the results hold each launch and the medians. A smoke test of the
harness, not a timed test.

The third variant (a persist worker that imports torch first) is not launched here:
its only code of its own is the patch of the worker's boot code, checked below without
a launch; such a worker's launches run in ``test_first_saves_bench.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import hf_short_run  # noqa: E402


def test_both_variants_train_save_and_report() -> None:
    variants = ("plain", "resumable")
    out = hf_short_run.run(
        1, steps=4, save_steps=2, layers=1, variants=variants, log=lambda _: None
    )
    assert set(out["launches"]) == set(variants)
    for variant, launches in out["launches"].items():
        assert len(launches) == 1
        assert launches[0]["train_s"] > 0
        assert launches[0]["bytes_saved"] > 0, f"{variant} saved nothing"
    assert out["ratio"] == out["median_train_s"]["resumable"] / out["median_train_s"]["plain"]
    assert "ratio_torch_worker" not in out


def test_the_torch_worker_variant_imports_torch_before_the_worker() -> None:
    boot = hf_short_run.torch_importing_boot()
    assert boot.index("import torch\n") < boot.index("from resumable.pipeline._worker import")
    with pytest.raises(RuntimeError, match="not found"):
        hf_short_run.torch_importing_boot("import os\n")
