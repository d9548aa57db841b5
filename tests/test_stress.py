"""The reliability campaigns of `stress/` (issue 14), short versions: each must pass on
the library's save path and fail on a deliberately broken one. `make stress` runs the
full sizes and writes docs/reliability.md.

The passing campaigns run at their ``small`` size. A broken path is run at a size that
ends at the first problem found (``caught``: the able-to-fail sweep of kills, launches
or crash states, up to the first the checks catch); `make stress` runs every able-to-fail
sweep whole and publishes how many of its trials failed."""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from stress import (
    DONE,
    corruption,
    corruptranks,
    crashstate,
    endurance,
    enduranceranks,
    hostile,
    incremental,
    ioerrors,
    ioranks,
    kill,
    killranks,
    nodekill,
    objectstore,
    objectstoreranks,
    powerloss,
    powerlossranks,
)
from stress.__main__ import main
from stress.fsops import Fault, FileOps
from stress.hostile_targets import Target

from resumable.commit import RenameCommit, step_dir

REPO = Path(__file__).resolve().parent.parent


def _no_failures(r: dict[str, Any]) -> None:
    """A campaign's result has no failures; its problems are printed in full otherwise
    (the captured output is not truncated, as an assertion's message is: a survivor's
    stacks were cut to their first and last lines in CI)."""
    if r["failures"]:
        print(*r["details"]["problems"], sep="\n\n")
    assert r["failures"] == 0, f"{r['failures']} failure(s); the problems in full are printed"


# --------------------------------------------------------------------------- the model


def test_crash_model_loses_unsynced_entries_and_keeps_synced_ones() -> None:
    model = crashstate.FsModel({})
    for op in [
        ("mkdir", "d"),
        ("create", "d/f"),
        ("write", "d/f", 0, b"x" * 5000),
        ("fsync", "d/f", False),
        ("fsync", "d", True),
        ("rename", "d", "e"),
    ]:
        model.apply(op)
    states = {crashstate.fingerprint(model.crash_state(c)) for c in model.choices(_rng(), 8)}
    lost = model.crash_state(crashstate.Choice(((0, 0),), ()))
    kept = model.crash_state(crashstate.Choice(((0, 2),), ()))
    assert lost == {} and kept == {"e": None, "e/f": b"x" * 5000}
    assert len(states) == 3  # nothing, only d (mkdir), e (mkdir + rename, atomically)


def test_crash_model_tears_unsynced_bytes_at_pages() -> None:
    model = crashstate.FsModel({"f": b"a" * 8192})
    model.apply(("write", "f", 0, b"b" * 10000))
    ino = model.volatile()[1][0].ino
    f = {
        m: model.crash_state(crashstate.Choice((), ((ino, m, 1),)))["f"]
        for m in crashstate.FILE_MODES
    }
    assert f["synced"] == b"a" * 8192 and f["all"] == b"b" * 10000
    assert f["torn"] == b"b" * 4096 + b"a" * 4096 + bytes(10000 - 8192)
    assert f["zeros"] == b"a" * 8192 + bytes(10000 - 8192)


def _rng() -> Any:
    import random

    return random.Random(0)


def test_fileops_fails_the_chosen_call_once(tmp_path: Path) -> None:
    fault = Fault(errno.EIO, at=1)
    with FileOps(tmp_path, fault=fault).active() as ops:
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError) as err:
            os.write(fd, b"abc")
        os.write(fd, b"abc")
        os.close(fd)
    assert err.value.errno == errno.EIO
    assert [op[0] for op in ops.ops] == ["create", "write"]
    assert fault.injected == [(1, "write", "f")]


