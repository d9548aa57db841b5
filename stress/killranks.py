"""Campaign 1b, kill -9 at two ranks: campaign 1 (`stress.kill`) for a job of two ranks
in a real ``torch.distributed`` gloo process group, where a kill takes one rank (either,
at random) or both, at a random moment.

Each launch forks two processes from this one (torch is imported once, here). They
join a gloo group through a ``TCPStore`` that this process hosts on a free loopback port
(one prefix per launch, so a relaunch never meets a dead launch's keys). Each rank runs
a `Checkpointer` on the shared root with both tiers (a memory snapshot in shared memory
every step, persists on a background thread with the coordinated commit of
``docs/distributed.md``, ``Keep(last=2)``, ``dist_timeout_s`` of `DIST_TIMEOUT_S`),
restores, checks the restored values against what that step saved (the model depends
only on the step, a per-rank tensor on the step and the rank), tells this process the
step it came back at, then saves one step after another until it is killed.

A kill lands at a random moment (uniform over the first ``window_s`` seconds after both
ranks restored; a fifth of the kills land in the first 50 ms of the launch, during
start-up, the group's rendezvous or the collective restore). When one rank is killed,
the other must end by itself: its next collective (the all-reduce each step makes, as
a training step's gradients would, or the restore) fails on the dead peer, its next
save fails if the dead rank hosted the coordination store, and a wait in the
coordinated commit ends at ``dist_timeout_s``. A survivor still running `SURVIVOR_TIMEOUT_S` after
the kill is counted as hung (and killed, its stacks kept), unless it is still in
torch's ``init_process_group``: none of the library's code has run yet, and gloo's
connection to a peer killed during the handshake can outlast the group's timeout. Then
both ranks are relaunched. A launch neither of whose ranks got through
``init_process_group`` (its rendezvous timed out, as it can on a loaded machine) is
counted apart too (``launches_whose_ranks_never_joined``, with how each rank ended):
nothing of the library's ran in it. Any other launch without a restore is a failure
that says where each rank was.

After every kill, once both ranks are gone, this process reads the audit log for the
steps whose commit was recorded and checks that every listed checkpoint verifies and
holds both ranks' files; the next launch must restore at least the newest committed
step, on both ranks the same step, with exactly the values saved at that step. Chains
of ``kills_per_chain`` kills share a root; each chain ends with a launch that is not
killed, saves three steps, closes, and must leave no staging or trash directory.

Chains alternate between the two background pipelines: persists on a thread of each
rank (``persist="thread"``) and in each rank's persist worker process
(``persist="process"``: the workers coordinate each commit through a store that rank
0's trainer hosts, so a kill of rank 0 takes the store with it). With worker processes,
a worker whose trainer was killed must end by itself (it watches its trainer through a
pidfd): every worker of a launch, found by a tag in its environment, must be gone
`ORPHAN_TIMEOUT_S` after its ranks ended, or it is counted as a failure (and killed).
The able-to-fail run uses threads only, so that its broken commit
(`stress.workload.broken_commit`, patched in this process and so in every forked rank)
is the one the coordinated commit uses; a worker process would start a fresh
interpreter with the library's own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import random
import re
import select
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from resumable import Every, Keep
from resumable.commit import list_committed
from resumable.errors import CheckpointError
from resumable.reader import CheckpointReader
from stress.workload import (
    broken_commit,
    checkpointer,
    local,
    make_state,
    newest_commit,
    set_step,
    torn,
)

SIZES: dict[str, dict[str, Any]] = {
    # `make test`'s: with SEED, both chains' six kills take rank 0, rank 1 and both
    "small": {"chains": 2, "kills_per_chain": 3, "window_s": 1.5},
    "full": {"chains": 30, "kills_per_chain": 10, "window_s": 1.5},
    # able_to_fail: more kills than "small", since only a kill of rank 0 (whose worker
    # commits) within the broken commit's window can leave a torn checkpoint listed
    "broken": {"chains": 3, "kills_per_chain": 6, "window_s": 1.5},
    # `make test`'s able-to-fail run: "broken"'s launches, up to the first after which
    # a problem is found
    "caught": {"chains": 3, "kills_per_chain": 6, "window_s": 1.5, "until_caught": True},
}
SEED = 1
WORLD = 2
LAUNCH_TIMEOUT_S = 60.0
DIST_TIMEOUT_S = 5.0
"""The ranks' ``dist_timeout_s``, and the timeout of their group's rendezvous and
collectives."""
SURVIVOR_TIMEOUT_S = 3 * DIST_TIMEOUT_S
"""How long a rank whose peer was killed may take to end by itself."""
JOIN_TIMEOUT_S = DIST_TIMEOUT_S + 3.0
"""How long such a rank may stay in ``init_process_group`` (its timeout, and a margin)
before it is killed (not counted as a failure: no code of the library's runs there)."""
VICTIMS = ((0,), (1,), (0, 1))
ORPHAN_TIMEOUT_S = 3 * DIST_TIMEOUT_S
"""How long a persist worker may outlive its ranks: it notices its trainer's death at
once (a pidfd) unless it is inside a wait of the coordinated commit, which ends at
``dist_timeout_s`` at the latest."""
TAG = "RESUMABLE_STRESS_LAUNCH"
"""The environment variable that marks the persist workers of one launch."""


def _set(state: dict[str, Any], step: int, rank: int) -> None:
    """The model's values depend only on ``step`` (it is replicated: every rank holds
    it whole); ``mine``, a per-rank tensor, on ``step`` and ``rank``."""
    set_step(state, step)
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    state["mine"].copy_(torch.randn(state["mine"].shape, generator=g))


def _state() -> dict[str, Any]:
    state = make_state()
    state["mine"] = torch.zeros(1024)
    return state


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta = [*a["model"].state_dict().values(), a["mine"]]
    tb = [*b["model"].state_dict().values(), b["mine"]]
    return all(torch.equal(x, y) for x, y in zip(ta, tb))


def _job(
    rank: int,
    port: int,
    launch: int,
    root: str,
    shm: str,
    out: int,
    steps: int | None,
    persist: str = "thread",
) -> None:
    """One rank: join the group, restore, report, then save until killed (or ``steps``
    more, then close)."""
    import torch.distributed as dist

    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    store = dist.PrefixStore(
        f"launch-{launch}",
        dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    os.write(out, b"joined\n")
    os.environ[TAG] = _tag(launch)  # inherited by the persist worker
    state = _state()
    ck = checkpointer(
        root,
        state,
        persist=persist,
        memory_every=Every(steps=1),
        keep=Keep(last=2),
        shm_dir=shm,
        on_busy="skip",
        dist_timeout_s=DIST_TIMEOUT_S,
    )
    got = ck.restore()
    expected = _state()
    _set(expected, got, rank)
    same = got == 0 or _same(state, expected)
    os.write(out, f"restored {got} {'ok' if same else 'mismatch'}\n".encode())
    step = got
    gradients = torch.zeros(1)
    while steps is None or step < got + steps:
        step += 1
        # A training step's collective (its gradients' all-reduce): the ranks of a job
        # meet in it every step. The checkpointer calls no collective while saving, so
        # without it the ranks would save at their own pace, far apart.
        dist.all_reduce(gradients)
        _set(state, step, rank)
        ck.save(step)
    ck.close()


_PARENT = os.getpid()  # the campaign's process (forked ranks inherit the value)


def _tag(launch: int) -> str:
    return f"{_PARENT}-{launch}"


def _workers_of(launch: int) -> list[int]:
    """The live processes (persist workers) whose environment carries ``launch``'s tag."""
    want = f"{TAG}={_tag(launch)}".encode() + b"\0"
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


def _orphans(launch: int, limit_s: float) -> tuple[list[int], float]:
    """Wait up to ``limit_s`` for ``launch``'s persist workers to end; returns those
    still running (then killed) and the seconds waited."""
    t0 = time.perf_counter()
    while (left := _workers_of(launch)) and time.perf_counter() - t0 < limit_s:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left, time.perf_counter() - t0


def _launch(
    port: int,
    launch: int,
    root: str,
    shm: str,
    logs: str,
    steps: int | None,
    persist: str = "thread",
) -> list[tuple[int, int]]:
    """Fork the ranks; returns ``(pid, read end of its pipe)`` per rank. Each rank's
    stderr goes to ``logs/rank<r>.log`` (c10d warns there at every dead peer), where
    ``SIGUSR1`` makes it write its threads' stacks."""
    ranks: list[tuple[int, int]] = []
    for rank in range(WORLD):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns
            code = 0
            try:
                os.close(r)
                for _, fd in ranks:
                    os.close(fd)
                log = os.path.join(logs, f"rank{rank}.log")
                os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
                # fd 2, the log: under pytest sys.stderr is its capture, not fd 2
                faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
                _job(rank, port, launch, root, shm, w, steps, persist)
            except BaseException as exc:
                code = 1
                os.write(w, f"error {type(exc).__name__}\n".encode())
            finally:
                os._exit(code)  # no teardown: the group may be broken
        os.close(w)
        ranks.append((pid, r))
    return ranks


@dataclass
class Rank:
    """A forked rank, and what it wrote to its pipe."""

    pid: int
    fd: int
    said: str = ""
    status: int | None = None  # its wait status once it ended
    took_s: float = 0.0  # from the kill to its end (a survivor)
    stacks: str = ""  # its threads' stacks, if it was still running at the deadline

    def restored(self) -> tuple[int, bool] | None:
        """``(step, values as saved)`` if it reported a restore."""
        for line in self.said.splitlines():
            if line.startswith("restored "):
                _, step, verdict = line.split()
                return int(step), verdict == "ok"
        return None

    def phase(self) -> str:
        """Where it was when it ended: ``joining`` the group, ``side group`` (still in
        torch's gloo handshake of the group the checkpointer creates, per its stacks),
        ``restoring`` (from the checkpointer's construction to the end of its restore)
        or ``saving``."""
        if self.restored() is not None:
            return "saving"
        if "joined" not in self.said.splitlines():
            return "joining"
        return "side group" if _in_side_group_handshake(self.stacks) else "restoring"

    def error(self) -> str | None:
        """The type of the exception it ended with, if it said."""
        for line in self.said.splitlines():
            if line.startswith("error "):
                return line.split()[1]
        return None


def _threads(stacks: str) -> list[str]:
    """Faulthandler ``stacks`` (`faulthandler.dump_traceback` of all threads) cut into
    one text per thread, each beginning with its ``Thread 0x...`` header."""
    return re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)


def _in_side_group_handshake(stacks: str) -> bool:
    """Whether a thread of these faulthandler stacks is inside torch's construction of
    a process group (its innermost frame) called from the library's `current_group`."""
    for thread in _threads(stacks):
        frames = [line.strip() for line in thread.splitlines() if line.strip().startswith("File")]
        if (
            frames
            and frames[0].endswith(" in _new_process_group_helper")
            and any("resumable" in f and f.endswith(" in current_group") for f in frames)
        ):
            return True
    return False


def _until_restored(fd: int, deadline: float) -> str:
    """What a rank says until it reports its restore (or fails, or the deadline)."""
    data = b""
    while not any(line.startswith((b"restored ", b"error ")) for line in data.split(b"\n")[:-1]):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.perf_counter()))
        if not ready:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _rest(fd: int) -> str:
    """What is left in the pipe of a process that ended (its write end is closed)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    os.close(fd)
    return data.decode()


def _wait(rank: Rank, limit_s: float, join_limit_s: float) -> None:
    """Wait for ``rank`` to end, reading what it says meanwhile; give up after
    ``limit_s``, or after ``join_limit_s`` if it has not joined the group by then."""
    t0 = time.perf_counter()
    while True:
        done, status = os.waitpid(rank.pid, os.WNOHANG)
        if done:
            rank.status = status
            return
        waited = time.perf_counter() - t0
        joined = "joined" in rank.said.splitlines()
        if waited > limit_s or (waited > join_limit_s and not joined):
            return
        if select.select([rank.fd], [], [], 0.01)[0]:
            rank.said += os.read(rank.fd, 4096).decode()


def _end(
    ranks: list[Rank], victim: tuple[int, ...], limit_s: float, join_limit_s: float, logs: str
) -> None:
    """Kill the ``victim`` ranks, give the others ``limit_s`` to end by themselves
    (``join_limit_s`` while still joining the group), then kill them, keeping their
    stacks; collect what every rank said."""
    for r in victim:
        os.kill(ranks[r].pid, signal.SIGKILL)
    t0 = time.perf_counter()
    for r, rank in enumerate(ranks):
        if r in victim:
            _, rank.status = os.waitpid(rank.pid, 0)
            continue
        spent = time.perf_counter() - t0
        _wait(rank, max(0.0, limit_s - spent), max(0.0, join_limit_s - spent))
        rank.took_s = time.perf_counter() - t0
        if rank.status is None:
            os.kill(rank.pid, signal.SIGUSR1)
            time.sleep(0.5)
            with open(os.path.join(logs, f"rank{r}.log"), errors="replace") as f:
                rank.stacks = _innermost(f.read())
            os.kill(rank.pid, signal.SIGKILL)
            os.waitpid(rank.pid, 0)
    for rank in ranks:
        rank.said += _rest(rank.fd)


def _innermost(stacks: str, frames: int = 30) -> str:
    """Each thread's header and innermost ``frames`` frames of faulthandler ``stacks``
    (most recent call first), where a hang shows; the outer frames are cut."""
    out = []
    for thread in _threads(stacks):
        lines = thread.strip().splitlines()
        out.append("\n".join(lines[: frames + 1]))
    return "\n\n".join(out)[-12000:]


def _status(status: int | None) -> str:
    """How a rank ended, from its wait status."""
    if status is None:
        return "still running"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _exited_0(status: int) -> bool:
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _spread(seconds: list[float]) -> dict[str, Any]:
    seconds = sorted(seconds)
    return {
        "count": len(seconds),
        "median_s": round(seconds[len(seconds) // 2], 2),
        "max_s": round(seconds[-1], 2),
    }


def _both_ranks(root: str) -> list[str]:
    """Problems: a listed checkpoint that was not saved by both ranks."""
    storage = local(root)
    bad = []
    for step in list_committed(storage):
        try:
            manifest = CheckpointReader(storage, step).manifest
        except CheckpointError:
            continue  # reported by torn()
        files = sorted(manifest.get("files", {}))
        ranks = {r for r in range(WORLD) for f in files if f.startswith(f"rank-{r:05d}")}
        if manifest.get("world_size") != WORLD or len(ranks) != WORLD:
            bad.append(f"step {step} of {root}: world {manifest.get('world_size')}, files {files}")
    return bad


def _check_restores(ranks: list[Rank], want: int, where: str) -> tuple[list[str], int | None]:
    """Problems with the restores the ranks reported, and the step restored (None if no
    rank reported one)."""
    problems = []
    got = {}
    for r, rank in enumerate(ranks):
        restored = rank.restored()
        if restored is None:
            continue
        step, same = restored
        got[r] = step
        if not same:
            problems.append(f"{where}: rank {r} restored values that differ from step {step}'s")
        if step < want:
            problems.append(f"{where}: rank {r} restored step {step}, but {want} was committed")
    if len(set(got.values())) > 1:
        problems.append(f"{where}: the ranks restored different steps {got}")
    return problems, max(got.values(), default=None)


def run(size: str, *, commit: str | None = None) -> dict[str, Any]:
    """``commit="manifest-first"`` breaks the save path (the able-to-fail run)."""
    from torch.distributed import TCPStore

    cfg = SIZES[size]
    rng = random.Random(SEED)
    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    t0 = time.perf_counter()
    problems: list[str] = []
    kills = launches = early = 0
    victims: dict[str, int] = {"rank 0": 0, "rank 1": 0, "both": 0}
    survivors: dict[str, list[float]] = {}  # how a survivor ended: seconds after the kill
    restored_from: dict[str, int] = {"start (nothing committed)": 0, "committed or newer": 0}
    never_joined: list[str] = []  # launches neither of whose ranks joined the group
    pipelines: dict[str, int] = {"thread": 0, "process": 0}  # kills per persist mode
    orphans_ended: list[float] = []  # seconds for a killed launch's workers to end
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="killranks-") as tmp, broken_commit(commit):
        shm = tempfile.mkdtemp(prefix="killranks-", dir="/dev/shm")
        try:
            for chain in range(cfg["chains"]):
                root = os.path.join(tmp, f"chain{chain}", "root")
                persist = "process" if commit is None and chain % 2 else "thread"
                want = 0
                for k in range(cfg["kills_per_chain"] + 1):
                    where = f"chain {chain} launch {k}"
                    last = k == cfg["kills_per_chain"]
                    forked = _launch(
                        store.port, launches, root, shm, tmp, 3 if last else None, persist
                    )
                    ranks = [Rank(pid, fd) for pid, fd in forked]
                    launches += 1
                    early_kill = not last and rng.random() < 0.2
                    delay = (
                        rng.uniform(0.0, 0.05) if early_kill else rng.uniform(0.0, cfg["window_s"])
                    )
                    victim: tuple[int, ...] = () if last else rng.choice(VICTIMS)
                    if early_kill:
                        early += 1
                    else:
                        deadline = time.perf_counter() + LAUNCH_TIMEOUT_S
                        for rank in ranks:
                            rank.said = _until_restored(rank.fd, deadline)
                    time.sleep(delay)
                    limits = (
                        (LAUNCH_TIMEOUT_S,) * 2 if last else (SURVIVOR_TIMEOUT_S, JOIN_TIMEOUT_S)
                    )
                    _end(ranks, victim, *limits, tmp)
                    if persist == "process":
                        left, waited = _orphans(launches - 1, ORPHAN_TIMEOUT_S)
                        if left:
                            problems.append(
                                f"{where}: {len(left)} persist worker(s) still ran "
                                f"{ORPHAN_TIMEOUT_S}s after their ranks ended"
                            )
                        elif victim:
                            orphans_ended.append(waited)
                    if victim:
                        kills += 1
                        pipelines[persist] += 1
                        victims["both" if len(victim) == WORLD else f"rank {victim[0]}"] += 1
                    for r, rank in enumerate(ranks):
                        if r in victim:
                            continue
                        if last:
                            if rank.status is None or not _exited_0(rank.status):
                                problems.append(
                                    f"{where}: rank {r} of the last launch failed "
                                    f"({rank.error() or rank.status}){rank.stacks}"
                                )
                            continue
                        phase = rank.phase()
                        if rank.status is None and phase in ("joining", "side group"):
                            # in torch's gloo handshake (init_process_group, or the
                            # new_group the checkpointer's construction calls): gloo's
                            # connection to a peer that died mid-way can outlast the
                            # group's timeout; the library cannot bound a wait in there
                            end = "still running (killed)"
                        elif rank.status is None:
                            end = "still running (killed)"
                            problems.append(
                                f"{where}: rank {r} still ran {SURVIVOR_TIMEOUT_S}s after "
                                f"its peer was killed ({phase}); its stacks:\n" + rank.stacks
                            )
                        else:
                            end = rank.error() or f"exit status {rank.status}"
                        survivors.setdefault(f"{end}, {phase}", []).append(rank.took_s)
                    found, step = _check_restores(ranks, want, where)
                    problems += found
                    if step is not None:
                        restored_from[
                            "committed or newer" if step else "start (nothing committed)"
                        ] += 1
                    elif not early_kill:
                        how = "; ".join(
                            f"rank {r}: {rank.phase()}, {rank.error() or _status(rank.status)}"
                            for r, rank in enumerate(ranks)
                        )
                        if not last and all(rank.phase() == "joining" for rank in ranks):
                            # Neither rank got through torch's init_process_group (its
                            # rendezvous has the group's timeout): no code of the
                            # library's ran, and nothing was restored or saved.
                            never_joined.append(f"{where}: {how}")
                        else:
                            problems.append(
                                f"{where}: no restore within {LAUNCH_TIMEOUT_S}s ({how})"
                            )
                    if os.path.isdir(root):
                        want = max(want, newest_commit(root))
                        problems += torn(root)
                        problems += _both_ranks(root)
                    if problems and cfg.get("until_caught"):
                        break
                if problems and cfg.get("until_caught"):
                    break
                leftovers = [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]
                if leftovers:
                    problems.append(f"chain {chain}: {leftovers} left after a clean launch")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            del store
    return {
        "trials": kills,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "ranks": WORLD,
            "chains": cfg["chains"],
            "kills_per_chain": cfg["kills_per_chain"],
            "launches": launches,
            "killed": victims,
            "kills_in_first_50ms": early,
            "kill_window_s": cfg["window_s"],
            "dist_timeout_s": DIST_TIMEOUT_S,
            "survivors_ended": {k: _spread(v) for k, v in sorted(survivors.items())},
            "restores": restored_from,
            "launches_whose_ranks_never_joined": never_joined[:10],
            "kills_by_pipeline": pipelines,
            "workers_gone_after_their_ranks": _spread(orphans_ended) if orphans_ended else None,
            "problems": problems[:10],
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The campaign on a coordinated commit that writes the manifest before the data."""
    r = run("broken", commit="manifest-first")
    return {"manifest written first": {"trials": r["trials"], "failures": r["failures"]}}
