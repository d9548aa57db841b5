"""Campaign 3b, I/O errors at two ranks: campaign 3 (`stress.ioerrors`) for a job of two
ranks in a real ``torch.distributed`` gloo process group, the error injected on one rank.

Two ranks are forked from this process once (torch is imported once, here) and join a
gloo group through a ``TCPStore`` that this process hosts on a free loopback port; they
then run the trials this process sends them, one after another, over pipes (a fresh
group per trial would cost more than the trial). For each trial this process copies a
root holding committed steps 1 and 2 of the two-rank job (``Keep(last=2)``, so saving
step 3 also runs retention on rank 0) into a fresh directory; both ranks build a
`Checkpointer` on it (``persist="sync"``: the coordinated commit runs on the training
thread, over the checkpointer's side gloo group) and save step 3, one of them with the
`stress.fsops` interposer failing one of its file-system calls, with ``EIO`` or
``ENOSPC``, once or from then on. Rank 1's calls are those of its own data file; rank
0's, the listing before its first save (`restore` is not called), its data file, the
commit (manifest, renames, syncs), the audit log and retention. Clean saves are counted
first (`COUNTS` of them), and every call any of them made on the chosen rank is tried,
named by its kind, its path without the attempt's random suffix and how many such calls
came before it: the ranks race to create the attempt's directory, so the calls, and
their indices, vary from one save to the next. A trial whose save never made its call
is run once more with the other rank waiting `LAG_S` before its first call in the
attempt (so that it loses the race), then, if the call is still not made, counted as
not reached.

Each trial is judged here, on what both ranks report and what the root holds:

- both ranks' ``save`` end alike: both raise a `CheckpointError` (a clean failure), or
  both return (the error fell where the library may absorb it, e.g. in retention after
  the commit). Ranks that disagree, or any other exception, are failures;
- no false commit: a listed checkpoint holding a file whose ``fsync`` failed (on either
  rank) and that was not written again from scratch since; an ``fsync`` tried again on
  the descriptor where it failed; or a save that returned while a name of step 3 (its
  directory, a file of either rank in it) was never synced in its directory. Rank 1's
  names are followed through rank 0's commit: its file is created in the staging
  directory that rank 0 syncs and renames once every rank reported;
- every listed checkpoint verifies, lists world size 2 and holds a data file of each
  rank; step 2 stays listed; step 3 is listed if the saves returned;
- what the failed attempt left in the root is counted, with its bytes, and must have
  been named in a WARNING on one of the ranks;
- then both ranks build a fresh `Checkpointer` and restore: both must come back at the
  newest listed step with exactly the values saved at that step.

A rank that has not answered within `TRIAL_TIMEOUT_S` is a hang (a failure): both are
killed and a fresh pair is forked for the next trial.

Full disk (`full_disk`): an 8 MiB tmpfs is mounted (root only; skipped with the reason
otherwise) and both ranks save 18 steps of a wider model into it, past full; every save
must end alike on both ranks, each failed one with a `CheckpointError` naming
``ENOSPC``, within the group's timeout, leaving no staging directory; the last
committed step must be listed, whole, and restored by both ranks exactly.

The broken save paths (``broken``), which the same checks must catch:
``"ignore-fsync-error"`` and ``"retry-fsync"`` (rank 1 swallows, or retries once, a
failed fsync of its data file), ``"commit-despite-error"`` (rank 0 drops the error
reports of the other ranks and commits with the files it has) and
``"no-directory-fsync"`` (no rank syncs a directory: rank 1's file, in the staging
directory, and step 3's name in the root are never made durable).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

import resumable.group
import resumable.retrying
from resumable.commit import list_committed, step_dir
from resumable.errors import CheckpointError
from resumable.reader import CheckpointReader
from stress.fsops import ERRNOS, Fault, FileOps, no_directory_fsync
from stress.ioerrors import _leftovers, _Records
from stress.workload import checkpointer, local, make_state, set_step

SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "errnos": ("EIO", "ENOSPC"),
        "modes": ("once", "sticky"),
        "stride": 29,
        "ranks": (0, 1),
    },
    "full": {
        "errnos": ("EIO", "ENOSPC"),
        "modes": ("once", "sticky"),
        "stride": 1,
        "ranks": (0, 1),
    },
    # the able-to-fail runs: EIO once at each call of rank 1's save
    "able": {"errnos": ("EIO",), "modes": ("once",), "stride": 1, "ranks": (1,)},
    # and EIO once at every 16th call of rank 0's: errors that the saves survive
    "able0": {"errnos": ("EIO",), "modes": ("once",), "stride": 16, "ranks": (0,)},
}
BROKEN = {
    "ignore-fsync-error": "able",
    "retry-fsync": "able",
    "commit-despite-error": "able",
    "no-directory-fsync": "able0",
}
"""The broken save paths, and the size of the run that must catch each."""
WORLD = 2
STEP = 3
DIST_TIMEOUT_S = 10.0
TRIAL_TIMEOUT_S = 60.0
LAG_S = 0.05
"""How long a rank waits before its first call in an attempt, to lose the race to create
the attempt's directory (a retry, when the call a trial targets was not made)."""
COUNTS = 6
"""Clean saves counted: the union of their calls is tried."""
WAITED_OUT = 0.8
"""A save that took this share of ``DIST_TIMEOUT_S`` waited for a peer that had left."""


