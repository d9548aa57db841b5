"""The DeepSpeed benchmark phase (``benchmarks/ds_bench.py``) on a toy GPT-2, one ZeRO stage,
one round after the first: its results have the shape the docs block and `report.py`
read, both restores give back the saving engine's state, and ``--docs`` /
`report.write_report` put the block into the page. A smoke test of the harness, not a
timed test: no figure is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import ds_bench  # noqa: E402
import report  # noqa: E402


@pytest.fixture(scope="module")
def ds_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("ds") / "work"
    return ds_bench.run_phase(work, 1, log=lambda _: None, stages=(3,), tiny=True, timeout_s=300)


def test_results_hold_every_method_and_restores_are_exact(ds_result: dict[str, Any]) -> None:
    assert set(ds_result["stages"]) == {"3"}
    e = ds_result["stages"]["3"]
    assert "error" not in e, e.get("error")
    assert e["world_size"] == 2 and e["model"]["n_layer"] == 2
    assert set(e["save"]) == set(ds_bench.SAVE_LABELS)
    for m in e["save"].values():
        assert len(m["blocking"]["samples"]) == len(m["total"]["samples"]) == 1
        assert m["total"]["median"] >= m["blocking"]["median"] > 0
        assert m["bytes"] > 0
    # every rank's ZeRO-3 partition: DeepSpeed's optimizer files, resumable's data files
    assert any("optim_states" in f for f in e["save"]["deepspeed"]["files"])
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(
        e["save"]["resumable_sync"]["files"]
    )
    assert {"part-00000.json.gz", "part-00001.json.gz"} <= set(e["save"]["resumable_sync"]["files"])
    # beside each one checkpoint: DeepSpeed's `latest` and recovery script, copied by
    # every save; resumable's audit log; each directory counted whole
    assert {"latest", "zero_to_fp32.py"} <= set(e["save"]["deepspeed"]["beside"])
    assert "audit.jsonl" in e["save"]["resumable_sync"]["beside"]
    for m in e["save"].values():
        assert m["dir_bytes"] == m["bytes"] + sum(m["beside"].values())
    assert set(e["restore"]) == {"deepspeed", "resumable"}
    # restores timed RESTORE_FACTOR times as often as saves (after a first, apart)
    assert e["restore_reps"] == ds_bench.RESTORE_FACTOR
    for m in e["restore"].values():
        assert len(m["samples"]) == ds_bench.RESTORE_FACTOR
    assert e["restored_equal"] == {"deepspeed": True, "resumable": True}
    assert all(v is not None for v in e["ratios"].values())
    assert e["floors"]["write_gbps"] > 0 and e["floors"]["read_warm_gbps"] > 0
    # the collector settled before every timed call and measured inside it, per method
    gc_in = e["gc_in_calls_s"]
    assert set(gc_in["saves"]) == set(e["raw"]["saves"])
    assert set(gc_in["restores"]) == {"deepspeed", "resumable", "read_floor"}
    assert all(v >= 0 for per in gc_in.values() for v in per.values())
    assert ds_bench.measured(ds_result)
    assert json.loads(json.dumps(ds_result)) == ds_result


def test_the_collector_is_settled_before_a_call_and_counted_inside_it() -> None:
    import gc

    import ds_worker

    clock = ds_worker.GcClock()
    try:
        for _ in range(20_000):  # cyclic garbage: a collection has something to walk
            a: list[object] = []
            a.append(a)
        clock.settle()
        assert clock.spent == 0.0  # its own collection is not counted
        gc.collect()  # a collection inside the "call"
        assert clock.spent > 0.0
        clock.settle()
        assert clock.spent == 0.0
    finally:
        clock.close()
    assert clock._on not in gc.callbacks


def test_block_renders_the_tables(ds_result: dict[str, Any]) -> None:
    text = ds_bench.render(ds_result, "benchmarks/results/ds-x.json")
    assert text.startswith(ds_bench.BEGIN) and text.endswith(ds_bench.END)
    assert "## DeepSpeed (ZeRO 1-3 on CPU, gloo)" in text
    assert "`benchmarks/results/ds-x.json`" in text
    assert "| 3 | `engine.save_checkpoint` + fsync of its files |" in text
    assert "| ZeRO | `load_checkpoint` s |" in text and "| yes / yes |" in text
    assert "The most the collector still took inside one call" in text
    assert "Not measured: skipped." in ds_bench.render({"error": "skipped"}, "x")
    failed = {"stages": {"1": {"error": "boom"}, **ds_result["stages"]}}
    assert "not measured: boom" in ds_bench.render(failed, "x")


def test_docs_block_inserted_then_replaced(ds_result: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n## Several ranks\n\nx\n\n## Data position\n\ny\n")
    ds_bench.write_docs(ds_result, "first.json", page)
    first = page.read_text()
    assert first.index("## Several ranks") < first.index(ds_bench.BEGIN)
    assert first.index(ds_bench.END) < first.index("## Data position")
    ds_bench.write_docs(ds_result, "second.json", page)
    second = page.read_text()
    assert second.count(ds_bench.BEGIN) == 1 and "second.json" in second
    assert "first.json" not in second and second.endswith("y\n")


def test_report_renders_the_run_block_or_the_standalone_one(
    ds_result: dict[str, Any], tmp_path: Path
) -> None:
    committed = report.newest(BENCH / "results")
    results = tmp_path / "results"
    results.mkdir()
    run = results / committed.name
    whole = json.loads(committed.read_text())
    whole.pop("ds", None)  # a run without the phase
    run.write_text(json.dumps(whole))
    (results / "ds-20000101T000000Z.json").write_text(json.dumps(ds_result))
    assert report.newest(results) == run  # a phase's own file is not a run
    page = tmp_path / "performance.md"
    report.write_report(run, page)  # the run has no "ds": the standalone file's block
    text = page.read_text()
    assert "ds-20000101T000000Z.json" in text and text.count(ds_bench.BEGIN) == 1

    whole = json.loads(run.read_text())
    whole["ds"] = ds_result
    run.write_text(json.dumps(whole))
    report.write_report(run, page)
    text = page.read_text()
    assert "ds-20000101T000000Z.json" not in text and text.count(ds_bench.BEGIN) == 1
    assert f"`benchmarks/results/{run.name}`" in text
