"""Campaign 2b, power loss at two ranks: campaign 2 (`stress.powerloss`) for a job of
two ranks in a real ``torch.distributed`` gloo process group, saving into one root with
the coordinated commit of ``docs/distributed.md``.

Recording: this process hosts a ``TCPStore`` on a free loopback port and forks two
ranks, which join a gloo group through it. Each rank runs a `Checkpointer` on the shared
root (persist ``sync``, ``Keep(last=2)``, so the coordination runs over the side gloo
group on the training thread and rank 0 runs retention) and saves steps 1..``saves``,
while its own `stress.fsops.FileOps` records every file operation it makes inside the
root, each with the ``CLOCK_MONOTONIC`` time it returned (a ``mkdir``: the time it
started, since the other rank may use the directory the moment it exists). Rank 0's
log also marks the moment each commit returned. Each collective of the checkpointer's
`resumable.group.Group` is marked in both logs (entered, returned).

Crash states of the node (one power loss takes both ranks at once): a *cut* is a
prefix of rank 0's log and a prefix of rank 1's, consistent with happens-before:

- a rank's operations after a collective returned come after the other rank's
  operations before it entered the collective, when data flowed from the other rank
  (an all-gather or all-reduce: both ways; a broadcast: rank 0 to rank 1 only); so a
  cut with rank 0 past a commit includes rank 1's data file of that step (rank 0
  commits after the gather of the reports);
- an operation on a file or directory the other rank created, or inside such a
  directory, comes after that creation (the ranks race to create the staging
  directory of each step).

Every consistent cut is enumerated (none sampled): the ranks' operations merged in the
order of their times (which respects happens-before: both ranks read one clock), every
prefix of that order, and, from each, every run of the other rank's following
operations that stays consistent (the cuts where one rank got further than the times
say). For each cut, `stress.crashstate.FsModel` replays the cut's operations in that
order and builds the states a power loss could leave (unsynced directory changes lost
per directory, unsynced bytes dropped, torn at 4 KiB or read as zeros): everything
lost, everything kept and ``variants`` seeded random mixes. Each distinct state (and
set of commits that had returned) is written to a scratch directory and judged by the
library's own listing and reader, as in campaign 2: lost, torn, phantom, plus a
checkpoint listed without both ranks' data files. Every ``restore_every``-th state is
also restored by a fresh single-process `Checkpointer` (world size 1,
``reset_per_rank_state``), which must come back at the newest checkpoint committed
before the crash, or newer.
"""

from __future__ import annotations

import bisect
import logging
import os
import pickle
import random
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from resumable.commit import list_committed, parse_step_dir
from resumable.errors import CheckpointError
from resumable.reader import CheckpointReader
from stress.crashstate import FsModel, Inode, fingerprint, materialise
from stress.fsops import FileOps, Op, no_directory_fsync
from stress.powerloss import judge as judge_one
from stress.workload import (
    broken_commit,
    checkpointer,
    local,
    make_state,
    on_commit,
    set_step,
    tensor_sums,
)

SIZES: dict[str, dict[str, Any]] = {
    "small": {"saves": 3, "variants": 4, "restore_every": 50},
    "full": {"saves": 50, "variants": 32, "restore_every": 100},
    # `make test`'s able-to-fail runs: "small", up to the first crash state found wrong
    "caught": {"saves": 3, "variants": 4, "restore_every": 50, "until_caught": True},
}
SEED = 20261127
WORLD = 2
WIDTH = 128  # 64 KiB of weights per rank: 16 pages to tear
DIST_TIMEOUT_S = 30.0
RECORD_TIMEOUT_S = 300.0


def _set(state: dict[str, Any], step: int, rank: int) -> None:
    """Weights that depend on the step; ``mine`` on the step and the rank."""
    set_step(state, step)
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    state["mine"].copy_(torch.randn(state["mine"].shape, generator=g))


def _state() -> dict[str, Any]:
    state = make_state(WIDTH)
    state["mine"] = torch.zeros(1024)
    return state


# --------------------------------------------------------------------------- recording


class TimedOps(FileOps):
    """`FileOps` that also keeps, for every recorded operation, the ``CLOCK_MONOTONIC``
    time it returned (a ``mkdir``: the time it started)."""

    def __init__(self, root: str, **kw: Any) -> None:
        super().__init__(root, **kw)
        self.times: list[int] = []
        self._started: int | None = None

    def _op(self, *op: Any) -> None:
        if self.record:
            with self._lock:
                t = self._started if op[0] == "mkdir" and self._started else time.monotonic_ns()
                self.ops.append(op)
                self.times.append(t)

    def mark(self, label: str, value: Any = None) -> None:
        with self._lock:
            self.ops.append(("mark", label, value))
            self.times.append(time.monotonic_ns())

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        self._started = time.monotonic_ns()
        try:
            super()._mkdir(path, mode, dir_fd=dir_fd)
        finally:
            self._started = None