# --------------------------------------------------------------------------- the ranks


def _state(rank: int, width: int = 64) -> dict[str, Any]:
    state = make_state(width)
    state["mine"] = torch.zeros(1024)
    return state


def _set(state: dict[str, Any], step: int, rank: int) -> None:
    """The model depends only on ``step`` (replicated); ``mine`` on ``step`` and ``rank``."""
    set_step(state, step)
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    state["mine"].copy_(torch.randn(state["mine"].shape, generator=g))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta = [*a["model"].state_dict().values(), a["mine"]]
    tb = [*b["model"].state_dict().values(), b["mine"]]
    return all(torch.equal(x, y) for x, y in zip(ta, tb))


def _ck(root: str, state: dict[str, Any]) -> Any:
    return checkpointer(root, state, dist_timeout_s=DIST_TIMEOUT_S)


def _base(rank: int, root: str, steps: list[int] | None = None) -> dict[str, Any]:
    """Save ``steps`` (1 and 2 by default) into ``root``; with ``steps``, keep them all."""
    state = _state(rank)
    ck = _ck(root, state) if steps is None else checkpointer(root, state, keep=None)
    for step in steps or (1, 2):
        _set(state, step, rank)
        ck.save(step)
    ck.close()
    return {"based": True}


NOT_YET = sys.maxsize  # the index of a keyed fault's call, until it is met
_ATTEMPT_SUFFIX = re.compile(r"\.\d+\.[0-9a-f]{8}")


def call_keys(calls: list[list[str]]) -> list[list[Any]]:
    """The calls of a save, each named so that another save can find it again: its
    kind, its path without the attempt's random suffix, and how many calls of that kind
    on that path came before it. (Indices alone do not carry over: the two ranks race to
    create the attempt's directory, so which rank makes the ``mkdir`` varies.)"""
    seen: dict[tuple[str, str], int] = {}
    keys = []
    for kind, path in calls:
        name = (kind, _ATTEMPT_SUFFIX.sub(".*", path))
        keys.append([*name, seen.get(name, 0)])
        seen[name] = seen.get(name, 0) + 1
    return keys


def merged(runs: list[list[list[Any]]]) -> list[list[Any]]:
    """The union of the calls of several saves (`call_keys`), each call placed after
    the one that came before it in the first save that made it."""
    out: list[list[Any]] = []
    for keys in runs:
        after = -1
        for key in keys:
            if key in out:
                after = out.index(key)
            else:
                after += 1
                out.insert(after, key)
    return out


class KeyedFault(Fault):
    """A `Fault` on the call named ``key`` (`call_key`), whatever its index."""

    def __init__(self, errno: int, key: list[Any], sticky: bool) -> None:
        super().__init__(errno, NOT_YET, sticky)
        self.key = key
        self.seen: dict[tuple[str, str], int] = {}


