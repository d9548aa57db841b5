"""Campaign 1c, kill -9 with incremental checkpoints: campaign 1 (`stress.kill`) for a job
whose state has a large part that never changes, so that its checkpoints are written
incrementally (format version 3: a manifest that refers to byte ranges of earlier
checkpoints' data files), while retention deletes constantly and references keep old checkpoints
alive.

The state (`Net`, ~400 KiB, cut into 16 KiB chunks by ``Incremental(chunk_bytes=16 KiB,
min_live=0.5, min_bytes=0)``, the other settings the defaults):

- ``frozen``: 128 KiB (8 chunks) that never change;
- ``slow``: 256 KiB (16 chunks); chunk ``i`` gets new values at every step ``s`` with
  ``s % 16 == i``, so each persist writes about one of its chunks and refers to the
  others, which lie in up to 16 earlier checkpoints; ``min_live=0.5`` would have the
  first, whole checkpoint of a launch written again after 12 of its slow chunks
  changed (the cleaner), but with the default ``max_overhead`` and ``whole_every`` a
  whole checkpoint usually releases the chain first (the details count the referring
  checkpoints that rewrote frozen chunks);
- ``fast``: a Linear(64, 64) whose values change at every step.

In the launches that persist on a thread, `resumable.incremental.EARLY_MIN_BYTES` is
lowered to 64 KiB, so that ``frozen`` (the chunks that did not change at the last
comparison) is hashed while the data file is written (`DeltaBase.plan_early`), as a
fine-tuning job's frozen base of 32 MiB or more is: kills land during those early
writes too. (A persist worker process is a new interpreter and keeps the 32 MiB.)

Every value depends only on the step, so the values of any checkpoint are known. Each
launch is a process forked from this one: a `Checkpointer` with ``Keep(last=2,
every_steps=EVERY)`` (retention deletes after nearly every commit; references hold
older checkpoints) and a local mirror with ``mirror_keep=Keep(last=3)``. Chains take
three set-ups in turn (`SETUPS`): persists on a background thread with the memory tier
on (a snapshot in shared memory every step, ``on_busy="skip"``: the relaunch restores
from shared memory when it holds something newer); on a thread with the memory tier off
(every save is a persist, ``on_busy="wait"``), shared memory emptied before each
relaunch, as by a node restart, so that the relaunch restores from disk, mostly from a
version 3 checkpoint; and the same in a persist worker process (which must end by itself
within `ORPHAN_TIMEOUT_S` of its trainer's kill, found by a tag in its environment;
only timer kills there, and the window starts at the restore). The launch
restores, checks every restored tensor bit for bit against the values of that step,
tells this process the step, the tier it came from and the restored checkpoint's format
version, then saves step after step until killed.

Kills, three kinds (``plan``):

- ``timer``: ``SIGKILL`` from this process at a random moment, uniform over the first
  ``window_s`` seconds of the launch (at once if the restore came later), or over
  `PROCESS_WINDOW_S` after the restore with a worker process; a fifth land in the
  first 50 ms of the launch instead, during start-up and restore;
- ``retention``: the launch kills itself (``SIGKILL``) inside the n-th checkpoint
  delete (local or mirror retention): before the un-commit rename, after it, after the
  root's sync, or after the first unlinks of the renamed directory;
- ``commit``: the launch kills itself just before or just after the n-th commit rename
  (data staged / committed, before the audit record and retention).

A targeted kill whose moment does not come within ``3 * window_s`` becomes a timer
kill. After each kill this process checks, in the root and the mirror: every listed
checkpoint verifies (`CheckpointReader.verify`, which follows every reference); every
step a listed checkpoint refers to is listed too, and every byte range that lies in
another checkpoint names a step of its ``refs``; the next launch restores the newest step whose
commit the audit log recorded, or a newer one, with exactly that step's values. Chains
of ``kills_per_chain`` kills share a root; each chain ends with a launch that is not
killed and must leave no staging or trash directory. Broken path: a retention that
ignores references (it keeps the 2 newest and deletes the rest).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import random
import secrets
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import resumable.incremental as inc_mod
from resumable import Every, Incremental, Keep
from resumable.audit import read_audit
from resumable.commit import RenameCommit, committer_for, list_committed, step_dir
from resumable.format import MANIFEST, tensor_ranges
from stress.workload import checkpointer, local, newest_commit, torn

SIZES: dict[str, dict[str, Any]] = {
    "small": {"chains": 3, "kills_per_chain": 5, "window_s": 1.0},
    "full": {"chains": 30, "kills_per_chain": 10, "window_s": 1.5},
    # `make test`'s able-to-fail run: "small"'s launches, up to the first after which a
    # problem is found (`able_to_fail` runs them all)
    "caught": {"chains": 3, "kills_per_chain": 5, "window_s": 1.0, "until_caught": True},
}
SEED = 3
LAUNCH_TIMEOUT_S = 60.0
CHUNK = 16 << 10  # bytes
ROW = 256  # float32 values per row: 1 KiB, so a chunk is 16 rows
FROZEN_ROWS, SLOW_ROWS = 128, 256  # 8 and 16 chunks
EARLY_BYTES = 64 << 10  # `frozen` (128 KiB) is written early: see the module doc
SLOW_CHUNKS = SLOW_ROWS * ROW * 4 // CHUNK
EVERY = 20  # Keep(every_steps=...)
PLANS = (("timer", 0.4), ("retention", 0.35), ("commit", 0.25))
RETENTION_PHASES = ("before rename", "renamed", "synced", "unlinking")
COMMIT_PHASES = ("before", "after")
# (persist, memory tier) of each chain, in turn
SETUPS: tuple[tuple[str, bool], ...] = (("thread", True), ("thread", False), ("process", False))
PROCESS_WINDOW_S = 3.0
ORPHAN_TIMEOUT_S = 15.0
TAG = "RESUMABLE_STRESS_LAUNCH"
"""The environment variable that marks the persist worker of one launch."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.zeros(FROZEN_ROWS, ROW), requires_grad=False)
        self.slow = nn.Parameter(torch.zeros(SLOW_ROWS, ROW))
        self.fast = nn.Linear(64, 64)