@contextmanager
def _collective_marks(ops: TimedOps) -> Iterator[None]:
    """Mark each collective of the checkpointer's `Group` in ``ops``: ``("mark",
    "enter", n)`` before and ``("mark", "leave", (n, kind))`` after it returned, ``kind``
    ``"all"`` (every rank's data reaches every rank) or ``"from0"`` (a broadcast)."""
    from resumable.group import Group

    originals = {name: getattr(Group, name) for name in ("gather", "broadcast", "any")}
    seq = [0]

    def wrap(name: str, kind: str) -> Callable[..., Any]:
        original = originals[name]

        def call(self: Group, *args: Any, **kw: Any) -> Any:
            seq[0] += 1
            n = seq[0]
            ops.mark("enter", n)
            out = original(self, *args, **kw)
            ops.mark("leave", (n, kind))
            return out

        return call

    Group.gather = wrap("gather", "all")  # type: ignore[method-assign]
    Group.broadcast = wrap("broadcast", "from0")  # type: ignore[method-assign]
    Group.any = wrap("any", "all")  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(Group, name, fn)


def _rank_job(
    rank: int,
    port: int,
    prefix: str,
    root: str,
    out: str,
    saves: int,
    skip: Callable[[str, str, bool], bool] | None,
    commit: str | None,
    order: str,
) -> None:
    """One rank: join the group, save steps 1..``saves`` while recording, write the
    log (and, on rank 0, the tensors' checksums of every step) to ``out``."""
    import torch.distributed as dist

    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    store = dist.PrefixStore(
        prefix, dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    state = _state()
    expected: dict[int, dict[str, str]] = {}
    ops = TimedOps(root, skip=skip, listdir_order=order)
    with (
        ops.active(),
        _collective_marks(ops),
        on_commit(lambda step: ops.mark("committed", step)),
        broken_commit(commit),
    ):
        ck = checkpointer(root, state, dist_timeout_s=DIST_TIMEOUT_S)
        for step in range(1, saves + 1):
            _set(state, step, rank)
            ck.save(step)
            if rank == 0:
                expected[step] = tensor_sums(local(root), step)
        ck.close()
    with open(out, "wb") as f:
        pickle.dump({"ops": ops.ops, "times": ops.times, "expected": expected}, f)
    dist.destroy_process_group()


def record(
    root: str,
    saves: int,
    *,
    skip: Callable[[int], Callable[[str, str, bool], bool] | None] | None = None,
    commit: str | None = None,
    listdir_order: str = "os",
) -> tuple[list[list[Op]], list[list[int]], dict[int, dict[str, str]]]:
    """Run the two ranks over the empty directory ``root``; return each rank's op log,
    its times, and the tensor checksums of every step. ``skip(rank)``: that rank's
    `FileOps` skip rule (a broken save path)."""
    from torch.distributed import TCPStore

    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    prefix = f"powerlossranks-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory(prefix="powerlossranks-out-") as tmp:
        pids = []
        for rank in range(WORLD):
            out = os.path.join(tmp, f"rank{rank}.pickle")
            pid = os.fork()
            if pid == 0:  # the child never returns
                code = 0
                try:
                    log = os.path.join(tmp, f"rank{rank}.log")
                    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
                    rule = skip(rank) if skip is not None else None
                    _rank_job(
                        rank, store.port, prefix, root, out, saves, rule, commit, listdir_order
                    )
                except BaseException:
                    code = 1
                    traceback.print_exc()
                finally:
                    os._exit(code)
            pids.append(pid)
        deadline = time.monotonic() + RECORD_TIMEOUT_S
        statuses: dict[int, int] = {}
        while len(statuses) < WORLD:
            for pid in pids:
                if pid not in statuses:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[pid] = status
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in statuses:
                        os.kill(pid, 9)
                        statuses[pid] = os.waitpid(pid, 0)[1]
            time.sleep(0.01)
        logs = []
        for rank, pid in enumerate(pids):
            if statuses[pid] != 0:
                with open(os.path.join(tmp, f"rank{rank}.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"rank {rank} of the recording failed:\n{tail}")
            with open(os.path.join(tmp, f"rank{rank}.pickle"), "rb") as f:
                logs.append(pickle.load(f))
    del store
    return [g["ops"] for g in logs], [g["times"] for g in logs], logs[0]["expected"]


# --------------------------------------------------------------------------- the cuts


def requirements(
    ops: list[list[Op]], times: list[list[int]], *, rank0_waits: bool = True
) -> list[list[int]]:
    """``req[r][i]``: how many of the other rank's first operations a cut that holds
    operation ``i`` of rank ``r`` must hold too (non-decreasing in ``i``). Without
    ``rank0_waits``, rank 0 depends on nothing of rank 1's (a broken commit that does
    not wait for the reports)."""
    enter = [{op[2]: i for i, op in enumerate(log) if op[:2] == ("mark", "enter")} for log in ops]
    # Who created each directory, and when: (rank, index) in the merged order.
    merged = merge(times)
    created: dict[str, tuple[int, int]] = {}
    fs_need: list[dict[int, int]] = [{}, {}]
    for r, i in merged:
        op = ops[r][i]
        if op[0] == "mark":
            continue
        paths = [op[1]] + ([op[2]] if op[0] in ("rename", "link") else [])
        need = 0
        for path in paths:
            parts = path.split("/")
            for depth in range(1, len(parts) + 1):
                maker = created.get("/".join(parts[:depth]))
                if maker is not None and maker[0] != r:
                    need = max(need, maker[1] + 1)
        if need:
            fs_need[r][i] = need
        if op[0] in ("mkdir", "create"):
            created[op[1]] = (r, i)
        elif op[0] == "link":
            created[op[2]] = (r, i)
        elif op[0] in ("unlink", "rmdir"):
            created.pop(op[1], None)
        elif op[0] == "rename":
            src, dst = op[1], op[2]
            for path in [p for p in created if p == src or p.startswith(src + "/")]:
                created[dst + path[len(src) :]] = created.pop(path)
    req: list[list[int]] = []
    for r, log in enumerate(ops):
        other = 1 - r
        need = 0
        row = []
        for i, op in enumerate(log):
            if op[:2] == ("mark", "leave"):
                n, kind = op[2]
                if (kind == "all" and (r == 1 or rank0_waits)) or (kind == "from0" and r == 1):
                    need = max(need, enter[other][n] + 1)
            need = max(need, fs_need[r].get(i, 0))
            row.append(need)
        req.append(row)
    return req


def merge(times: list[list[int]]) -> list[tuple[int, int]]:
    """Both logs as one sequence of ``(rank, index)``, in the order of their times."""
    out = [(t, r, i) for r, ts in enumerate(times) for i, t in enumerate(ts)]
    out.sort()
    return [(r, i) for _, r, i in out]


def _clone(model: FsModel) -> FsModel:
    """A copy of ``model`` whose live inodes can change without touching the original
    (inodes no directory reaches any more are shared: nothing changes them)."""
    live = {0}
    stack = [0]
    while stack:
        node = model.inodes[stack.pop()]
        if not node.is_dir:
            continue
        refs = set(node.entries.values()) | set(node.durable.values())
        for change in node.pending:
            refs |= {v for v in change.values() if v is not None}
        for ino in refs - live:
            live.add(ino)
            stack.append(ino)
    copy = FsModel.__new__(FsModel)
    copy.inodes = {}
    for ino, n in model.inodes.items():
        copy.inodes[ino] = (
            Inode(
                n.ino,
                n.is_dir,
                dict(n.entries),
                dict(n.durable),
                [dict(c) for c in n.pending],
                bytearray(n.data),
                n.synced,
            )
            if ino in live
            else n
        )
    return copy


def cuts(
    ops: list[list[Op]], times: list[list[int]], *, rank0_waits: bool = True
) -> Iterator[tuple[tuple[int, int], FsModel]]:
    """Every consistent cut ``(i, j)`` (rank 0's first ``i`` operations, rank 1's
    first ``j``) once, with a model of the file system after its operations. The model
    is shared between successive cuts: use it before asking for the next."""
    req = requirements(ops, times, rank0_waits=rank0_waits)
    merged = merge(times)
    counts = [0, 0]
    for r, i in merged:  # the merged order must respect happens-before
        counts[r] += 1
        if req[r][i] > counts[1 - r]:
            raise AssertionError(f"op {i} of rank {r} ordered before what it depends on")
    model = FsModel({})
    counts = [0, 0]
    for k in range(len(merged) + 1):
        if k:
            r, i = merged[k - 1]
            model.apply(ops[r][i])
            counts[r] += 1
        yield (counts[0], counts[1]), model
        if k == len(merged):
            break
        # cuts whose longest prefix of the merged order is merged[:k]: the other rank's
        # following operations, as long as they need nothing of rank r's beyond k
        r = merged[k][0]
        other = 1 - r
        extra: FsModel | None = None
        got = list(counts)
        for q in range(counts[other], len(ops[other])):
            if req[other][q] > counts[r]:
                break
            if extra is None:
                extra = _clone(model)
            extra.apply(ops[other][q])
            got[other] += 1
            yield (got[0], got[1]), extra


# --------------------------------------------------------------------------- judging


def judge(
    scratch: str, committed: set[int], deleting: set[int], expected: dict[int, dict[str, str]]
) -> list[str]:
    """Campaign 2's judgement, and every listed checkpoint holds both ranks' files."""
    problems = judge_one(scratch, committed, deleting, expected)
    storage = local(scratch)
    try:
        listed = list_committed(storage)
    except CheckpointError:
        return problems
    for step in listed:
        try:
            manifest = CheckpointReader(storage, step).manifest
        except CheckpointError:
            continue  # reported above
        files = manifest.get("files", {})
        ranks = {v.get("rank") for v in files.values()}
        if manifest.get("world_size") != WORLD or ranks != set(range(WORLD)):
            kind = "lost" if step in committed - deleting else "torn"
            problems.append(
                f"{kind}: step {step} listed with world size {manifest.get('world_size')} "
                f"and files of ranks {sorted(ranks, key=str)}"
            )
    return problems


def restores_newest(scratch: str, committed: set[int], deleting: set[int]) -> str | None:
    """Restore with a fresh single-process Checkpointer; a problem in words, or None."""
    want = max(committed - deleting, default=0)
    try:
        ck = checkpointer(scratch, _state(), keep=None)
        try:
            got = ck.restore(reset_per_rank_state=True)
        finally:
            ck.close()
    except CheckpointError as exc:
        return f"restore failed: {exc}" if want else None
    if got < want:
        return f"restore came back at step {got}, step {want} was committed"
    return None


def replay(
    ops: list[list[Op]],
    times: list[list[int]],
    expected: dict[int, dict[str, str]],
    *,
    variants: int,
    restore_every: int,
    seed: int = SEED,
    rank0_waits: bool = True,
    until_caught: bool = False,
) -> dict[str, Any]:
    """Check every distinct crash state of every consistent cut of the two logs
    (``rank0_waits``: see `requirements`; ``until_caught``: up to the first state
    found wrong)."""
    rng = random.Random(seed)
    # rank 0's commits and retention's renames, by position in its log
    commits = [(i, op[2]) for i, op in enumerate(ops[0]) if op[:2] == ("mark", "committed")]
    deletes = [
        (i, parse_step_dir(op[1]))
        for i, op in enumerate(ops[0])
        if op[0] == "rename" and parse_step_dir(op[1]) is not None
    ]
    commit_at = [i for i, _ in commits]
    delete_at = [i for i, _ in deletes]
    seen: set[tuple[str, frozenset[int]]] = set()
    n_cuts = states = restores = generated = 0
    failures: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    quiet = logging.getLogger("resumable")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="powerlossranks-") as tmp:
            scratch = os.path.join(tmp, "root")
            for (i, j), model in cuts(ops, times, rank0_waits=rank0_waits):
                n_cuts += 1
                committed = {s for _, s in commits[: bisect.bisect_left(commit_at, i)]}
                deleting = {s or 0 for _, s in deletes[: bisect.bisect_left(delete_at, i)]}
                live = frozenset(committed - deleting)
                for choice in model.choices(rng, variants):
                    generated += 1
                    state = model.crash_state(choice)
                    key = (fingerprint(state), live)
                    if key in seen:
                        continue
                    seen.add(key)
                    states += 1
                    materialise(state, scratch)
                    problems = judge(scratch, committed, deleting, expected)
                    if not problems and restore_every and states % restore_every == 0:
                        restores += 1
                        materialise(state, scratch)
                        bad = restores_newest(scratch, committed, deleting)
                        problems = [bad] if bad else []
                    for p in problems:
                        kind = p.split(":", 1)[0]
                        counts[kind] = counts.get(kind, 0) + 1
                    if problems and len(failures) < 20:
                        failures.append(
                            {
                                "cut": [i, j],
                                "rank0_op": _show(ops[0][i - 1]) if i else None,
                                "rank1_op": _show(ops[1][j - 1]) if j else None,
                                "problems": problems[:3],
                            }
                        )
                    if problems and until_caught:
                        break
                if counts and until_caught:
                    break
    finally:
        quiet.setLevel(level)
    return {
        "cuts": n_cuts,
        "states": states,
        "generated": generated,
        "restores": restores,
        "problem_counts": counts,
        "examples": failures,
    }


def _show(op: Op) -> str:
    return " ".join(str(a) if not isinstance(a, bytes) else f"<{len(a)} bytes>" for a in op)


def run(
    size: str,
    *,
    skip: Callable[[int], Callable[[str, str, bool], bool] | None] | None = None,
    commit: str | None = None,
    rank0_waits: bool = True,
) -> dict[str, Any]:
    """Record and replay, once with each directory listed in name order and once in
    reverse; ``skip``/``commit``/``rank0_waits`` break the save path (the able-to-fail
    runs)."""
    cfg = SIZES[size]
    t0 = time.perf_counter()
    totals = {"states": 0, "generated": 0, "restores": 0, "cuts": 0, "linear": 0}
    ops_per_rank = [0, 0]
    counts: dict[str, int] = {}
    kinds: dict[str, int] = {}
    examples: list[Any] = []
    record_s = 0.0
    for n, order in enumerate(("sorted", "reversed")):
        with tempfile.TemporaryDirectory(prefix="powerlossranks-rec-") as tmp:
            root = os.path.join(tmp, "root")
            os.mkdir(root)
            t1 = time.perf_counter()
            ops, times, expected = record(
                root, cfg["saves"], skip=skip, commit=commit, listdir_order=order
            )
            record_s += time.perf_counter() - t1
            shutil.rmtree(root, ignore_errors=True)
        for r, log in enumerate(ops):
            ops_per_rank[r] += len(log)
            for op in log:
                kinds[op[0]] = kinds.get(op[0], 0) + 1
        totals["linear"] += len(ops[0]) + len(ops[1]) + 1
        result = replay(
            ops,
            times,
            expected,
            variants=cfg["variants"],
            restore_every=cfg["restore_every"],
            seed=SEED + n,
            rank0_waits=rank0_waits,
            until_caught=cfg.get("until_caught", False),
        )
        for key in ("states", "generated", "restores", "cuts"):
            totals[key] += result[key]
        for k, v in result["problem_counts"].items():
            counts[k] = counts.get(k, 0) + v
        examples += result["examples"][:3]
        if counts and cfg.get("until_caught"):
            break
    return {
        "trials": totals["states"],
        "failures": sum(counts.values()),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "ranks": WORLD,
            "saves_per_recording": cfg["saves"],
            "recordings": "2 (directories listed in name order, then reversed)",
            "recording_s": round(record_s, 1),
            "ops_recorded_per_rank": ops_per_rank,
            "op_kinds": kinds,
            "consistent_cuts": totals["cuts"],
            "cuts_beyond_the_recorded_order": totals["cuts"] - totals["linear"],
            "cuts_sampled": False,
            "states_generated": totals["generated"],
            "distinct_states_checked": totals["states"],
            "random_mixes_per_cut": cfg["variants"],
            "restore_every_nth_state": cfg["restore_every"],
            "restores_checked": totals["restores"],
            "problem_counts": counts,
            "examples": examples[:5],
            "seed": SEED,
        },
    }


def _rank1_no_file_fsync(rank: int) -> Callable[[str, str, bool], bool] | None:
    """Rank 1 never syncs its data file (rank 0's save path is the library's)."""
    if rank != 1:
        return None
    return lambda kind, path, is_dir: kind == "fsync" and not is_dir


def _rank0_no_directory_fsync(rank: int) -> Callable[[str, str, bool], bool] | None:
    """Rank 0, which commits, never syncs a directory."""
    return no_directory_fsync if rank == 0 else None


BROKEN: dict[str, dict[str, Any]] = {
    "rank 1's data file not fsynced": {"skip": _rank1_no_file_fsync},
    "no directory fsync on rank 0": {"skip": _rank0_no_directory_fsync},
    "manifest written first": {"commit": "manifest-first"},
    # modelled: the recorded operations, with rank 0's wait for the reports taken out
    # of happens-before (a commit that does not wait for rank 1's data file)
    "rank 0 commits without waiting for rank 1": {"rank0_waits": False},
}


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks run on each broken save path (small size)."""
    out = {}
    for name, kw in BROKEN.items():
        r = run("small", **kw)
        out[name] = {"trials": r["trials"], "failures": r["failures"]}
    return out