class _KeyedOps(FileOps):
    """`FileOps` failing the call a `KeyedFault` names (once, or from then on)."""

    lag_s = 0.0  # how long to wait before this rank's first call in an attempt

    def _call(self, kind: str, rel: str) -> None:
        if self.lag_s and rel.startswith(".tmp-"):
            time.sleep(self.lag_s)  # let the other rank create the attempt's directory
            self.lag_s = 0.0
        f = self.fault
        if isinstance(f, KeyedFault) and f.at == NOT_YET:
            with self._lock:
                name = (kind, _ATTEMPT_SUFFIX.sub(".*", rel))
                nth = f.seen.get(name, 0)
                f.seen[name] = nth + 1
                if [*name, nth] == f.key:
                    f.at = len(self.calls)  # from here on, the plain index rule
        super()._call(kind, rel)


class _Gathered:
    """Marks, in this rank's op log, the moment the ranks' reports were gathered: every
    rank's own writes came before it."""

    ops: FileOps | None = None


def _save(rank: int, cmd: dict[str, Any], records: _Records) -> dict[str, Any]:
    """Save step 3 into ``cmd["root"]``, with ``cmd``'s fault if it is for this rank."""
    root = cmd["root"]
    state = _state(rank)
    _set(state, STEP, rank)
    ck = _ck(root, state)
    mine = cmd.get("rank") == rank
    fault = KeyedFault(cmd["errno"], cmd["key"], sticky=cmd["sticky"]) if mine else None
    ops = _KeyedOps(
        root,
        fault=fault,
        record=True,
        broken=cmd.get("broken") if mine else None,
        skip=no_directory_fsync if cmd.get("skip_dir_fsync") else None,
    )
    if cmd.get("lag") == rank:
        ops.lag_s = LAG_S
    records.messages.clear()
    raised: BaseException | None = None
    no_backoff = SimpleNamespace(sleep=lambda s: None)
    _Gathered.ops = ops
    try:
        with mock.patch.object(resumable.retrying, "time", no_backoff), ops.active():
            t0 = time.perf_counter()
            try:
                ck.save(STEP)
            except BaseException as exc:
                raised = exc
            took = time.perf_counter() - t0
    finally:
        _Gathered.ops = None
    try:
        ck.close()
    except CheckpointError:
        pass
    after = False
    synced: list[Any] = []  # rank 0's op log after the gather (renames, syncs, removals)
    for op in ops.ops:
        if op[0] == "mark" and op[1] == "gathered":
            after = True
        elif after and op[0] in ("fsync", "rename", "unlink", "rmdir"):
            synced.append(list(op))
    return {
        "outcome": "returned" if raised is None else type(raised).__name__,
        "clean": raised is None or isinstance(raised, CheckpointError),
        "error": None if raised is None else str(raised)[:300],
        "save_s": round(took, 3),
        "injected": [list(i) for i in fault.injected] if fault is not None else [],
        "calls": ops.calls if cmd.get("count") else [],
        "poisoned": [list(p) for p in ops.poisoned],
        "fsync_after_failure": ops.fsync_after_failure,
        "unsynced": sorted(ops.unsynced),
        "after_gather": synced,
        "warnings": list(records.messages),
    }


def _restore(rank: int, cmd: dict[str, Any]) -> dict[str, Any]:
    width = cmd.get("width", 64)
    state = _state(rank, width)
    ck = _ck(cmd["root"], state)
    got = ck.restore()
    ck.close()
    expected = _state(rank, width)
    _set(expected, got, rank)
    return {"restored": got, "same": got == 0 or _same(state, expected)}


def _fill(rank: int, cmd: dict[str, Any]) -> dict[str, Any]:
    """Save steps 1.. ``cmd["steps"]`` of a wider model into ``cmd["root"]`` (a small
    file system, which fills up), whatever each save's outcome; after each, what it ended
    with and (rank 0) the staging and trash directories in the root."""
    root = cmd["root"]
    state = _state(rank, cmd["width"])
    ck = checkpointer(root, state, keep=None, dist_timeout_s=DIST_TIMEOUT_S)
    saves = []
    for step in range(1, cmd["steps"] + 1):
        _set(state, step, rank)
        t0 = time.perf_counter()
        try:
            ck.save(step)
            saves.append({"step": step, "outcome": "returned"})
        except BaseException as exc:
            saves.append(
                {
                    "step": step,
                    "outcome": type(exc).__name__,
                    "clean": isinstance(exc, CheckpointError),
                    "errno": getattr(exc, "errno", None),
                    "error": str(exc)[:300],
                }
            )
        saves[-1]["save_s"] = round(time.perf_counter() - t0, 3)
        if rank == 0:
            saves[-1]["left"] = _leftovers(root)
    try:
        ck.close()
    except CheckpointError:
        pass
    return {"saves": saves}