def test_fileops_records_and_fails_the_writes_of_a_file_written_direct(tmp_path: Path) -> None:
    """A file large enough for `resumable.storage.direct` is written with ``os.pwrite``:
    its writes are recorded at their offsets (the replay rebuilds the file from them)
    and counted like any write (the fault campaigns reach them)."""
    import mmap

    from resumable.storage import LocalStorage, direct

    data = mmap.mmap(-1, direct.DIRECT_MIN_BYTES + 5000)
    data[:] = bytes(range(256)) * (len(data) // 256) + bytes(len(data) % 256)
    storage = LocalStorage(tmp_path / "root", direct_io=True)
    with FileOps(tmp_path / "root").active() as ops:
        storage.write("d/big.bin", [b"head" * 1024, data])
    rebuilt = bytearray()
    for op in ops.ops:
        if op[0] == "write":
            _, path, offset, chunk = op
            assert path == "d/big.bin"
            rebuilt[offset : offset + len(chunk)] = chunk
    assert bytes(rebuilt) == (tmp_path / "root" / "d" / "big.bin").read_bytes()
    assert len(rebuilt) == 4096 + len(data)

    with FileOps(tmp_path / "root").active() as probe:
        storage.write("d/probe.bin", [b"head" * 1024, data])
    writes = [i for i, (kind, _) in enumerate(probe.calls) if kind == "write"]
    assert len(writes) >= 2
    fault = Fault(errno.EIO, at=writes[1])  # the second write of the same file elsewhere
    with FileOps(tmp_path / "root", fault=fault).active(), pytest.raises(OSError) as err:
        storage.write("d/other.bin", [b"head" * 1024, data])
    assert err.value.errno == errno.EIO
    assert fault.injected == [(writes[1], "write", "d/other.bin")]


# --------------------------------------------------------------------------- campaign 1


def test_kill_small_campaign_passes() -> None:
    r = kill.run("small")
    _no_failures(r)
    assert r["details"]["restores"]["committed or newer"] > 0


def test_kill_checker_catches_a_manifest_written_first() -> None:
    """`able_to_fail`'s launches, up to the first that the checks catch: a checkpoint
    listed whose data is not all there."""
    r = kill.run("caught", commit="manifest-first")
    assert r["failures"] > 0
    problems = r["details"]["problems"]
    assert any("listed but does not verify" in p for p in problems), problems


def _run_apart(module: str, call: str) -> dict[str, Any]:
    """``stress.<module>.<call>`` run in a fresh interpreter, its result as JSON. For a
    campaign that forks ranks: forked from this test process, which holds the threads
    of every test before it (servers, thread pools), a child can start with a lock
    that one of those threads held at the fork and wait on it forever; the campaign
    alone forks from a process of its own."""
    code = f"import json; from stress import {module}; print(json.dumps({module}.{call}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_node_kill_small_campaign_loses_at_most_one_snapshot() -> None:
    """Two simulated nodes, replicas=2: each node lost (SIGKILL, its memory deleted)
    resumes within one snapshot of the newest step every rank held, from the peer's
    replica (the campaign's checks; `make stress` runs it at full size and checks that
    the same kills without replicas are caught)."""
    r = _run_apart("nodekill", 'run("small")')
    _no_failures(r)
    assert (
        r["trials"]
        == nodekill.SIZES["small"]["chains"] * nodekill.SIZES["small"]["kills_per_chain"]
    )
    # (a loss right after a commit of the same step restores that commit instead)
    assert r["details"]["restored_with_peers_replicas"] >= 1
    assert r["details"]["steps_lost"]["max"] <= 1


def test_kill_at_two_ranks_small_campaign_passes() -> None:
    r = _run_apart("killranks", 'run("small")')
    _no_failures(r)
    assert r["details"]["restores"]["committed or newer"] > 0
    assert all(r["details"]["killed"].values())  # rank 0, rank 1 and both were killed
    # both background pipelines were killed, and the killed trainers' workers ended
    assert all(r["details"]["kills_by_pipeline"].values())
    assert r["details"]["workers_gone_after_their_ranks"]["count"] > 0


_HANDSHAKE_RANK = """
import faulthandler, os, signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from resumable.group import current_group
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
faulthandler.register(signal.SIGUSR1, file=open(out, "w"), all_threads=True)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
print("joined", flush=True)
if rank == 1:
    current_group(60.0)  # rank 0 never comes: waits in torch's handshake
time.sleep(60)
"""


def test_the_side_group_handshake_is_told_from_the_stacks_of_a_real_rank(
    tmp_path: Path,
) -> None:
    """The campaign counts a survivor apart only while it is in torch's construction
    of the checkpointer's gloo group, as its faulthandler stacks show: a rank waiting
    there for a peer that never comes is told, one sleeping elsewhere is not."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO / "src")}
    dumps = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HANDSHAKE_RANK, str(r), str(port), str(dumps[r])],
            stdout=subprocess.PIPE,
            env=env,
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"joined\n"
        time.sleep(2.0)  # rank 1 is in new_group, rank 0 in time.sleep
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        stacks = [d.read_text() for d in dumps]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "_new_process_group_helper" in stacks[1], stacks[1]
    assert killranks._in_side_group_handshake(stacks[1])
    # what the campaign keeps of a rank's stacks still tells it (it kept the outermost
    # 3,000 characters once: under pytest, frames of pytest's own)
    assert killranks._in_side_group_handshake(killranks._innermost(stacks[1]))
    assert not killranks._in_side_group_handshake(stacks[0])
    assert not killranks._in_side_group_handshake("")


def test_kill_at_two_ranks_checker_catches_a_manifest_written_first() -> None:
    """`able_to_fail`'s launches, up to the first that the checks catch."""
    assert killranks.run("caught", commit="manifest-first")["failures"] > 0


def test_kill_with_incremental_checkpoints_small_campaign_passes() -> None:
    """Version 3 checkpoints, killed in saves and in retention deletes: every listed one
    verifies, its refs are committed, and relaunches restore bit for bit. (The ``v2_*``
    details count the checkpoints that refer to earlier ones: version 3 now.)"""
    r = incremental.run("small")
    d = r["details"]
    assert r["failures"] == 0, d["problems"]
    assert d["v2_checkpoints_seen"]["root"] > 0 and d["v2_checkpoints_seen"]["mirror"] > 0
    assert d["most_refs_of_one_checkpoint"] > 1 and d["held_only_by_a_reference_after_a_kill"] > 0
    assert any(k.startswith("retention") for k in d["kills"])
    assert any(k.startswith("commit") for k in d["kills"])
    assert d["restores"].get("storage v3", 0) > 0  # a relaunch read a version 3 checkpoint
    # a version 3 checkpoint writes its own chunks only: much less than a whole one
    assert d["median_own_bytes"]["v2"] < d["median_own_bytes"]["v1"] / 4


@pytest.mark.parametrize("phase", ["before", "after"])
def test_a_commit_kill_lands_at_its_commit_while_another_thread_commits(phase: str) -> None:
    """The storage's persist and the mirror's upload commit on two threads. The armed
    commit must die at its own n-th call, even when the other thread's call comes in
    while it commits (a CI run's campaign never reached its commit kills: the count was
    read again after the commit)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: two threads commit through the armed wrapper
        code = 1
        try:
            import threading

            def slow(self: Any, attempt: Any, manifest: bytes) -> bool:
                time.sleep(0.4)
                return False

            RenameCommit.commit = slow  # type: ignore[method-assign]
            incremental._arm(("commit", 1, phase), w)
            first = threading.Thread(target=RenameCommit.commit, args=(None, None, b""))
            first.start()  # the 1st call: it commits for 0.4 s
            time.sleep(0.1)
            RenameCommit.commit(None, None, b"")  # type: ignore[arg-type]  # the 2nd, meanwhile
            first.join()
            os.write(w, b"both returned\n")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = incremental._lines(r, 0.0, until=10)
    os.close(r)
    assert out == [f"killed commit {phase}"]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_kill_with_incremental_checker_catches_a_retention_that_ignores_refs() -> None:
    """`able_to_fail`'s launches, up to the first that the checks catch: a checkpoint
    listed whose references are gone."""
    r = incremental.run("caught", retention="ignore-refs")
    assert r["failures"] > 0
    assert any("refers to" in p for p in r["details"]["problems"]), r["details"]["problems"]


def test_retention_cut_after_any_delete_leaves_every_listed_checkpoint_whole(
    tmp_path: Path,
) -> None:
    """The campaign's first finding, in miniature: step 2 refers to step 1, step 3 to 1
    and 2, step 4 (written whole after a restart) to nothing; ``Keep(last=1)`` dooms 1-3. A
    crash after any one delete must leave no listed checkpoint that refers to a deleted
    one, so referrers go first (newest first: refs point to smaller steps)."""
    from resumable import Incremental, Keep
    from resumable.audit import AuditLog
    from resumable.commit import list_committed
    from resumable.reader import CheckpointReader
    from resumable.retention import apply_retention
    from resumable.storage import LocalStorage

    root = tmp_path / "root"
    state = incremental.make_state()
    for steps in ((1, 2, 3), (4,)):  # a new Checkpointer writes its first persist whole
        ck = incremental.checkpointer(
            root,
            state,
            keep=None,
            incremental=Incremental(chunk_bytes=incremental.CHUNK, min_bytes=0),
        )
        ck.restore()
        for step in steps:
            incremental.set_step(state, step)
            ck.save(step)
        ck.close()
    storage = LocalStorage(root)
    refs = {s: CheckpointReader(storage, s).manifest.get("refs", []) for s in (2, 3, 4)}
    assert refs == {2: [1], 3: [1, 2], 4: []}
    for cut in range(3):
        copy = tmp_path / f"cut{cut}"
        shutil.copytree(root, copy)
        copied = LocalStorage(copy)

        def crash_after(doomed: list[int], cut: int = cut) -> Any:
            yield from doomed[: cut + 1]
            raise KeyboardInterrupt  # the process dies here

        with pytest.raises(KeyboardInterrupt):
            apply_retention(copied, Keep(last=1), AuditLog(copied), each=crash_after)
        for s in list_committed(copied):
            CheckpointReader(copied, s).verify()


# --------------------------------------------------------------------------- campaign 2


def test_power_loss_small_campaign_passes() -> None:
    r = powerloss.run("small")
    assert r["failures"] == 0, r["details"]["examples"]
    assert r["trials"] > 100 and r["details"]["restores_checked"] >= 1


@pytest.mark.parametrize("broken", list(powerloss.BROKEN))
def test_power_loss_checker_catches_a_broken_save_path(broken: str) -> None:
    r = powerloss.run("small", **powerloss.BROKEN[broken])
    assert r["failures"] > 0


def test_power_loss_at_two_ranks_small_campaign_passes() -> None:
    r = powerlossranks.run("small")
    d = r["details"]
    assert r["failures"] == 0, d["examples"]
    assert r["trials"] > 100 and d["restores_checked"] >= 1
    assert d["cuts_beyond_the_recorded_order"] > 0  # one rank ahead of the recorded times
    assert d["ops_recorded_per_rank"][1] > 0 and d["op_kinds"]["rename"] > 0


@pytest.mark.parametrize("broken", list(powerlossranks.BROKEN))
def test_power_loss_at_two_ranks_checker_catches_a_broken_save_path(broken: str) -> None:
    """The small campaign on the broken path, up to the first crash state found wrong."""
    r = powerlossranks.run("caught", **powerlossranks.BROKEN[broken])
    assert r["failures"] > 0


# Two ranks' logs of one coordinated save: rank 0 opens the staging directory and
# broadcasts it, rank 1 writes its file and both gather the reports, then rank 0 commits.
_RANK0: list[Any] = [
    ("mkdir", "d"),
    ("mark", "enter", 1),
    ("mark", "leave", (1, "from0")),
    ("create", "d/a"),
    ("mark", "enter", 2),
    ("mark", "leave", (2, "all")),
    ("create", "d/m"),
    ("rename", "d", "s"),
    ("mark", "committed", 1),
]
_RANK1: list[Any] = [
    ("mark", "enter", 1),
    ("mark", "leave", (1, "from0")),
    ("create", "d/f"),
    ("write", "d/f", 0, b"x"),
    ("fsync", "d/f", False),
    ("mark", "enter", 2),
    ("mark", "leave", (2, "all")),
]
_TIMES = [[1, 2, 5, 6, 9, 12, 13, 14, 15], [3, 4, 7, 8, 9, 10, 11]]


def _consistent(req: list[list[int]], i: int, j: int) -> bool:
    return (i == 0 or req[0][i - 1] <= j) and (j == 0 or req[1][j - 1] <= i)


@pytest.mark.parametrize("rank0_waits", [True, False])
def test_two_rank_cuts_are_every_consistent_pair_once(rank0_waits: bool) -> None:
    logs = [_RANK0, _RANK1]
    req = powerlossranks.requirements(logs, _TIMES, rank0_waits=rank0_waits)
    got = [ij for ij, _ in powerlossranks.cuts(logs, _TIMES, rank0_waits=rank0_waits)]
    pairs = range(len(_RANK0) + 1), range(len(_RANK1) + 1)
    want = {(i, j) for i in pairs[0] for j in pairs[1] if _consistent(req, i, j)}
    assert len(got) == len(set(got)) and set(got) == want
    # rank 1 writes into the directory rank 0 made: never without it
    assert all(i >= 1 for i, j in got if j >= 3)
    # a cut past rank 0's commit holds rank 1's synced file, unless rank 0 does not wait
    late = {j for i, j in got if i == len(_RANK0)}
    assert (min(late) >= 5) == rank0_waits


def test_two_rank_cuts_model_the_file_system_of_each_cut() -> None:
    logs = [_RANK0, _RANK1]
    for (i, j), model in powerlossranks.cuts(logs, _TIMES):
        live = model.crash_state(crashstate.Choice((), ()))  # only what was synced
        kept = model.crash_state(
            crashstate.Choice(
                tuple((d.ino, len(d.pending)) for d in model.volatile()[0]),
                tuple((f.ino, "all", 0) for f in model.volatile()[1]),
            )
        )
        assert live == {}  # nothing of these logs syncs a directory
        assert ("d/f" in kept or "s/f" in kept) == (j >= 3)
        assert ("s" in kept) == (i >= 8)


def _replay_retention(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "root"
    root.mkdir()
    ops, expected = powerloss.record(str(root), 3, listdir_order="reversed")
    assert any(op[0] == "rename" and op[1] == step_dir(1) for op in ops)  # retention ran
    return powerloss.replay(ops, expected, variants=8, restore_every=0)


def test_retention_delete_survives_power_loss_in_any_listing_order(tmp_path: Path) -> None:
    """Regression: retention renamed a checkpoint aside and deleted its files without
    syncing the root between; a power loss could keep the unlinks (data file first, in
    this listing order) and lose the rename, listing step 1 without its data."""
    assert _replay_retention(tmp_path)["problem_counts"] == {}


def test_retention_delete_without_the_root_sync_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def delete_unsynced(self: RenameCommit, step: int) -> None:  # the code before the fix
        trash = f".trash-{step_dir(step)}.{os.getpid()}.00000000"
        self.storage.rename_dir(step_dir(step), trash)
        self.storage.delete(trash)

    monkeypatch.setattr(RenameCommit, "delete", delete_unsynced)
    assert _replay_retention(tmp_path)["problem_counts"].get("torn", 0) > 0


# --------------------------------------------------------------------------- campaign 3


def test_io_error_small_campaign_passes() -> None:
    r = ioerrors.run("small")
    assert r["failures"] == 0, r["details"]["examples"]
    assert r["details"]["outcomes"].get("StorageError", 0) > 0
    disk = r["details"]["full_disk"]
    if "skipped" not in disk:
        assert disk["failed_saves"] > 0 and disk["committed"] > 0 and not disk["problems"]


@pytest.mark.parametrize("broken", ioerrors.BROKEN)
def test_io_error_checker_catches_a_broken_fsync(broken: str) -> None:
    r = ioerrors.injected("fsyncs", broken=broken)
    assert r["failures"] > 0


def test_io_error_at_two_ranks_small_campaign_passes() -> None:
    r = ioranks.run("small")
    assert r["failures"] == 0, r["details"]["examples"]
    by_rank = r["details"]["outcomes_by_faulted_rank"]
    assert by_rank["rank 1"].get("PersistError/PersistError", 0) > 0
    assert by_rank["rank 0"].get("returned/returned", 0) > 0  # e.g. in retention
    disk = r["details"]["full_disk"]
    if "skipped" not in disk:
        assert disk["committed"] > 0 and not disk["problems"]
        assert disk["outcomes_rank0_rank1"].get("PersistError/PersistError", 0) > 0


@pytest.mark.parametrize("broken", list(ioranks.BROKEN))
def test_io_error_at_two_ranks_checker_catches_a_broken_save_path(broken: str) -> None:
    r = ioranks.injected(ioranks.BROKEN[broken], broken=broken)
    assert r["trials"] > 0 and r["failures"] > 0


def test_a_listing_error_before_a_two_rank_save_fails_no_rank_alone(tmp_path: Path) -> None:
    """Regression: before its first save (when restore() was not called) rank 0 alone
    lists the root, for a warning; an I/O error there was raised out of its save before
    the coordinated persist, and rank 1 waited for it until the group's timeout."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, ioranks.WORLD, is_master=True, wait_for_workers=False)
    pair = ioranks.Pair(store.port)
    try:
        base = str(tmp_path / "base")
        calls = ioranks.prepare(pair, base, counts=1)["calls"]
        key = next(c for c in calls[0] if c[0] == "listdir")
        work = str(tmp_path / "work")
        shutil.copytree(base, work)
        cmd = {"op": "save", "root": work, "rank": 0, "errno": errno.EIO, "key": key}
        saves, _, problems = ioranks.trial(pair, work, {**cmd, "sticky": False, "broken": None})
    finally:
        pair.close(kill=True)
    assert saves is not None and saves[0]["injected"], saves
    assert problems == [], problems
    assert [s["outcome"] for s in saves] == ["returned", "returned"]


# --------------------------------------------------------------------------- campaign 4


def test_corruption_small_campaign_passes() -> None:
    r = corruption.run("small")
    assert r["failures"] == 0, r["details"]["examples"]
    by_kind = r["details"]["mutations_by_kind"]
    assert all(v.get("detected", 0) > 0 for v in by_kind.values())


def test_corruption_checker_catches_a_reader_that_skips_checksums() -> None:
    assert corruption.able_to_fail()["checksum not checked"]["failures"] > 0


def test_corruption_at_two_ranks_small_campaign_passes() -> None:
    r = corruptranks.run("small")
    assert r["failures"] == 0, r["details"]["examples"]
    by_kind = r["details"]["mutations_by_kind"]
    assert set(by_kind) == set(corruptranks.KINDS)
    assert all(v.get("detected", 0) > 0 for v in by_kind.values())
    assert r["details"]["restores_checked"] >= 2 * len(corruptranks.KINDS)


def test_corruption_at_two_ranks_checker_catches_a_reader_that_skips_checksums() -> None:
    assert corruptranks.able_to_fail()["checksum not checked"]["failures"] > 0


# --------------------------------------------------------------------------- campaign 5


def test_hostile_small_campaign_passes() -> None:
    r = hostile.run("small")
    assert r["failures"] == 0, {k: v["examples"] for k, v in r["details"]["targets"].items()}
    assert r["trials"] == sum(hostile.SIZES["small"].values())


def test_hostile_checker_catches_broken_parsers() -> None:
    assert all(v["failures"] > 0 for v in hostile.able_to_fail().values())


# --------------------------------------------------------------------------- campaign 6


def _objectstore(**kw: Any) -> dict[str, Any]:
    try:
        return objectstore.run(**kw)
    except objectstore.SeaweedUnavailable as exc:
        pytest.skip(str(exc))


def test_object_storage_small_campaign_passes() -> None:
    r = _objectstore(size="small")
    _no_failures(r)
    shapes = r["details"]["kill_sweep"]["shapes"]
    assert len(shapes) == len(objectstore.SHAPES)
    assert all(s["kills"].get("dropped", 0) > 0 for s in shapes.values()), shapes
    rates = r["details"]["fault_sweep"]["rates"]
    assert all(v["outcomes"].get("committed", 0) > 0 for v in rates.values()), rates
    assert sum(v["injected"].get("error", 0) for v in rates.values()) > 0, rates


def test_object_storage_at_two_ranks_small_campaign_passes() -> None:
    """Two ranks on SeaweedFS through the fault proxy: kills of either or both ranks in
    a save, and a 10% request failure rate; nothing torn or half-ranked listed."""
    try:
        r = objectstoreranks.run("small")
    except objectstore.SeaweedUnavailable as exc:
        pytest.skip(str(exc))
    _no_failures(r)
    kills = next(iter(r["details"]["kill_sweep"].values()))
    assert sum(kills["killed"].values()) == objectstoreranks.SIZES["small"]["launches"]
    faults = next(iter(r["details"]["fault_sweep"].values()))
    assert faults["outcomes"].get("committed", 0) > 0 and faults["injected"], faults


def test_object_storage_at_two_ranks_catches_a_manifest_written_first() -> None:
    """`able_to_fail`'s launches, up to the first that the checks catch."""
    try:
        r = objectstoreranks.run("caught", broken="manifest-first")
    except objectstore.SeaweedUnavailable as exc:
        pytest.skip(str(exc))
    assert r["failures"] > 0


@pytest.mark.parametrize("broken", list(objectstore.BROKEN))
def test_object_storage_checker_catches_a_broken_commit(broken: str) -> None:
    shape = objectstore.SHAPES[objectstore.BROKEN[broken]]
    r = _objectstore(size="caught", broken=broken, shapes=(shape,))
    assert r["failures"] > 0


def test_hostile_counts_slow_and_stuck_executions_as_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hostile, "HANG_S", 0.05)
    monkeypatch.setattr(hostile, "WATCHDOG_S", 0.2)
    slow = hostile.fuzz("slow", Target(lambda _: 0.1, time.sleep), 2)
    assert slow["outcomes"] == {"hang": 2} and slow["slowest_s"] >= 0.1
    t = time.perf_counter()
    stuck = hostile.fuzz("stuck", Target(lambda _: 60.0, time.sleep), 1)
    assert stuck["failures"] == 1 and time.perf_counter() - t < 5


