"""The scale harness (benchmarks/scale.py) at small N: counts of operations, never times.

It runs the real `Agreement`, `write_distributed` through `StoreCoordinator`, retention and
restore planning for 4 and 16 simulated ranks over one real TCPStore (libuv), and checks
what must hold at any N: every rank but rank 0 does the same, constant number of store
operations per save and per decision, and reads a constant number of bytes per save;
rank 0 does at most a constant times N; nothing is left in the store by the decisions
or by the restore's verdicts (a constant number of store operations per rank);
a rank's restore planning makes a constant number of storage calls; retention of one
checkpoint makes the same storage calls at any N (and, on ``s3://``, the same requests).
With one object per node (`resumable.nodes`), a checkpoint is one object per node and
the manifest, and a rank does one store operation more, its node's leader O(ranks per
node) more.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import scale


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    roots = tmp_path_factory.mktemp("scale")
    return scale.measure([4, 16], roots=roots, commit_tensors=2, manifest_tensors=20)


def _row(out: dict, n: int) -> dict:
    return out["by_n"][str(n)]


def test_agreement_is_constant_per_rank(measured: dict) -> None:
    a4, a16 = _row(measured, 4)["agreement"], _row(measured, 16)["agreement"]
    # compare_set + add on every rank; the last rank to read also deletes both keys.
    assert a4["ops_per_rank"] == a16["ops_per_rank"] == {"max": 4, "min": 2}
    assert a16["ops_total"] == 2 * 16 + 2
    assert a4["keys_left"] == a16["keys_left"] == 0


@pytest.mark.parametrize("where", ["commit_memory", "commit_local"])
def test_commit_store_ops(measured: dict, where: str) -> None:
    c4, c16 = _row(measured, 4)[where], _row(measured, 16)[where]
    # Other ranks: post that they are ready (`all_ready`), wait for the attempt, post the
    # report, wait for the outcome.
    assert c4["ops_per_rank"] == c16["ops_per_rank"] == {"max": 4, "min": 4}
    # Rank 0: post its ready, one wait and one multi_get for every rank's; post the
    # attempt and its report, one wait and one multi_get for every report, post the
    # outcome, then the 2N + 2 deletes of the keys (ready, reports, attempt, outcome) of
    # the save before the last: 2N + 10 (one get per report made the reports 2N + 6).
    assert c4["ops_rank0"] == 2 * 4 + 10
    assert c16["ops_rank0"] == 2 * 16 + 10
    assert c16["ops_total"] == c16["ops_rank0"] + 4 * 15


@pytest.mark.parametrize("where", ["commit_memory", "commit_local"])
def test_commit_store_bytes(measured: dict, where: str) -> None:
    c4, c16 = _row(measured, 4)[where], _row(measured, 16)[where]
    # Another rank reads the attempt, its own report echoed by compare_set and the
    # outcome (nbytes, replaced, the manifest's digest): the same at any N but for a
    # few digits (rank numbers, nbytes). The outcome once carried the whole manifest:
    # 2,958 bytes per rank at N=4, 8,928 at N=16.
    assert abs(c16["bytes_received_per_rank"] - c4["bytes_received_per_rank"]) <= 16
    # So all the bytes of a save grow as N (rank 0 reads N reports), not N^2 (a
    # quadratic total made N=16 cost 9 times N=4).
    assert c16["bytes_total"] < 5 * c4["bytes_total"]


@pytest.mark.parametrize("where", ["restore_memory", "restore_local"])
def test_restore_planning_calls(measured: dict, where: str) -> None:
    r4, r16 = _row(measured, 4)[where], _row(measured, 16)[where]
    # The top manifest (size, read), the rank's own part (size, read; format version 7:
    # no other rank's), then the one file the rank reads (size, the 8-byte header
    # length, the header): 7 at any N. Checking every rank's file made it 3N + 2; one
    # manifest naming every rank's tensors made the bytes read O(N).
    assert r4["storage_calls_per_rank"] == r16["storage_calls_per_rank"] == 7


@pytest.mark.parametrize("case", ["none_fails", "every_rank_fails"])
def test_restore_verdicts_are_constant_per_rank(measured: dict, case: str) -> None:
    v4, v16 = _row(measured, 4)["verdicts"][case], _row(measured, 16)["verdicts"][case]
    # Every rank but 0: post its verdict, read the answer, remove its key, count itself
    # a reader; rank 0: wait for the keys, one multi_get, post the answer, count itself.
    # The last reader also removes the answer and the count. (An all-gather over gloo
    # is 2(N - 1) messages per rank: `gloo_model`.)
    # Which rank reads last depends on the scheduler: rank 0 or another.
    for v, n in ((v4, 4), (v16, 16)):
        assert v["ops_per_rank"]["min"] == 4 and v["ops_per_rank"]["max"] in (4, 6)
        assert v["ops_rank0"] in (4, 6)
        assert (v["ops_rank0"] == 6) != (v["ops_per_rank"]["max"] == 6), "one last reader"
        assert v["ops_total"] == 4 * n + 2
    assert v4["verdicts_said"] == v16["verdicts_said"] / 4 == (4 if case != "none_fails" else 0)
    if case == "none_fails":  # the answer "[]" and the count: the same bytes at any N
        assert v4["bytes_received_per_rank"] == v16["bytes_received_per_rank"]
    assert _row(measured, 4)["verdicts"]["keys_left"] == 0
    assert _row(measured, 16)["verdicts"]["keys_left"] == 0


def test_retention_storage_calls_do_not_grow_with_n(measured: dict) -> None:
    r4, r16 = _row(measured, 4)["retention_local"], _row(measured, 16)["retention_local"]
    # The just-written checkpoint is checked from one listing of its directory: its
    # files' sizes against the manifest's. Sizing each data file and reading its
    # header made it 3N + 13 calls (25 at N=4, 61 at N=16).
    assert r4["storage_calls"] == r16["storage_calls"]
    assert r16["storage_calls"]["list_files"] == 1
    assert "read_range" not in r16["storage_calls"]
    assert r16["storage_calls_total"] == 14


@pytest.fixture(scope="module")
def measured_s3(tmp_path_factory: pytest.TempPathFactory, seaweedfs: Any) -> dict:
    roots = tmp_path_factory.mktemp("scale-s3")
    return scale.measure([4, 16], roots=roots, s3=seaweedfs, commit_tensors=2, manifest_tensors=20)


def test_retention_requests_on_s3_do_not_grow_with_n(measured_s3: dict) -> None:
    r4, r16 = _row(measured_s3, 4)["retention_s3"], _row(measured_s3, 16)["retention_s3"]
    assert r4["steps_deleted"] == r16["steps_deleted"] == [1]
    # Every object of the doomed checkpoint goes (N data files, N parts of its split
    # manifest, its top manifest and its commit marker, batched in DeleteObjects), yet
    # the requests are the same at any N below 1,000 files: one ListObjectsV2 page
    # checks the new checkpoint's files.
    assert r16["objects_deleted"] - r4["objects_deleted"] == 2 * 12
    assert r4["requests"] == r16["requests"]
    assert r16["requests"]["GetObject"] == 3  # manifests only: no data file's header
    # A HeadObject and two GetObjects per data file made it 32 at N=4, 68 at N=16.
    assert r16["requests_total"] == 21
    for n in (4, 16):  # the floor deleted as many objects as retention, by raw requests
        row = _row(measured_s3, n)
        floor = row["delete_floor_s3"]
        assert floor["objects"] == row["retention_s3"]["objects_deleted"] and floor["s"] > 0


def test_retention_and_restore_ran(measured: dict) -> None:
    for n in (4, 16):
        row = _row(measured, n)
        assert row["retention_local"]["steps_deleted"] == [1]
        assert row["restore_local"]["per_rank_s"] > 0
        assert row["manifest"]["tensors"] == 20 * n
        assert row["manifest"]["restore_decode_s"] > 0 and row["manifest"]["decode_s"] > 0
        assert row["gloo_model"]["messages_per_rank"] == 2 * (n - 1)
        assert row["gloo_model"]["save_reports"]["messages_total"] == 3 * (n - 1)


def test_fits_and_docs_render(measured: dict, tmp_path: Path) -> None:
    fits = measured["fits"]
    assert fits["store ops, other rank per save"]["slope"] == 0.0
    assert fits["store ops, rank 0 per save"]["slope"] > 0
    doc = tmp_path / "scale.md"
    doc.write_text(f"# x\n\n{scale.BEGIN}\nold\n{scale.END}\n\ntail\n")
    measured = {**measured, "settings": {"commit_tensors": 2, "manifest_tensors": 20}}
    scale.write_docs(measured, "test", doc)
    text = doc.read_text()
    assert "old" not in text and "tail" in text
    assert "| store ops, other rank per save | 4 | 4 | 0.0 | 4 |" in text
    assert (tmp_path / "scale-times.svg").read_text().startswith("<svg")


def test_retention_on_a_copy_of_the_local_checkpoints_sends_what_an_s3_commits_would(
    measured_s3: dict, seaweedfs: Any, tmp_path: Path
) -> None:
    """Above ``s3_max_n`` the harness measures ``s3://`` retention on the local root's
    checkpoints put into a bucket (`scale.s3_from_copy`): at N = 16 it sends the requests
    retention sends after a real ``s3://`` commit, and deletes as many objects but the
    attempt's directory."""
    ranks = scale.Ranks(16)
    try:
        local = scale.open_storage(str(tmp_path / "root"))
        scale.commit(ranks, local, [1, 2], 2, seq0=5)
    finally:
        ranks.close()
    copied = scale.s3_from_copy(tmp_path / "root", seaweedfs, 16, 2)
    real = _row(measured_s3, 16)
    assert copied["s3_from_copy"]["objects_put"] == 2 * (2 * 16 + 1)
    assert copied["s3_objects_per_checkpoint"] == real["s3_objects_per_checkpoint"] == 33
    assert copied["retention_s3"]["steps_deleted"] == [1]
    assert copied["retention_s3"]["requests"] == real["retention_s3"]["requests"]
    # The attempt's directory, deleted as a key of its own, is the one key fewer.
    assert copied["retention_s3"]["objects_deleted"] == real["retention_s3"]["objects_deleted"] - 1
    assert copied["restore_s3"]["requests_per_rank"] == real["restore_s3"]["requests_per_rank"]
    assert copied["delete_floor_s3"]["objects"] == copied["retention_s3"]["objects_deleted"]


