"""The incremental checkpoints benchmark phase (``benchmarks/incr_bench.py``) at toy sizes:
its results have the shape the docs block and `report.py` read, the block renders its
tables, and ``--docs`` / `report.write_report` put the block into the page. A smoke test of
the harness, not a timed test: no time is checked; the bytes only where the toy state
decides them (the fine-tuning's frozen base is reused)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import incr_bench  # noqa: E402
import report  # noqa: E402

from s3server import find_weed  # noqa: E402


@pytest.fixture(scope="module")
def incr_result(
    tmp_path_factory: pytest.TempPathFactory,
    frozen_heap: Callable[[], AbstractContextManager[None]],
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("incr") / "work"
    with frozen_heap():  # the harness collects garbage before each timed restore
        return incr_bench.run_phase(
            work, incr_bench.Settings.toy(), log=lambda _: None, s3=find_weed() is not None
        )


def _modes(entry: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in entry, entry.get("error")
    return dict(entry["modes"])


def test_results_hold_every_shape(incr_result: dict[str, Any]) -> None:
    toy = incr_bench.Settings.toy()
    ft = _modes(incr_result["finetune"])
    assert set(ft) == {"incremental", "full"}
    for e in ft.values():
        assert len(e["persists"]) == toy.ft_persists
        assert all(p["bytes"] > 0 and p["commit_s"] > 0 for p in e["persists"])
        assert all(p["root_bytes"] > 0 and p["checkpoints_on_disk"] >= 1 for p in e["persists"])
        assert e["bytes"]["n"] == toy.ft_persists - 1
        # Keep(last=2), plus the checkpoints a kept one refers to
        last = e["persists"][-2:]
        assert set(e["steps_kept"]) == {p["step"] for p in last} | {
            r for p in last for r in p["refs"]
        }
    # whole checkpoints never refer to others; the incremental writer's first is whole
    assert ft["full"]["v2_persists"] == 0
    assert ft["incremental"]["persists"][0]["format_version"] in (None, 1)
    assert incr_result["finetune"]["model"]["frozen_pct"] >= 90
    assert incr_result["finetune"]["restored_equal"] == {"incremental": True, "full": True}
    timed = incr_result["finetune"]["restore_s"]  # every local root's restore, timed
    assert set(timed) == {"incremental", "full"}
    assert all(len(t["samples"]) == toy.restore_reps and t["median"] > 0 for t in timed.values())
    s3 = incr_result["finetune_s3"]
    if find_weed() is not None:
        for e in _modes(s3).values():
            assert all(p["mirror_bytes"] > 0 for p in e["persists"])
            assert e["mirror_s"]["n"] == toy.s3_persists - 1
        assert s3["restored_equal"] == {"incremental": True, "full": True}
    emb = incr_result["embedding"]
    assert set(emb) == set(toy.patterns)
    for e in emb.values():
        modes = _modes(e)
        assert set(modes) == {"full", "incr_4MiB", "incr_4KiB"}
        assert len(e["intervals"]) == toy.emb_persists - 1
        for iv in e["intervals"]:
            assert 0 < iv["rows_changed"] <= iv["distinct_ids"]
            assert iv["changed_outside_drawn"] == 0  # SGD touched the drawn rows only
        assert set(e["summary"]) == {"incr_4MiB", "incr_4KiB"}
        assert e["restored_equal"] == dict.fromkeys(modes, True)
        assert set(e["restore_s"]) == set(modes)
    touch = incr_result["touch_model"]["patterns"]
    assert set(touch) == {"zipf s=1", "zipf s=1.1", "zipf s=1.2", "zipf s=1.5", "uniform"}
    goals = incr_result["goals"]
    # bytes and time (fine-tuning, its mirror), each restore ÷ the whole root's, and per
    # pattern the embedding's bytes for each chunk size
    assert len(goals) == 4 + 1 + 4 * len(toy.patterns)
    restores = [g for g in goals if "restore, incremental ÷ whole" in g["goal"]]
    assert len(restores) == 1 + 2 * len(toy.patterns)
    assert all(g["unit"] == "x at most" and g["measured"] > 0 for g in restores)
    assert incr_bench.measured(incr_result)
    assert json.loads(json.dumps(incr_result)) == incr_result


def test_incremental_writes_less_on_a_frozen_base(incr_result: dict[str, Any]) -> None:
    ft = incr_result["finetune"]
    later = ft["modes"]["incremental"]["persists"][1:]
    assert any(p["format_version"] == 3 for p in later)
    # the count the report shows (key v2_persists): every persist that refers (v2 or v3)
    referring = sum(1 for p in later if p["format_version"] in (2, 3))
    assert ft["modes"]["incremental"]["v2_persists"] == referring
    assert ft["ratios"]["bytes"] > 1


def test_block_renders_the_tables(incr_result: dict[str, Any]) -> None:
    text = incr_bench.render(incr_result, "benchmarks/results/incr-x.json")
    assert text.startswith(incr_bench.BEGIN) and text.endswith(incr_bench.END)
    assert "## Incremental checkpoints" in text and "`benchmarks/results/incr-x.json`" in text
    assert "| mode | MiB written per persist | commit s |" in text
    assert "| whole ÷ incremental |" in text
    assert "`Incremental(chunk_bytes=4KiB)`" in text and "| zipf |" in text
    assert "| goal | measured | limit | result | cross-check |" in text
    assert "| fine-tuning: restore, incremental ÷ whole ≤ 1.1x |" in text
    assert "| zipf s=1.5 |" in text  # the table of what the exponent decides
    assert "Not measured: skipped." in incr_bench.render({"error": "skipped"}, "x")
    broken = {**incr_result, "embedding": {"zipf": {"error": "boom"}}}
    assert "Not measured: boom." in incr_bench.render(broken, "x")


def test_docs_block_inserted_then_replaced(incr_result: dict[str, Any], tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text(
        "# Performance\n\n<!-- mcore-bench: begin -->\nmc\n<!-- mcore-bench: end -->\n\n"
        "## Data position\n\ny\n"
    )
    incr_bench.write_docs(incr_result, "first.json", page)
    first = page.read_text()
    assert first.index(incr_bench.MCORE_END) < first.index(incr_bench.BEGIN)
    assert first.index(incr_bench.END) < first.index("## Data position")
    incr_bench.write_docs(incr_result, "second.json", page)
    second = page.read_text()
    assert second.count(incr_bench.BEGIN) == 1 and "second.json" in second
    assert "first.json" not in second and second.endswith("y\n")


def test_report_renders_the_run_block_or_the_standalone_one(
    incr_result: dict[str, Any], tmp_path: Path
) -> None:
    committed = report.newest(BENCH / "results")
    results = tmp_path / "results"
    results.mkdir()
    run = results / committed.name
    whole = json.loads(committed.read_text())
    whole.pop("incr", None)
    run.write_text(json.dumps(whole))
    (results / "incr-20000101T000000Z.json").write_text(json.dumps(incr_result))
    assert report.newest(results) == run  # a phase's own file is not a run
    page = tmp_path / "performance.md"
    report.write_report(run, page)  # the run has no "incr": the standalone file's block
    text = page.read_text()
    assert "incr-20000101T000000Z.json" in text and incr_bench.BEGIN in text

    whole["incr"] = incr_result
    run.write_text(json.dumps(whole))
    report.write_report(run, page)  # the run's own, newer than the standalone one
    text = page.read_text()
    assert f"`benchmarks/results/{run.name}`" in text and text.count(incr_bench.BEGIN) == 1

    # measured again on its own after the run: the newer standalone block
    (results / "incr-20990101T000000Z.json").write_text(json.dumps(incr_result))
    report.write_report(run, page)
    text = page.read_text()
    assert "incr-20990101T000000Z.json" in text and text.count(incr_bench.BEGIN) == 1


def test_report_lists_a_failed_restore(incr_result: dict[str, Any]) -> None:
    whole = json.loads(report.newest(BENCH / "results").read_text())
    broken = json.loads(json.dumps(incr_result))
    broken["finetune"]["restored_equal"]["incremental"] = ["model.head.weight"]
    broken["embedding"]["uniform"] = {"error": "boom"}
    text = report.render({**whole, "incr": broken})
    assert "- incremental checkpoints, fine-tuning, incremental: restored state differs" in text
    assert "- incremental checkpoints, embedding uniform: boom" in text