def _serve(rank: int, port: int, prefix: str, cmd_fd: int, out_fd: int) -> None:
    """One rank: join the group, then run the commands read from ``cmd_fd`` (a JSON line
    each), answering each with a JSON line on ``out_fd``, until told to quit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    logger = logging.getLogger("resumable")
    records = _Records()
    logger.addHandler(records)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    store = dist.PrefixStore(
        prefix, dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    original = resumable.group.Group.gather

    def gather(self: Any, obj: Any, name: str = "") -> list[Any]:
        out = original(self, obj, name)
        if _Gathered.ops is not None and name == "reports":  # `write_distributed`'s
            _Gathered.ops.mark("gathered")
        return out

    resumable.group.Group.gather = gather  # type: ignore[method-assign]
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(cmd_fd, 65536)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "save":
                reply = _save(rank, cmd, records)
            elif cmd["op"] == "restore":
                reply = _restore(rank, cmd)
            elif cmd["op"] == "fill":
                reply = _fill(rank, cmd)
            else:
                reply = _base(rank, cmd["root"], cmd.get("steps"))
        except BaseException as exc:
            reply = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
        os.write(out_fd, json.dumps(reply).encode() + b"\n")


class Pair:
    """Two forked ranks in one gloo group, serving commands."""

    launches = 0

    def __init__(self, store_port: int) -> None:
        Pair.launches += 1
        prefix = f"launch-{Pair.launches}"
        self.ranks: list[tuple[int, int, int]] = []  # (pid, command write end, answer read end)
        for rank in range(WORLD):
            cr, cw = os.pipe()
            ar, aw = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(cw)
                    os.close(ar)
                    for _, w, r in self.ranks:
                        os.close(w)
                        os.close(r)
                    _serve(rank, store_port, prefix, cr, aw)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)  # no teardown: the group may be broken
            os.close(cr)
            os.close(aw)
            self.ranks.append((pid, cw, ar))
        self.bufs = [b""] * WORLD

    def ask(self, cmds: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]] | None:
        """Send each rank its command; their answers, or None after ``timeout_s``."""
        for (_, w, _), cmd in zip(self.ranks, cmds):
            os.write(w, json.dumps(cmd).encode() + b"\n")
        deadline = time.perf_counter() + timeout_s
        answers: list[dict[str, Any] | None] = [None] * WORLD
        while any(a is None for a in answers):
            waiting = [r for _, _, r in self.ranks if answers[self._index(r)] is None]
            ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.perf_counter()))
            if not ready:
                return None
            for fd in ready:
                i = self._index(fd)
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return None
                self.bufs[i] += chunk
                if b"\n" in self.bufs[i]:
                    line, self.bufs[i] = self.bufs[i].split(b"\n", 1)
                    answers[i] = json.loads(line)
        return answers  # type: ignore[return-value]

    def _index(self, fd: int) -> int:
        return [r for _, _, r in self.ranks].index(fd)

    def close(self, kill: bool = False) -> None:
        for pid, w, _ in self.ranks:
            if kill:
                os.kill(pid, signal.SIGKILL)
            else:
                try:
                    os.write(w, b'{"op": "quit"}\n')
                except OSError:
                    pass
            os.close(w)
        for pid, _, r in self.ranks:
            os.waitpid(pid, 0)
            os.close(r)
        self.ranks = []


# --------------------------------------------------------------------------- the judge


def _loose(r0: dict[str, Any], r1: dict[str, Any]) -> list[str]:
    """Names of step 3 that were never synced in their directory: rank 0's own, and
    rank 1's followed through what rank 0 did once every report was in (the only time
    rank 0 touches rank 1's names)."""
    final = step_dir(STEP)
    pending = set(r1["unsynced"])
    for op in r0["after_gather"]:
        kind = op[0]
        if kind == "fsync" and op[2]:
            pending = {p for p in pending if os.path.dirname(p) != op[1]}
        elif kind == "rename":
            s, d = op[1], op[2]
            moved = {p for p in pending if p == s or p.startswith(s + "/")}
            pending = (pending - moved) | {d + p[len(s) :] for p in moved}
        elif kind in ("unlink", "rmdir"):
            pending = {p for p in pending if p != op[1] and not p.startswith(op[1] + "/")}
    pending |= set(r0["unsynced"])
    return sorted(p for p in pending if p == final or p.startswith(final + "/"))