def make_state() -> dict[str, Any]:
    return {"model": Net()}


def _values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def set_step(state: dict[str, Any], step: int) -> None:
    """Give the state the values of ``step`` (they depend on nothing else)."""
    net: Net = state["model"]
    rows = SLOW_ROWS // SLOW_CHUNKS
    with torch.no_grad():
        net.frozen.copy_(_values(7, net.frozen.shape))
        for i in range(SLOW_CHUNKS):
            changed = step - ((step - i) % SLOW_CHUNKS)  # the last step <= step that wrote it
            seed = 1_000_000 + i * 100_000 + max(changed, 0)
            net.slow[i * rows : (i + 1) * rows].copy_(_values(seed, (rows, ROW)))
        g = torch.Generator().manual_seed(step)
        for p in net.fast.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype
        and sa[k].shape == sb[k].shape
        and torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8))
        for k in sa
    )


# --------------------------------------------------------------------------- the child


def _die(out: int, what: str) -> None:
    os.write(out, f"killed {what}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(plan: tuple[Any, ...], out: int) -> None:
    """In the child: make it SIGKILL itself at the moment ``plan`` names."""
    kind = plan[0]
    if kind == "retention":
        _, nth, phase, unlinks = plan
        original_delete = RenameCommit.delete
        seen, counting = [0], threading.Lock()

        def delete(self: RenameCommit, step: int) -> None:
            with counting:  # local and mirror retention may delete at once (see commit)
                seen[0] += 1
                mine = seen[0]
            if mine != nth:
                original_delete(self, step)
                return
            what = f"retention {phase}"
            if phase == "before rename":
                _die(out, what)
            if phase == "unlinking":
                # The renamed directory may be removed on a thread of the persist
                # writer (RenameCommit.discard): the kill lands at the unlink after
                # ``unlinks`` of them, whichever thread makes it.
                real_unlink, count = os.unlink, [0]

                def unlink(*a: Any, **kw: Any) -> None:
                    count[0] += 1
                    if count[0] > unlinks:
                        _die(out, what)
                    real_unlink(*a, **kw)

                os.unlink = unlink
                original_delete(self, step)
                return
            # "renamed" / "synced": the steps of RenameCommit.delete, cut after one
            trash = f".trash-{step_dir(step)}.{os.getpid()}.{secrets.token_hex(4)}"
            self.storage.rename_dir(step_dir(step), trash)
            if phase == "synced":
                self.storage.sync_dir("")
            _die(out, what)

        RenameCommit.delete = delete  # type: ignore[method-assign]
    elif kind == "commit":
        _, nth, phase = plan
        original_commit = RenameCommit.commit
        commits, counting = [0], threading.Lock()

        def commit(self: RenameCommit, attempt: Any, manifest: bytes) -> bool:
            # The storage's persist thread and the mirror's upload commit at once: each
            # call takes its number under a lock and keeps it. (Reading the shared count
            # again after the commit missed the n-th whenever the other thread's commit
            # came in between: a CI run's campaign reached none of its commit kills.)
            with counting:
                commits[0] += 1
                mine = commits[0]
            if mine == nth and phase == "before":
                _die(out, "commit before")
            replaced = original_commit(self, attempt, manifest)
            if mine == nth:
                _die(out, "commit after")
            return replaced

        RenameCommit.commit = commit  # type: ignore[method-assign]


def _job(
    root: str,
    mirror: str,
    shm: str,
    out: int,
    steps: int | None,
    setup: tuple[str, bool],
    plan: Any,
    tag: str,
) -> None:
    """The child: restore, report, then save until killed (or ``steps`` more)."""
    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    persist, memory = setup
    os.environ[TAG] = tag  # inherited by a persist worker process
    inc_mod.EARLY_MIN_BYTES = EARLY_BYTES  # the file written while `frozen` is hashed
    stacks = open(os.path.join(os.path.dirname(root), f"stacks-{tag}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _arm(plan, out)
    state = make_state()
    ck = checkpointer(
        root,
        state,
        persist=persist,
        memory_every=Every(steps=1) if memory else None,
        keep=Keep(last=2, every_steps=EVERY),
        mirror=mirror,
        mirror_keep=Keep(last=3),
        shm_dir=shm,
        on_busy="skip" if memory else "wait",
        incremental=Incremental(chunk_bytes=CHUNK, min_live=0.5, min_bytes=0),
    )
    got = ck.restore()
    expected = make_state()
    set_step(expected, got)
    same = got == 0 or _same(state, expected)
    tier, version = "none", 0
    if got:
        restores = [e for e in read_audit(local(root)) if e.get("event") == "restore"]
        tier = str(restores[-1].get("tier", "?")) if restores else "?"
        where = {"storage": root, "mirror": mirror}.get(tier)
        if where is not None:
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(where, step_dir(got), MANIFEST), "rb") as f,
            ):
                version = int(json.load(f).get("format_version", 0))
    os.write(out, f"restored {got} {'ok' if same else 'mismatch'} {tier} {version}\n".encode())
    step = got
    while steps is None or step < got + steps:
        step += 1
        set_step(state, step)
        ck.save(step)
    ck.close()


def _launch(
    root: str,
    mirror: str,
    shm: str,
    steps: int | None,
    setup: tuple[str, bool],
    plan: Any,
    tag: str,
) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns
        code = 0
        try:
            os.close(r)
            _job(root, mirror, shm, w, steps, setup, plan, tag)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _lines(fd: int, timeout: float, until: int = 1) -> list[str]:
    """Up to ``until`` lines from ``fd``, waiting at most ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    data = b""
    while data.count(b"\n") < until:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return [x for x in data.decode(errors="replace").split("\n") if x]


# --------------------------------------------------------------------------- the checks


def _manifests(root: str) -> dict[int, dict[str, Any]]:
    out = {}
    for step in list_committed(local(root)):
        with (
            contextlib.suppress(OSError, ValueError),
            open(os.path.join(root, step_dir(step), MANIFEST), "rb") as f,
        ):
            out[step] = json.load(f)
    return out


def _refers(m: dict[str, Any]) -> bool:
    """Whether manifest ``m`` is of a checkpoint that refers to earlier ones: format
    version 3 (what the writer writes) or 2 (its predecessor, still read). The details'
    ``v2_*`` keys count these (their names predate version 3)."""
    version = m.get("format_version")
    return type(version) is int and version >= 2


def _ranges(info: Any) -> list[tuple[int | None, str, int, int]]:
    """`tensor_ranges` of a tensor entry; none where it is malformed (the listed
    checkpoint's `verify` in `torn` reports that)."""
    try:
        return tensor_ranges(info)
    except (KeyError, TypeError, IndexError, ValueError):
        return []


def _refs_problems(root: str, manifests: dict[int, dict[str, Any]]) -> list[str]:
    """Every step a listed checkpoint refers to is listed; every byte range held by
    another checkpoint names one of its refs; refs appear exactly in version 2 and 3
    manifests."""
    bad = []
    listed = set(manifests)
    for step, m in manifests.items():
        refs = m.get("refs", [])
        version = m.get("format_version")
        if bool(refs) != _refers(m):
            bad.append(f"step {step} of {root}: format_version {version} with refs {refs}")
        missing = sorted(set(refs) - listed)
        if missing:
            bad.append(f"step {step} of {root} refers to {missing}, which are not committed")
        for name, info in m.get("tensors", {}).items():
            for held, *_ in _ranges(info):
                if held is not None and held not in refs:
                    bad.append(f"step {step} of {root}: {name} lies in step {held}, not a ref")
    return bad


def _held_by_refs(manifests: dict[int, dict[str, Any]], keep: Keep) -> int:
    """Listed checkpoints the keep policy alone would not keep, but a kept one refers to."""
    steps = sorted(manifests)
    kept = set(steps[-keep.last :]) if keep.last else set()
    if keep.every_steps:
        kept |= {s for s in steps if s % keep.every_steps == 0}
    referenced = {r for m in manifests.values() for r in m.get("refs", [])}
    return len((set(steps) - kept) & referenced)


def _workers_of(tag: str) -> list[int]:
    """The live processes (persist workers) whose environment carries ``tag``."""
    want = f"{TAG}={tag}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read() + b"\0":
                    with open(f"/proc/{entry}/stat", "rb") as st:
                        if st.read().rsplit(b")", 1)[-1].split()[0] != b"Z":
                            found.append(int(entry))
        except OSError:
            continue
    return found


def _orphans(tag: str, limit_s: float) -> tuple[list[int], float]:
    """Wait up to ``limit_s`` for the workers tagged ``tag`` to end; returns those still
    running (then killed) and the seconds waited."""
    t0 = time.perf_counter()
    while (left := _workers_of(tag)) and time.perf_counter() - t0 < limit_s:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left, time.perf_counter() - t0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie), without reaping it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as st:
            return st.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def _leftovers(root: str, prefix: str) -> int:
    if not os.path.isdir(root):
        return 0
    return sum(n.startswith(prefix) for n in os.listdir(root))


@contextlib.contextmanager
def broken_retention(kind: str | None) -> Iterator[None]:
    """``"ignore-refs"``: retention keeps the 2 newest checkpoints and deletes the rest,
    whatever refers to them (patched in this process, so in every forked launch)."""
    if kind is None:
        yield
        return
    if kind != "ignore-refs":
        raise ValueError(f"unknown broken retention {kind!r}")

    def apply_retention(storage: Any, keep: Any, audit: Any, **kw: Any) -> list[int]:
        steps = list_committed(storage)
        doomed = steps[:-2]
        committer = committer_for(storage)
        for s in doomed:
            committer.delete(s)
            audit.record("delete", step=s, reason="retention")
        return doomed

    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("resumable") and hasattr(mod, "apply_retention"):
            patched.append((mod, getattr(mod, "apply_retention")))  # noqa: B009
            setattr(mod, "apply_retention", apply_retention)  # noqa: B010
    try:
        yield
    finally:
        for mod, original in patched:
            setattr(mod, "apply_retention", original)  # noqa: B010


def _plan(rng: random.Random, persist: str) -> tuple[Any, ...]:
    kind = rng.choices([p for p, _ in PLANS], [w for _, w in PLANS])[0]
    if persist == "process":  # the worker process runs the library's own code
        return ("timer",)
    if kind == "retention":
        return ("retention", rng.randint(1, 6), rng.choice(RETENTION_PHASES), rng.randint(0, 2))
    if kind == "commit":
        return ("commit", rng.randint(2, 8), rng.choice(COMMIT_PHASES))
    return ("timer",)


def run(size: str, *, retention: str | None = None) -> dict[str, Any]:
    """``retention="ignore-refs"`` breaks retention (the able-to-fail run)."""
    cfg = SIZES[size]
    rng = random.Random(SEED)
    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    t0 = time.perf_counter()
    problems: list[str] = []
    kills = launches = early = 0
    kinds: dict[str, int] = {}
    restored_from: dict[str, int] = {}
    seen_v2: set[tuple[int, str, int]] = set()
    seen_v1: set[tuple[int, str, int]] = set()
    most_refs = held = deletes = trash_after_kill = staging_after_kill = mirror_trash = 0
    cleaned: set[tuple[int, str, int]] = set()
    worker_waits: list[float] = []
    hangs: list[dict[str, Any]] = []
    bytes_v1: list[int] = []
    bytes_v2: list[int] = []
    keep = Keep(last=2, every_steps=EVERY)
    with tempfile.TemporaryDirectory(prefix="inckill-") as tmp, broken_retention(retention):
        shm = tempfile.mkdtemp(prefix="inckill-", dir="/dev/shm")
        try:
            for chain in range(cfg["chains"]):
                setup = SETUPS[chain % len(SETUPS)]
                persist, memory = setup
                root = os.path.join(tmp, f"chain{chain}", "root")
                mirror = os.path.join(tmp, f"chain{chain}", "mirror")
                want = 0
                previous = "none (first launch)"
                os.makedirs(os.path.dirname(root), exist_ok=True)
                for k in range(cfg["kills_per_chain"] + 1):
                    last = k == cfg["kills_per_chain"]
                    plan = ("none",) if last else _plan(rng, persist)
                    if not memory:  # as after a node restart: the relaunch reads the disk
                        for name in os.listdir(shm):
                            shutil.rmtree(os.path.join(shm, name), ignore_errors=True)
                            with contextlib.suppress(OSError):
                                os.unlink(os.path.join(shm, name))
                    early_kill = plan[0] == "timer" and rng.random() < 0.2
                    tag = f"{os.getpid()}-{launches}"
                    pid, fd = _launch(root, mirror, shm, 3 if last else None, setup, plan, tag)
                    launches += 1
                    t_start = time.perf_counter()
                    lines: list[str] = []
                    if early_kill:
                        time.sleep(rng.uniform(0.0, 0.05))
                        os.kill(pid, signal.SIGKILL)
                        early += 1
                    else:
                        lines = _lines(fd, LAUNCH_TIMEOUT_S)
                        if not lines and _alive(pid):
                            os.kill(pid, signal.SIGUSR1)  # where it hangs: its threads' stacks
                            time.sleep(1.0)
                            with contextlib.suppress(OSError):
                                path = os.path.join(os.path.dirname(root), f"stacks-{tag}.txt")
                                with open(path) as f:
                                    hangs.append(
                                        {
                                            "chain": chain,
                                            "launch": k,
                                            "after": previous,
                                            "stacks": f.read()[-6000:],
                                        }
                                    )
                        if not last:
                            window = cfg["window_s"]
                            if persist == "process":  # from the restore: its worker starts
                                window, t_start = PROCESS_WINDOW_S, time.perf_counter()
                            if plan[0] == "timer":
                                delay = rng.uniform(0.0, window)
                                time.sleep(max(0.0, delay - (time.perf_counter() - t_start)))
                            else:  # it kills itself; or, if the moment never comes, we do
                                lines += _lines(fd, 3 * window, until=1)
                            os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    lines += _lines(fd, 0.0, until=10)
                    os.close(fd)
                    if persist == "process":  # its worker must end by itself, and soon
                        left, waited = _orphans(tag, ORPHAN_TIMEOUT_S)
                        worker_waits.append(waited)
                        if left:
                            problems.append(
                                f"chain {chain} launch {k}: {len(left)} persist worker(s) still "
                                f"ran {ORPHAN_TIMEOUT_S}s after their trainer ended"
                            )
                    what = "clean launch"
                    if not last:
                        kills += 1
                        what = next((x[7:] for x in lines if x.startswith("killed ")), "timer")
                        if plan[0] != "timer" and what == "timer":
                            what = f"timer ({plan[0]} moment not reached)"
                        what = "timer (first 50 ms)" if early_kill else what
                        if any(x.startswith("killed ") for x in lines) and not any(
                            x.startswith("restored ") for x in lines
                        ):
                            # a commit or retention of the start (the newest memory snapshot
                            # made durable, the mirror's catch-up) before the restore returned
                            what += " (before the restore returned)"
                        kinds[what] = kinds.get(what, 0) + 1
                        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                            problems.append(
                                f"chain {chain} launch {k}: ended by itself before its kill "
                                f"(status {status})"
                            )
                    elif not os.WIFEXITED(status) or os.WEXITSTATUS(status):
                        problems.append(f"chain {chain}: the last launch failed ({status})")
                    restored = next((x for x in lines if x.startswith("restored ")), "")
                    if restored:
                        _, got, verdict, tier, version = restored.split()
                        if verdict != "ok":
                            problems.append(f"chain {chain} launch {k}: restored values differ")
                        if int(got) < want:
                            problems.append(
                                f"chain {chain} launch {k}: restored step {got}, but step "
                                f"{want} was committed"
                            )
                        key = "nothing committed" if not int(got) else f"{tier} v{version}"
                        if tier == "memory":
                            key = "memory"
                        restored_from[key] = restored_from.get(key, 0) + 1
                    elif not early_kill and not what.endswith("(before the restore returned)"):
                        problems.append(
                            f"chain {chain} launch {k} (after a kill: {previous}): no restore "
                            f"within {LAUNCH_TIMEOUT_S}s, exit status {status}"
                        )
                    previous = what
                    if not last:
                        trash_after_kill += bool(_leftovers(root, ".trash-"))
                        staging_after_kill += bool(_leftovers(root, ".tmp-"))
                    for where, path in (("root", root), ("mirror", mirror)):
                        if not os.path.isdir(path):
                            continue
                        found = torn(path) + _refs_problems(path, (manifests := _manifests(path)))
                        problems += [f"chain {chain} after kill {k} ({what}): {p}" for p in found]
                        held += _held_by_refs(manifests, keep) if where == "root" else 0
                        for s, m in manifests.items():
                            refs = m.get("refs", [])
                            most_refs = max(most_refs, len(refs))
                            own = sum(f["size"] for f in m["files"].values())
                            if _refers(m) and any(
                                held is None
                                for name, t in m["tensors"].items()
                                if "frozen" in name
                                for held, *_ in _ranges(t)
                            ):
                                cleaned.add((chain, where, s))
                            if _refers(m):
                                if (chain, where, s) not in seen_v2 and where == "root":
                                    bytes_v2.append(own)
                                seen_v2.add((chain, where, s))
                            else:
                                if (chain, where, s) not in seen_v1 and where == "root":
                                    bytes_v1.append(own)
                                seen_v1.add((chain, where, s))
                    if os.path.isdir(root):
                        want = max(want, newest_commit(root))
                    if problems and cfg.get("until_caught"):
                        break
                if problems and cfg.get("until_caught"):
                    break
                if os.path.isdir(root):
                    deletes += sum(e.get("event") == "delete" for e in read_audit(local(root)))
                mirror_trash += _leftovers(mirror, ".trash-") + _leftovers(mirror, ".tmp-")
                stale = [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]
                if stale:
                    problems.append(f"chain {chain}: {stale} left after a clean launch")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    if not seen_v2:
        problems.append(
            "no checkpoint referring to earlier ones (format version 3) was written: the "
            "campaign tested nothing new"
        )
    return {
        "trials": kills,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "chains": cfg["chains"],
            "kills_per_chain": cfg["kills_per_chain"],
            "launches": launches,
            "kill_window_s": cfg["window_s"],
            "kill_window_after_restore_s_with_worker_processes": PROCESS_WINDOW_S,
            "chains_by_setup": {
                f"persist={p}, memory tier {'on' if m else 'off, shm emptied'}": sum(
                    SETUPS[c % len(SETUPS)] == (p, m) for c in range(cfg["chains"])
                )
                for p, m in SETUPS
            },
            "worker_processes_gone_after_their_trainer_s": {
                "count": len(worker_waits),
                "max": round(max(worker_waits), 2) if worker_waits else None,
            },
            "kills": dict(sorted(kinds.items())),
            "kills_leaving_a_trash_directory": trash_after_kill,
            "kills_leaving_a_staging_directory": staging_after_kill,
            "mirror_staging_or_trash_left_at_chain_ends": mirror_trash,
            "restores": dict(sorted(restored_from.items())),
            "v2_checkpoints_seen": {
                "root": sum(w == "root" for _, w, _ in seen_v2),
                "mirror": sum(w == "mirror" for _, w, _ in seen_v2),
            },
            "v1_checkpoints_seen": {
                "root": sum(w == "root" for _, w, _ in seen_v1),
                "mirror": sum(w == "mirror" for _, w, _ in seen_v1),
            },
            "median_own_bytes": {
                "v1": sorted(bytes_v1)[len(bytes_v1) // 2] if bytes_v1 else None,
                "v2": sorted(bytes_v2)[len(bytes_v2) // 2] if bytes_v2 else None,
            },
            "v2_checkpoints_rewriting_frozen_chunks": len(cleaned),
            "most_refs_of_one_checkpoint": most_refs,
            "held_only_by_a_reference_after_a_kill": held,
            "retention_deletes_recorded": deletes,
            "problems": problems[:10],
            "hung_launches": hangs[:3],
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The campaign with a retention that deletes checkpoints still referred to."""
    r = run("small", retention="ignore-refs")
    return {"retention ignores references": {"trials": r["trials"], "failures": r["failures"]}}