@pytest.mark.parametrize("where", ["commit_memory", "commit_local"])
def test_a_commit_says_where_each_rank_waited(measured: dict, where: str) -> None:
    """Every rank's save split in the phases of `scale.PHASES` (a commit of the run of
    2026-12-04 21:12 had every rank wait 600 s at N=4,096, and nothing said where)."""
    got = _row(measured, 16)[where]["phases_s"]
    assert list(got) == [name for name, _, _ in scale.PHASES]
    for phase in got.values():
        assert 0 <= phase["median"] <= phase["max"] and 0 <= phase["max_rank"] < 16


def test_one_object_per_node_costs_a_rank_one_more_store_operation(measured: dict) -> None:
    """With one object per node (8 ranks a node here), each rank posts what it staged to
    its node's leader: one store operation more than a file per rank; a leader waits
    for, reads and removes its node's keys (2 + 8 more: O(ranks per node), not O(N))."""
    c4, c16 = (
        _row(measured, 4)["nodes"]["commit_local"],
        _row(measured, 16)["nodes"]["commit_local"],
    )
    assert c4["ops_per_rank"] == {"max": 5, "min": 5}  # one node, led by rank 0
    assert c16["ops_per_rank"] == {"max": 5 + 2 + 8, "min": 5}  # rank 8 leads the second
    assert c4["ops_rank0"] == 2 * 4 + 10 + 1 + 2 + 4
    assert c16["ops_rank0"] == 2 * 16 + 10 + 1 + 2 + 8