def judge_root(root: str, poisoned: Collection[tuple[Any, ...]] = ()) -> dict[str, Any]:
    """Problems with the checkpoints ``root`` lists: one that does not verify, that
    lacks a rank's data file or lists another world size, or that holds a file whose
    fsync failed (``poisoned``: device and inode)."""
    storage = local(root)
    listed = list_committed(storage)
    problems = []
    for step in listed:
        d = os.path.join(root, step_dir(step))
        for f in os.listdir(d):
            st = os.stat(os.path.join(d, f))
            if (st.st_dev, st.st_ino) in poisoned:
                problems.append(
                    f"false commit: step {step} lists {f}, whose fsync failed and which was "
                    "not written again since"
                )
        try:
            reader = CheckpointReader(storage, step)
            reader.verify()
            manifest = reader.manifest
        except CheckpointError as exc:
            problems.append(f"torn: step {step} listed but does not verify: {exc}")
            continue
        files = sorted(manifest.get("files", {}))
        ranks = {r for r in range(WORLD) for f in files if f.startswith(f"rank-{r:05d}")}
        if manifest.get("world_size") != WORLD or len(ranks) != WORLD:
            problems.append(
                f"torn: step {step} listed with world size {manifest.get('world_size')} "
                f"and the files {files}"
            )
    return {"problems": problems, "listed": listed}


