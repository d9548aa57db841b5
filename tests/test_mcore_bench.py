"""The Megatron-Core benchmark phase (``benchmarks/mcore_bench.py``) on a toy GPTModel at
TP=2, one round after the first: its results have the shape the docs block and
`report.py` read, both restores give back the saving model's state, and ``--docs`` /
`report.write_report` put the block into the page. A smoke test of the harness, not a
timed test: no figure is checked. megatron.core is found by ``find_spec``, not imported
into this process (its import is slow and warns)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

if (
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None
):
    pytest.skip("megatron-core is not installed", allow_module_level=True)

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import mcore_bench  # noqa: E402
import report  # noqa: E402


@pytest.fixture(scope="module")
def mc_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("mcore") / "work"
    return mcore_bench.run_phase(
        work, 1, log=lambda _: None, configs=("tp2",), tiny=True, timeout_s=300
    )


def test_results_hold_every_method_and_restores_are_exact(mc_result: dict[str, Any]) -> None:
    assert set(mc_result["configs"]) == {"tp2"}
    e = mc_result["configs"]["tp2"]
    assert "error" not in e, e.get("error")
    assert e["world_size"] == 2 and e["tp"] == 2 and e["dp"] == 1
    assert e["model"]["num_layers"] == 2
    assert set(e["save"]) == set(mcore_bench.SAVE_LABELS)
    for m in e["save"].values():
        assert len(m["blocking"]["samples"]) == len(m["total"]["samples"]) == 1
        assert m["total"]["median"] >= m["blocking"]["median"] > 0
        assert m["bytes"] > 0
    # torch_dist's files, and every rank's resumable data file
    assert {".metadata", "common.pt"} <= set(e["save"]["megatron"]["files"])
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(
        e["save"]["resumable_sync"]["files"]
    )
    assert set(e["restore"]) == {"megatron", "resumable"}
    assert e["restored_equal"] == {"megatron": True, "resumable": True}, e["restored_differ"]
    assert all(v is not None for v in e["ratios"].values())
    assert e["floors"]["write_gbps"] > 0 and e["floors"]["read_warm_gbps"] > 0
    gc_in = e["gc_in_calls_s"]
    assert set(gc_in["restores"]) == {"megatron", "resumable", "read_floor"}
    assert all(v >= 0 for per in gc_in.values() for v in per.values())
    assert mcore_bench.measured(mc_result)
    assert json.loads(json.dumps(mc_result)) == mc_result


def test_block_renders_the_tables(mc_result: dict[str, Any]) -> None:
    text = mcore_bench.render(mc_result, "benchmarks/results/mcore-x.json")
    assert text.startswith(mcore_bench.BEGIN) and text.endswith(mcore_bench.END)
    assert "## Megatron-Core" in text and "`benchmarks/results/mcore-x.json`" in text
    assert "| TP 2 x DP 1 | `dist_checkpointing.save` + fsync of every file |" in text
    assert "| config | `dist_checkpointing.load` s |" in text and "| yes / yes |" in text
    assert "megatron_shim" in text  # the test-only shim is named
    assert "The most the collector still took inside one call" in text
    assert "Not measured: skipped." in mcore_bench.render({"error": "skipped"}, "x")
    failed = {"configs": {"tp1dp2": {"error": "boom"}, **mc_result["configs"]}}
    assert "not measured: boom" in mcore_bench.render(failed, "x")


def test_docs_block_inserted_then_replaced(mc_result: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text(
        "# Performance\n\n<!-- ds-bench: begin -->\nds\n<!-- ds-bench: end -->\n\n"
        "## Data position\n\ny\n"
    )
    mcore_bench.write_docs(mc_result, "first.json", page)
    first = page.read_text()
    assert first.index("<!-- ds-bench: end -->") < first.index(mcore_bench.BEGIN)
    assert first.index(mcore_bench.END) < first.index("## Data position")
    mcore_bench.write_docs(mc_result, "second.json", page)
    second = page.read_text()
    assert second.count(mcore_bench.BEGIN) == 1 and "second.json" in second
    assert "first.json" not in second and second.endswith("y\n")


def test_report_renders_the_run_block_or_the_standalone_one(
    mc_result: dict[str, Any], tmp_path: Path
) -> None:
    committed = report.newest(BENCH / "results")
    results = tmp_path / "results"
    results.mkdir()
    run = results / committed.name
    whole = json.loads(committed.read_text())
    whole.pop("mcore", None)  # a run without the phase
    run.write_text(json.dumps(whole))
    (results / "mcore-20000101T000000Z.json").write_text(json.dumps(mc_result))
    assert report.newest(results) == run  # a phase's own file is not a run
    page = tmp_path / "performance.md"
    report.write_report(run, page)  # the run has no "mcore": the standalone file's block
    text = page.read_text()
    assert "mcore-20000101T000000Z.json" in text and text.count(mcore_bench.BEGIN) == 1

    whole = json.loads(run.read_text())
    whole["mcore"] = mc_result
    run.write_text(json.dumps(whole))
    report.write_report(run, page)
    text = page.read_text()
    assert "mcore-20000101T000000Z.json" not in text and text.count(mcore_bench.BEGIN) == 1
    assert f"`benchmarks/results/{run.name}`" in text