def test_one_object_per_node_on_s3_is_an_object_per_node_and_deletes_them(
    measured_s3: dict,
) -> None:
    n4, n16 = _row(measured_s3, 4)["nodes"], _row(measured_s3, 16)["nodes"]
    # The manifest and one object per node (1 and 2 nodes of at most 8 ranks), against
    # 2N + 1 with a data file and a part per rank.
    assert n4["s3_objects_per_checkpoint"] == 1 + 1
    assert n16["s3_objects_per_checkpoint"] == 1 + 2
    assert _row(measured_s3, 16)["s3_objects_per_checkpoint"] == 2 * 16 + 1
    assert n4["retention_s3"]["steps_deleted"] == n16["retention_s3"]["steps_deleted"] == [1]
    assert n16["retention_s3"]["objects_deleted"] - n4["retention_s3"]["objects_deleted"] == 1
    assert n4["retention_s3"]["requests"] == n16["retention_s3"]["requests"]
    # A rank's restore planning: the same requests at any N (the top, its part's range
    # of its node's object, its file's).
    assert n4["restore_s3"]["requests_per_rank"] == n16["restore_s3"]["requests_per_rank"]
    assert n16["delete_floor_s3"]["objects"] == n16["retention_s3"]["objects_deleted"]


def test_one_object_per_node_on_a_copy_sends_what_an_s3_commit_would(
    measured_s3: dict, seaweedfs: Any, tmp_path: Path
) -> None:
    ranks = scale.Ranks(16)
    try:
        got = scale.node_objects(
            ranks, tmp_path, seaweedfs, node_size=8, tensors=2, s3_max_n=8, sample=2
        )
    finally:
        ranks.close()
    real = _row(measured_s3, 16)["nodes"]
    assert got["s3_from_copy"]["objects_put"] == 2 * (1 + 2)
    assert got["s3_objects_per_checkpoint"] == real["s3_objects_per_checkpoint"] == 3
    assert got["retention_s3"]["requests"] == real["retention_s3"]["requests"]
    assert got["retention_s3"]["objects_deleted"] == real["retention_s3"]["objects_deleted"] - 1
    assert got["restore_s3"]["requests_per_rank"] == real["restore_s3"]["requests_per_rank"]