def judge(work: str, saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Problems with the root and the ranks' reports after a trial's saves."""
    problems: list[str] = []
    for r, rep in enumerate(saves):
        if "failed" in rep:
            problems.append(f"rank {r}'s harness failed: {rep['failed']}")
    if problems:
        return {"problems": problems, "committed": False, "left": {}}
    outcomes = [rep["outcome"] for rep in saves]
    for r, rep in enumerate(saves):
        if not rep["clean"]:
            problems.append(f"unclean on rank {r}: {rep['outcome']}: {rep['error']}")
        if rep["fsync_after_failure"]:
            problems.append(
                f"false commit: rank {r} retried an fsync after it failed on "
                f"{rep['fsync_after_failure']}"
            )
    for r, rep in enumerate(saves):
        if rep["save_s"] >= WAITED_OUT * DIST_TIMEOUT_S:
            problems.append(
                f"rank {r} waited {rep['save_s']:.1f}s in its save, out to the group's "
                f"timeout of {DIST_TIMEOUT_S}s ({rep['outcome']}: {rep['error']})"
            )
    returned = [o == "returned" for o in outcomes]
    if len(set(returned)) != 1:
        problems.append(f"the ranks disagree: {outcomes} ({[rep['error'] for rep in saves]})")
    storage = local(work)
    listed = list_committed(storage)
    if all(returned):
        loose = _loose(saves[0], saves[1])
        if loose:
            problems.append(f"false commit: the saves returned, but {loose} were never synced")
    poisoned = {tuple(p) for rep in saves for p in rep["poisoned"]}
    problems += judge_root(work, poisoned)["problems"]
    if 2 not in listed:
        problems.append("lost: the previous checkpoint (step 2) is not listed")
    if any(returned) and STEP not in listed:
        problems.append("lost: a save returned but step 3 is not listed")
    left = _leftovers(work)
    said = [m for rep in saves for m in rep["warnings"]]
    unreported = [n for n in left if not any(n in m for m in said)]
    if not all(returned) and unreported:
        problems.append(f"left behind without a word: {unreported}")
    return {"problems": problems, "committed": STEP in listed, "left": left, "listed": listed}


# --------------------------------------------------------------------------- the campaign


def prepare(pair: Pair, base: str, counts: int = COUNTS) -> dict[str, Any]:
    """Save steps 1 and 2 of the two-rank job into ``base``; then ``counts`` clean saves
    of step 3 into copies, each judged. Returns ``calls``: per rank, the union of the
    interposed calls of its saves (`merged`), and ``per_save``: how many each made."""
    got = pair.ask([{"op": "base", "root": base}] * WORLD, TRIAL_TIMEOUT_S)
    if got is None or any("failed" in a for a in got):
        raise RuntimeError(f"the two-rank job could not save steps 1 and 2: {got}")
    runs: dict[int, list[list[list[Any]]]] = {r: [] for r in range(WORLD)}
    for _ in range(counts):
        work = base + "-count"
        shutil.copytree(base, work)
        got = pair.ask([{"op": "save", "root": work, "count": True}] * WORLD, TRIAL_TIMEOUT_S)
        if got is None or any("failed" in a or a["outcome"] != "returned" for a in got):
            raise RuntimeError(f"a clean save of step 3 failed: {got}")
        clean = judge(work, got)
        if clean["problems"]:
            raise RuntimeError(f"a clean save of step 3 was judged bad: {clean['problems']}")
        shutil.rmtree(work)
        for r in range(WORLD):
            runs[r].append(call_keys(got[r]["calls"]))
    return {
        "calls": {r: merged(runs[r]) for r in range(WORLD)},
        "per_save": {r: sorted({len(k) for k in runs[r]}) for r in range(WORLD)},
    }


def trial(
    pair: Pair, work: str, cmd: dict[str, Any]
) -> tuple[list[dict[str, Any]] | None, dict[str, Any], list[str]]:
    """Both ranks save step 3 into ``work`` with ``cmd``'s fault, then restore; their
    reports, the verdict on the root, and every problem found."""
    saves = pair.ask([cmd] * WORLD, TRIAL_TIMEOUT_S)
    if saves is None:
        return None, {}, [f"a rank did not answer in {TRIAL_TIMEOUT_S}s"]
    if not saves[cmd["rank"]].get("injected", [None]):
        return saves, {}, []  # the fault was never reached
    verdict = judge(work, saves)
    problems = list(verdict["problems"])
    back = pair.ask([{"op": "restore", "root": work}] * WORLD, TRIAL_TIMEOUT_S)
    newest = max(verdict.get("listed") or [0])
    if back is None:
        problems.append("a rank did not answer its restore")
        return saves, verdict, problems
    for r, b in enumerate(back):
        if "failed" in b:
            problems.append(f"rank {r} restore: {b['failed']}")
        elif b["restored"] != newest or not b["same"]:
            problems.append(
                f"rank {r} restored step {b['restored']} (values as saved: {b['same']}), "
                f"newest listed is {newest}"
            )
    return saves, verdict, problems


@contextmanager
def _broken(kind: str | None) -> Iterator[dict[str, Any]]:
    """Within the block (and in ranks forked in it), the broken save path ``kind``;
    yields what the trials' commands must add for it."""
    if kind in ("ignore-fsync-error", "retry-fsync"):
        yield {"broken": kind}  # the faulted rank's `FileOps`
        return
    if kind == "no-directory-fsync":
        yield {"skip_dir_fsync": True}  # every rank's `FileOps`
        return
    if kind is None:
        yield {}
        return
    if kind != "commit-despite-error":
        raise ValueError(f"unknown broken save path {kind!r}")
    original = resumable.group.Group.gather

    def gather(self: Any, obj: Any, name: str = "") -> list[Any]:
        out = original(self, obj, name)
        if name == "reports" and self.coordinator:
            out = [r for r in out if "error" not in r]  # commit with what is there
        return out

    resumable.group.Group.gather = gather  # type: ignore[method-assign]
    try:
        yield {}
    finally:
        resumable.group.Group.gather = original  # type: ignore[method-assign]


def _indices(calls: list[list[Any]], stride: int) -> list[int]:
    chosen = set(range(0, len(calls), stride)) if stride else set()
    chosen |= {i for i, c in enumerate(calls) if c[0] == "fsync"}
    return sorted(chosen)


def injected(size: str, broken: str | None = None) -> dict[str, Any]:
    from torch.distributed import TCPStore

    cfg = SIZES[size]
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    trials = failures = not_reached = hangs = launches = lagged = 0
    outcomes: dict[str, int] = {}
    per_rank: dict[str, dict[str, int]] = {}
    left_bytes = left_trials = committed_after_failure = restores = 0
    examples: list[Any] = []
    calls: dict[int, list[list[Any]]] = {}
    counted: dict[str, Any] = {"per_save": {}}
    trial_s: list[float] = []
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ioranks-") as tmp, _broken(broken) as extra:
        base = os.path.join(tmp, "base")
        pair = Pair(store.port)
        launches += 1
        try:
            counted = prepare(pair, base)
            calls = counted["calls"]
            n = 0
            for rank in cfg["ranks"]:
                for name in cfg["errnos"]:
                    for mode in cfg["modes"]:
                        for at in _indices(calls[rank], cfg["stride"]):
                            n += 1
                            work = os.path.join(tmp, f"t{n}")
                            shutil.copytree(base, work)
                            cmd = {
                                "op": "save",
                                "root": work,
                                "rank": rank,
                                "errno": ERRNOS[name],
                                "key": calls[rank][at],
                                "sticky": mode == "sticky",
                                **extra,
                            }
                            t1 = time.perf_counter()
                            saves, verdict, problems = trial(pair, work, cmd)
                            if saves is not None and not saves[rank].get("injected", [None]):
                                # the call belongs to the other outcome of the ranks' race
                                # to create the attempt's directory: once more, the other
                                # rank lagging
                                shutil.rmtree(work)
                                shutil.copytree(base, work)
                                cmd["lag"] = 1 - rank
                                saves, verdict, problems = trial(pair, work, cmd)
                                lagged += 1
                            if saves is not None and not saves[rank].get("injected", [None]):
                                not_reached += 1
                                shutil.rmtree(work, ignore_errors=True)
                                continue
                            if saves is None or any("did not answer" in p for p in problems):
                                hangs += 1
                                pair.close(kill=True)
                                pair = Pair(store.port)
                                launches += 1
                            restores += 1
                            trial_s.append(time.perf_counter() - t1)
                            trials += 1
                            key = "/".join(s["outcome"] for s in saves) if saves else "hang"
                            outcomes[key] = outcomes.get(key, 0) + 1
                            side = per_rank.setdefault(f"rank {rank}", {})
                            side[key] = side.get(key, 0) + 1
                            if saves and verdict:
                                if saves[0]["outcome"] != "returned" and verdict["committed"]:
                                    committed_after_failure += 1
                                if verdict["left"]:
                                    left_trials += 1
                                    left_bytes += sum(verdict["left"].values())
                            if problems:
                                failures += 1
                                if len(examples) < 5:
                                    c = calls[rank][at]
                                    examples.append(
                                        {
                                            "rank": rank,
                                            "errno": name,
                                            "mode": mode,
                                            "call": at,
                                            "at": f"{c[0]} {c[1]} (#{c[2]})",
                                            "problems": problems[:4],
                                        }
                                    )
                            shutil.rmtree(work, ignore_errors=True)
        finally:
            pair.close(kill=True)
            del store
    kinds = {
        f"rank {r}": {k: sum(1 for c in calls.get(r, []) if c[0] == k) for k in _kinds(calls, r)}
        for r in range(WORLD)
    }
    trial_s.sort()
    return {
        "trials": trials,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "ranks": WORLD,
            "clean_saves_counted": COUNTS,
            "calls_per_save": {f"rank {r}": counted["per_save"][r] for r in range(WORLD)},
            "calls_tried_per_errno_and_mode": {
                f"rank {r}": len(_indices(calls[r], cfg["stride"])) for r in cfg["ranks"]
            },
            "call_kinds": kinds,
            "faulted_ranks": list(cfg["ranks"]),
            "errnos": list(cfg["errnos"]),
            "modes": list(cfg["modes"]),
            "calls_tried": "every call"
            if cfg["stride"] == 1
            else f"every fsync, and every {cfg['stride']}th call"
            if cfg["stride"]
            else "every fsync",
            "outcomes_rank0_rank1": outcomes,
            "outcomes_by_faulted_rank": per_rank,
            "failed_but_committed_whole": committed_after_failure,
            "trials_leaving_files": left_trials,
            "bytes_left_behind": left_bytes,
            "restores_checked": restores,
            "retried_with_the_other_rank_lagging": lagged,
            "not_reached": not_reached,
            "hangs": hangs,
            "launches": launches,
            "median_trial_s": round(trial_s[len(trial_s) // 2], 3) if trial_s else None,
            "dist_timeout_s": DIST_TIMEOUT_S,
            "examples": examples,
        },
    }


def _kinds(calls: dict[int, list[list[Any]]], r: int) -> list[str]:
    seen: list[str] = []
    for kind, *_ in calls.get(r, []):
        if kind not in seen:
            seen.append(kind)
    return seen


def full_disk(mb: int = 8, width: int = 400, steps: int = 18) -> dict[str, Any]:
    """Both ranks save into a real ``mb`` MiB tmpfs (root only) until well past full:
    every save must end alike on both ranks, each failed one cleanly, with ``ENOSPC``
    named, in bounded time, leaving no staging directory; the newest committed step
    must be listed, whole, and restored by both ranks exactly."""
    from torch.distributed import TCPStore

    t0 = time.perf_counter()
    mnt = tempfile.mkdtemp(prefix="fulldisk2-")
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", mnt],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        os.rmdir(mnt)
        return {"skipped": f"mount could not run: {exc}"}
    if proc.returncode != 0:
        os.rmdir(mnt)
        return {"skipped": f"mount -t tmpfs refused: {proc.stderr.strip()}"}
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    last_ok = 0
    left: dict[str, int] = {}
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    pair = Pair(store.port)
    try:
        root = os.path.join(mnt, "root")
        cmd = {"op": "fill", "root": root, "width": width, "steps": steps}
        got = pair.ask([cmd] * WORLD, TRIAL_TIMEOUT_S * 2)
        if got is None or any("failed" in g for g in got):
            problems.append(f"the ranks did not finish their saves: {got}")
            got = None
        for i in range(steps if got else 0):
            s0, s1 = got[0]["saves"][i], got[1]["saves"][i]  # type: ignore[index]
            key = f"{s0['outcome']}/{s1['outcome']}"
            outcomes[key] = outcomes.get(key, 0) + 1
            step = s0["step"]
            left.update(s0["left"])
            if s0["outcome"] == s1["outcome"] == "returned":
                last_ok = step
                continue
            if (s0["outcome"] == "returned") != (s1["outcome"] == "returned"):
                problems.append(f"step {step}: the ranks disagree: {key}")
            for r, sv in enumerate((s0, s1)):
                if sv["outcome"] != "returned" and not sv["clean"]:
                    problems.append(f"step {step}: rank {r} unclean: {key}: {sv['error']}")
                if sv["save_s"] >= WAITED_OUT * DIST_TIMEOUT_S:
                    problems.append(f"step {step}: rank {r} waited {sv['save_s']}s")
            said = " ".join(sv.get("error") or "" for sv in (s0, s1))
            errnos = {sv.get("errno") for sv in (s0, s1)}
            if errno.ENOSPC not in errnos and os.strerror(errno.ENOSPC) not in said:
                problems.append(f"step {step}: failed without naming ENOSPC: {said}")
        if left:
            problems.append(f"staging left behind after failed saves: {sorted(left)}")
        if got:
            verdict = judge_root(root)
            problems += verdict["problems"]
            listed = verdict["listed"]
            if not last_ok or max(listed, default=0) != last_ok:
                problems.append(f"newest listed {listed[-1:]} is not the last saved {last_ok}")
            back = pair.ask([{"op": "restore", "root": root, "width": width}] * WORLD, 60)
            if back is None:
                problems.append("a rank did not answer its restore")
            else:
                for r, b in enumerate(back):
                    if "failed" in b or b["restored"] != last_ok or not b["same"]:
                        problems.append(f"rank {r} restore: {b}, not step {last_ok}")
        used = shutil.disk_usage(mnt).used
    finally:
        pair.close(kill=True)
        del store
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)
    return {
        "tmpfs_mib": mb,
        "saves": steps,
        "outcomes_rank0_rank1": outcomes,
        "committed": last_ok,
        "disk_used_bytes_at_end": used,
        "problems": problems[:10],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def run(size: str) -> dict[str, Any]:
    result = injected(size)
    disk = full_disk()
    result["details"]["full_disk"] = disk
    if "skipped" not in disk:
        result["trials"] += disk["saves"]
        result["failures"] += len(disk["problems"])
        result["seconds"] = round(result["seconds"] + disk["seconds"], 1)
    return result


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks on each broken save path (EIO once at each call of rank 1's save)."""
    out = {}
    for kind, size in BROKEN.items():
        r = injected(size, broken=kind)
        out[kind] = {"trials": r["trials"], "failures": r["failures"]}
    return out
