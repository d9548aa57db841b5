"""The distributed phase's layers of a background save (`dist_worker.layers`,
`dist_bench.layers`): a real two-rank torchrun launch times them inside `save()`, every
layer is found where it runs and together they fit inside the blocking; the report
renders them for the slowest rank, and runs from before them render as they did."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import dist_bench  # noqa: E402
import dist_worker  # noqa: E402
import goals  # noqa: E402
import report  # noqa: E402

LAYER_KEYS = {"floor", "blocking", "slot", "rest", *dist_bench.LAYERS}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("dist") / "w2"
    raw = dist_bench.launch(2, 2, 1, work, background=True, timeout_s=240, warmup=1, pair_reps=3)
    return dist_bench.summarise(raw)


def test_every_layer_is_timed_inside_the_save_of_every_rank(two_ranks: dict[str, Any]) -> None:
    lay = two_ranks["methods"]["resumable_process"]["layers"]
    assert len(lay["rounds"]) == dist_worker.LAYER_ROUNDS
    for rnd in lay["rounds"]:
        assert len(rnd) == 2  # both ranks
        for row in rnd:
            assert set(row) == LAYER_KEYS
            for k in ("floor", "copy", "capture", "take", "ask", "hand_off"):
                assert row[k] > 0, (k, row)  # each found and called in every save
            assert row["answer"] >= 0
            # the capture and the copy run inside the snapshot, and it, the decision and
            # the hand-off inside save(), one after another: each fits in its time
            assert row["slot"] >= 0 and row["rest"] >= 0, row
    per_rank = lay["per_rank_ms"]
    assert lay["slowest"] == max((0, 1), key=lambda r: per_rank[r]["blocking"])


def test_the_deciding_pair_gets_its_rounds_after_the_others(two_ranks: dict[str, Any]) -> None:
    """With ``pair_reps``, the background save and the copy floor are timed that many
    rounds more than the other methods (1 warm-up + 1 timed round + 3), each round's
    sample from both ranks, and their medians are over all their timed rounds."""
    methods = two_ranks["methods"]
    for name in ("copy_floor", "resumable_process"):
        assert len(methods[name]["per_rank_blocking"]) == 1 + 1 + 3, name
        assert len(methods[name]["blocking"]["samples"]) == 1 + 3, name
        assert all(len(rep) == 2 for rep in methods[name]["per_rank_blocking"])
    for name in ("resumable", "dcp_save", "dcp_async"):
        assert len(methods[name]["per_rank_blocking"]) == 1 + 1, name
    assert len(methods["resumable_process"]["snapshot"]["samples"]) == 1 + 3


def test_the_report_and_the_goal_row_give_the_slowest_ranks_layers(
    two_ranks: dict[str, Any],
) -> None:
    out = {"dist": {"worlds": {"2": two_ranks}, "reps": 1}, "machine": {"cpu_count": 2}}
    text = "\n".join(report.dist_section(out))
    lay = two_ranks["methods"]["resumable_process"]["layers"]
    m = lay["per_rank_ms"][lay["slowest"]]
    row = next(line for line in text.splitlines() if line.startswith("| 2 | 10 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == str(lay["slowest"])
    assert cells[3] == f"{m['floor']:.2f}" and cells[6] == f"{m['copy']:.2f}"
    assert cells[8] == f"{m['blocking'] - m['copy']:.2f}"
    assert cells[10] == f"{m['slot']:.2f}" and cells[11] == f"{m['ask'] + m['answer']:.2f}"
    (goal,) = [r for r in goals._dist(out) if r is not None]
    assert f"the slowest rank (rank {lay['slowest']}, means)" in goal["why"]
    assert f"the hand-off to the persist worker {m['hand_off']:.2f} ms" in goal["why"]


def test_the_summary_adds_each_rounds_rest_and_finds_the_slowest_rank() -> None:
    def row(blocking: float, copy: float) -> dict[str, float]:
        take = copy + 0.5
        rest = dict(ask=0.125, answer=0.0, hand_off=0.125)
        return {
            "floor": 1.0,
            "blocking": blocking,
            "copy": copy,
            "capture": 0.25,
            "take": take,
            **rest,
        }

    rounds = [[row(2.0, 1.0), row(3.0, 1.5)], [row(4.0, 1.0), row(3.5, 2.0)]]
    got = dist_bench.layers(rounds)
    assert all(r["slot"] == 0.25 for rnd in got["rounds"] for r in rnd)
    assert [[r["rest"] for r in rnd] for rnd in got["rounds"]] == [[0.25, 0.75], [2.25, 0.75]]
    assert got["per_rank_ms"][0]["blocking"] == 3.0 and got["per_rank_ms"][1]["rest"] == 0.75
    assert got["slowest"] == 1  # means 3.0 and 3.25
    for m in got["per_rank_ms"]:  # the means add up as each round does
        layers = m["take"] + m["ask"] + m["answer"] + m["hand_off"] + m["rest"]
        assert abs(layers - m["blocking"]) < 1e-9
        assert abs(m["copy"] + m["capture"] + m["slot"] - m["take"]) < 1e-9


def test_a_run_from_before_the_layers_renders_without_them() -> None:
    raw = json.loads((BENCH / "results" / "vm-20261206T230405Z.json").read_text())
    text = "\n".join(report.dist_section(raw))
    assert "Where the background `save()`'s blocking goes" not in text
    rows = [r for r in goals._dist(raw) if r is not None]
    assert rows and all("layers timed" not in r["why"] for r in rows)