def _children_running(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (the phase's work directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd and "scale.py" in cmd:
                found.append(int(proc.name))
    return found


def test_the_phase_runs_in_a_child_of_its_own(tmp_path: Path) -> None:
    """`make bench` runs the phase in a fresh interpreter: its rows come back as
    `run_phase` makes them, and its log lines reach the caller's log."""
    lines: list[str] = []
    out = scale.run_in_child(tmp_path / "w", lines.append, ns=[4], s3=False)
    assert sorted(out["by_n"]) == ["4"] and out["ns"] == [4]
    assert any("N=4" in line for line in lines)
    assert not _children_running(str(tmp_path))


def test_a_stalled_phase_is_stopped_and_named(tmp_path: Path) -> None:
    """A phase past its time is killed, child and all, and reported as an error (the
    run's other phases keep their results), not waited for."""
    with pytest.raises(RuntimeError, match="did not finish in"):
        scale.run_in_child(tmp_path / "w", lambda _: None, ns=[4, 16], s3=False, timeout_s=0.2)
    assert not _children_running(str(tmp_path))


def test_a_stalled_phase_keeps_the_rows_of_the_ns_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child writes the rows of each N it finishes: a stall at a later N costs that
    N only, and says so (`make bench` then leaves docs/scale.md as it was)."""
    monkeypatch.setenv(scale.STALL_ENV, "16")
    lines: list[str] = []
    out = scale.run_in_child(tmp_path / "w", lines.append, ns=[4, 16], s3=False, timeout_s=20)
    assert sorted(out["by_n"]) == ["4"]
    assert "Kept: the rows of N=4; not run: N=16" in out["stopped"]
    assert any("was stopped" in line for line in lines)
    assert not _children_running(str(tmp_path))