def test_hostile_counts_opens_outside_the_roots_and_imports(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "inside").write_bytes(b"x")
    (tmp_path / "outside").write_bytes(b"x")

    def reads(path: Path) -> Target:
        return Target(lambda _: path, Path.read_bytes, roots=lambda _: (str(root),))

    inside = hostile.fuzz("inside", reads(root / "inside"), 1)
    outside = hostile.fuzz("outside", reads(tmp_path / "outside"), 1)
    dotdot = hostile.fuzz("dotdot", reads(root / ".." / "outside"), 1)

    def fresh_import(name: str) -> None:
        sys.modules.pop(name, None)
        importlib.import_module(name)

    imports = hostile.fuzz("import", Target(lambda _: "json.tool", fresh_import), 1)
    assert inside["outcomes"] == {"ok": 1}
    assert outside["outcomes"] == dotdot["outcomes"] == {"audit events": 1}
    assert imports["outcomes"] == {"audit events": 1}


# --------------------------------------------------------------------------- campaign 7


def test_endurance_small_campaign_passes() -> None:
    # In a process of its own: the descriptors and threads it counts are then the
    # campaign's alone, not those of objects earlier tests left to the collector.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from stress import endurance; print(json.dumps(endurance.run('small')))",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    r = json.loads(out.stdout.splitlines()[-1])
    _no_failures(r)
    assert r["details"]["at_end"]["checkpoints"] == endurance.KEEP


