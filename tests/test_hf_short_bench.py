"""The short-run benchmark (``benchmarks/hf_short_run.py``) at a toy size: the plain
Trainer and `ResumableTrainer` train in launches of their own, save what the Trainer
asked for, and the results hold each launch, every save of the `ResumableTrainer`
launches and the medians. A smoke test of the harness, not a timed test.

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
    steps, save_steps = 3, 1
    out = hf_short_run.run(
        1, steps=steps, save_steps=save_steps, layers=1, variants=variants, log=lambda _: None
    )
    assert set(out["launches"]) == set(variants)
    for variant, launches in out["launches"].items():
        assert len(launches) == 1
        assert launches[0]["train_s"] > 0
        assert launches[0]["bytes_saved"] > 0, f"{variant} saved nothing"
    assert out["ratio"] == out["median_train_s"]["resumable"] / out["median_train_s"]["plain"]
    assert "ratio_torch_worker" not in out
    assert "saves" not in out["launches"]["plain"][0]
    # the persist worker ended with train(): its CPU is the launch's children's; the
    # plain Trainer starts none
    cpu = out["median_worker_cpu_s"]
    assert cpu["resumable"] > 0.01 and cpu["plain"] < cpu["resumable"] / 10, cpu
    # Every save the Trainer asked for, one Checkpointer.save each: the last step's save
    # is one of them (the Trainer saves at max_steps, which is a multiple here), and
    # nothing is saved again at the end (ResumableTrainer closes with save_on_close off).
    saves = out["launches"]["resumable"][0]["saves"]
    assert [s["step"] for s in saves] == list(range(save_steps, steps + 1, save_steps))
    assert len(saves) == steps // save_steps
    for s in saves:
        assert s["blocking_s"] >= s["snapshot_s"] > 0, s
    summary = out["saves"]["resumable"]
    assert set(out["saves"]) == {"resumable"}
    assert [i["index"] for i in summary["by_index"]] == [1, 2, 3]
    assert [i["steps"] for i in summary["by_index"]] == [[1], [2], [3]]
    ratios = [s["blocking_s"] / s["snapshot_s"] for s in saves]
    assert summary["worst_ratio_first"] == pytest.approx(ratios[0])
    assert summary["worst_ratio_after_first"] == pytest.approx(max(ratios[1:]))
    assert summary["worst_ratio"] == pytest.approx(max(ratios))
    assert all(r >= 1 for r in ratios)


def test_saves_are_summarised_per_index_and_the_goal_leaves_out_each_launchs_first() -> None:
    def launch(*pairs: tuple[float, float]) -> dict:
        return {
            "train_s": 1.0,
            "saves": [
                {"step": 20 * (i + 1), "blocking_s": b, "snapshot_s": s}
                for i, (b, s) in enumerate(pairs)
            ],
        }

    launches = [
        launch((0.9, 0.1), (0.2, 0.1), (0.11, 0.1)),  # a slow first save: not judged
        launch((0.3, 0.1), (0.1, 0.1), (0.15, 0.1)),
        launch((0.2, 0.1), (0.12, 0.1)),  # a launch that saved twice only
        {"train_s": 1.0},  # one from before saves were recorded
    ]
    s = hf_short_run.summarise_saves(launches)
    assert s["worst_ratio_after_first"] == pytest.approx(2.0)
    assert s["worst_ratio_first"] == pytest.approx(9.0)
    assert s["worst_ratio"] == pytest.approx(9.0)
    assert [p["worst_ratio_after_first"] for p in s["per_launch"]] == pytest.approx(
        [2.0, 1.5, 1.2, None]
    )
    second, third = s["by_index"][1], s["by_index"][2]
    assert second["steps"] == [40] and second["launches"] == 3
    assert second["median_blocking_s"] == pytest.approx(0.12)
    assert second["median_ratio"] == pytest.approx(1.2) and second["worst_ratio"] == 2.0
    assert third["launches"] == 2 and third["median_blocking_s"] == pytest.approx(0.13)
    assert s["after_first"]["saves"] == 5
    assert s["after_first"]["median_blocking_s"] == pytest.approx(0.12)
    # the longest beyond its own snapshot (0.1 s, the second save of the first launch)
    # ÷ the median snapshot of the saves after the first (0.1 s): what the goal judges
    assert s["after_first"]["worst_excess_s"] == pytest.approx(0.1)
    assert s["after_first"]["worst_excess_over_median_snapshot"] == pytest.approx(1.0)
    assert hf_short_run.summarise_saves([{"train_s": 1.0}])["worst_ratio_after_first"] is None


def test_make_bench_runs_the_phase_after_megatron_core() -> None:
    import run

    assert run.parse_args([]).hf_rounds == 10 and not run.parse_args([]).no_hf
    assert run.parse_args(["--quick"]).hf_rounds == 2
    assert run.parse_args(["--no-hf", "--hf-rounds", "3"]).hf_rounds == 3
    assert run.parse_args(["--no-hf"]).no_hf
    text = Path(run.__file__).read_text()
    phases = ("mcore_bench.run_phase", "hf_short_run.run_phase", "incr_bench.run_phase")
    assert [text.index(p) for p in phases] == sorted(text.index(p) for p in phases)
    assert 'out["hf_short"] = {"error": "skipped (--no-hf)"}' in text


def test_the_torch_worker_variant_imports_torch_before_the_worker() -> None:
    boot = hf_short_run.torch_importing_boot()
    assert boot.index("import torch\n") < boot.index("from resumable.pipeline._worker import")
    with pytest.raises(RuntimeError, match="not found"):
        hf_short_run.torch_importing_boot("import os\n")