@pytest.mark.parametrize("broken", endurance.BROKEN)
def test_endurance_checker_catches_a_leaking_save_path(broken: str) -> None:
    assert endurance.run("small", saves=60, broken=broken)["failures"] > 0


def test_endurance_sizes_a_tree_whose_files_vanish_while_it_is_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's discard thread removes a trash directory while the campaign sums the
    root: a file listed, then gone, counts as nothing (it failed a CI run)."""
    (tmp_path / "step-000000000002").mkdir()
    (tmp_path / "step-000000000002" / "a").write_bytes(b"x" * 10)
    walked = list(os.walk(tmp_path))
    walked.append((str(tmp_path / ".trash-step-000000000001.1.ab"), [], ["gone"]))
    monkeypatch.setattr(endurance.os, "walk", lambda root: iter(walked))
    assert endurance._tree_bytes(str(tmp_path)) == (10, 0, 0, 10)


def test_endurance_bounds_retention_by_the_largest_checkpoint_not_the_warm_up_average(
    tmp_path: Path,
) -> None:
    """A later checkpoint can be a few bytes longer than the warm-up's: the bound is the
    largest directory seen, so four of them fit it (an average of the warm-up's missed
    by 2 bytes and failed a CI run)."""
    for step, size in ((118, 100), (119, 101), (120, 102), (121, 102)):
        d = tmp_path / f"step-{step:012d}"
        d.mkdir()
        (d / "manifest.json").write_bytes(b"x" * size)
    steps, _, _, largest = endurance._tree_bytes(str(tmp_path))
    assert (steps, largest) == (405, 102)
    assert steps <= (endurance.KEEP + 1) * largest


# --------------------------------------------------------------------------- the runner


def test_runner_writes_results_and_the_page(tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    shutil.copy(REPO / "docs" / "reliability.md", doc)
    results = tmp_path / "results.json"
    assert (
        main(
            ["--size", "small", "--only", "powerloss", "--results", str(results), "--doc", str(doc)]
        )
        == 0
    )
    r = json.loads(results.read_text())["powerloss"]
    text = doc.read_text()
    assert f"**{r['trials']:,} trials, 0 failures**" in text
    assert "python -m stress --size small --only powerloss" in text
    assert all(f"<!-- stress:{name}:begin -->" in text for name in DONE)


def test_published_page_matches_its_results() -> None:
    """docs/reliability.md is what `python -m stress` renders from docs/reliability.json."""
    from stress.report import render

    results = REPO / "docs" / "reliability.json"
    if not results.exists():
        pytest.skip("no results yet: run make stress")
    text = (REPO / "docs" / "reliability.md").read_text()
    assert render(text, json.loads(results.read_text())) == text


def test_endurance_at_two_ranks_small_campaign_passes() -> None:
    """Two ranks, persist workers coordinating through rank 0's store: nothing grows."""
    r = enduranceranks.run("small")
    _no_failures(r)
    assert r["details"]["restored_steps"] == [r["trials"]] * 2
    end = r["details"]["samples"][0]["end"]
    assert end["checkpoints"] == enduranceranks.KEEP and "worker" in end


@pytest.mark.parametrize("broken", enduranceranks.BROKEN)
def test_endurance_at_two_ranks_catches_a_leaking_save_path(broken: str) -> None:
    assert enduranceranks.run("small", saves=60, broken=broken)["failures"] > 0
