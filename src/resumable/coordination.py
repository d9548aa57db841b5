"""How the ranks of a job agree on one coordinated persist, behind one interface.

A coordinated persist (`resumable.pipeline.write.write_distributed`) needs three exchanges:
rank 0 opens the attempt and tells every rank where to write (``broadcast``), every
rank reports its written file or its error to rank 0 (``gather``), and rank 0 tells
every rank the outcome (``broadcast``). Two transports implement them:

- `resumable.group.Group`: collectives on the checkpointer's side gloo group,
  called on the training thread (``persist="sync"``).
- `StoreCoordinator`: keys in a ``torch.distributed.TCPStore`` that the checkpointer
  of rank 0 hosts (`CoordinationStore`), used by the persist workers in the background,
  so the training processes take part in no collective while a persist runs.

The trainers agree through the same store on what must be the same on every rank while
training runs (`Agreement`: whether a due persist starts or is deferred, whether a
clock-based policy is due): the first rank to reach a decision takes it for all, with
one atomic compare-and-set, so no rank waits for another. A restore tells every rank
what each rank found on a candidate through it too (`StoreVerdicts`: one key per rank,
read by rank 0 in one request), not by an all-gather over the side group.

Why a store of the checkpointer's own rather than torchrun's: it exists however the
process group was initialised, and it lives exactly as long as rank 0's trainer, so a
dead rank 0 fails every waiting worker at once instead of after the timeout. Why not
files in the checkpoint root: an object store would be polled for every exchange.

Failure cases (each ends with nothing committed and `PersistError` on every rank):

- a rank's write fails: its report carries the error; rank 0 aborts the attempt and
  the outcome carries the error to every rank.
- a rank's worker dies (SIGKILL): its trainer notices at its next call and posts the
  error report in the worker's place (`CoordinationStore.give_up`), and its ready (rank
  0 waits for every rank's before it opens the attempt: `StoreCoordinator.all_ready`);
  rank 0's trainer also posts the outcome if its own worker died.
- a rank hangs: rank 0's worker stops waiting after the timeout (``dist_timeout_s``),
  aborts, and posts the outcome naming the ranks it waited for.
- rank 0's trainer dies: the store dies with it; every worker waiting on it fails, and
  rank 0's worker, which checks its trainer before committing, commits nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from resumable import settings
from resumable.errors import PersistError
from resumable.nodes import NodeObjects

log = logging.getLogger(__name__)

ATTEMPT, REPORTS, OUTCOME, STAGED, READY = "attempt", "reports", "outcome", "staged", "ready"


def _store(host: str, port: int, timeout_s: float, *, master: bool) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


class CoordinationStore:
    """The store of one several-rank `Checkpointer`: hosted by rank 0's trainer (a
    free port, found at construction and shared over the side group), reached by every
    rank's trainer and persist worker as a client.

    The address others connect to is ``RESUMABLE_STORE_HOST`` if set, else loopback
    when every rank runs on rank 0's host, else rank 0's fully qualified host name.
    """

    def __init__(self, group: Any, timeout_s: float, *, nodes: NodeObjects | None = None) -> None:
        self.rank = group.rank
        self.nodes = nodes  # one object per node: each job says where (`resumable.nodes`)
        self.world_size = group.world_size
        self.timeout_s = timeout_s
        hosts = group.gather(socket.gethostname())
        if self.rank == 0:
            host = settings.STORE_HOST.read() or (
                "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn()
            )
            self._store = _store(host, 0, timeout_s, master=True)
            address = [host, int(self._store.port)]
        else:
            address = None
        self.host, self.port = group.broadcast(address)
        if self.rank != 0:
            self._store = _store(self.host, self.port, timeout_s, master=False)
        self._seq = 0

    def next_job(self) -> dict[str, Any]:
        """Where the workers of the next coordinated persist meet (the same on every
        rank, because every rank submits the same persists in the same order)."""
        self._seq += 1
        job = {
            "host": self.host,
            "port": self.port,
            "rank": self.rank,
            "world": self.world_size,
            "key": f"p{self._seq}",
            "timeout": self.timeout_s,
        }
        if self.nodes is not None:
            job["nodes"] = self.nodes.job()
        return job

    def first(self, key: str, value: str) -> str:
        """The value the first rank to get here set under ``key`` (``value``, if this
        rank is the first): an atomic compare-and-set in the store, answered without
        waiting for any other rank. The last of the ranks to read it removes it."""

        def agree() -> bytes:
            decided = self._store.compare_set(key, "", value)
            if int(self._store.add(f"{key}/n", 1)) >= self.world_size:
                self._store.delete_key(key)
                self._store.delete_key(f"{key}/n")
            return bytes(decided)

        return str(self._op(f"agree on {key!r}", agree).decode())

    def raise_flag(self, name: str) -> None:
        """Set the flag ``name`` for every rank to see (`flag`); it stays set."""
        self._op(f"set flag {name!r}", lambda: self._store.set(f"flag/{name}", "1"))

    def flag(self, name: str) -> bool:
        """Whether some rank raised the flag ``name``."""
        return bool(self._op(f"read flag {name!r}", lambda: self._store.check([f"flag/{name}"])))

    def _op(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise PersistError(
                f"rank {self.rank}: cannot reach the checkpoint coordination store at "
                f"{self.host}:{self.port} to {what} ({_first_line(exc)}); rank 0's trainer "
                "is gone or the address is unreachable"
            ) from exc

    def give_up(self, key: str, reason: str) -> None:
        """Report ``reason`` in place of this rank's worker for persist ``key`` (and,
        on rank 0, its attempt and its outcome), unless the worker already did: the
        others stop waiting now rather than at the timeout."""
        error = json.dumps({"error": f"rank {self.rank}: {reason}"})
        try:
            self._store.compare_set(f"{key}/{READY}/{self.rank}", "", error)
            if self.nodes is not None:  # its node's leader waits for it first
                self._store.compare_set(f"{key}/{STAGED}/{self.rank}", "", error)
            self._store.compare_set(f"{key}/{REPORTS}/{self.rank}", "", error)
            if self.rank == 0:  # the others may still wait for the attempt itself
                self._store.compare_set(f"{key}/{ATTEMPT}", "", error)
                self._store.compare_set(f"{key}/{OUTCOME}", "", error)
        except Exception as exc:  # the store is gone: the others fail on it anyway
            log.debug("could not post the failure of %s: %s", key, exc)

    def verdicts(self) -> StoreVerdicts:
        """The restore's verdicts through this store (`StoreVerdicts`)."""
        return StoreVerdicts(self._store, self.rank, self.world_size, self.timeout_s)

    def close(self) -> None:
        self._store = None


Verdict = tuple[str, str]
"""What a rank found wrong with a restore candidate: a kind (``"corrupt"``,
``"mismatch"``) and a message naming the rank."""

MAX_SAID = 16
"""The verdicts an answer names in full; past them, the first of each kind not named
yet, then a count of the rest. So the answer every rank reads stays small at any N."""


def said(verdicts: list[Verdict]) -> list[Verdict]:
    """``verdicts`` (in rank order) as an answer: all of them up to `MAX_SAID`; past
    that, the first `MAX_SAID`, the first of each kind not among them, and one more
    verdict, of the first left out's kind, counting the ranks left out."""
    if len(verdicts) <= MAX_SAID:
        return verdicts
    kept = verdicts[:MAX_SAID]
    kinds = {kind for kind, _ in kept}
    left = []
    for v in verdicts[MAX_SAID:]:
        if v[0] in kinds:
            left.append(v)
        else:
            kept.append(v)
            kinds.add(v[0])
    if left:
        kept.append((left[0][0], f"and {len(left)} more rank(s) (each logged its own)"))
    return kept


class GroupVerdicts:
    """The restore's verdicts over the side group (`resumable.group.Group.all_gather`): an
    all-gather, 2(N-1) messages per rank on gloo. With one process, its own verdict."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def collect(self, mine: Verdict | None) -> list[Verdict]:
        """Every rank's verdict that is not None, the same list on every rank (`said`).
        Collective: every rank calls it for each candidate, in the same order."""
        return said([_verdict(v) for v in self.group.all_gather(mine, "verdicts") if v is not None])


class StoreVerdicts:
    """The restore's verdicts through the coordination store, O(1) store operations per
    rank: each rank but 0 posts its verdict under ``verdicts/<n>/<rank>`` and waits for
    the answer ``verdicts/<n>``; rank 0 waits for those keys, reads them in one
    `multi_get`, and posts the answer (`said`: at most `MAX_SAID` messages and one of
    each kind). Each rank then removes its own key; the last to read the answer
    removes it. Rank 0 reads N - 1 keys; every other rank, one answer of bounded size.

    Failure: a rank that does not post within ``timeout_s`` makes rank 0 post an error
    as the answer and raise `PersistError`, and every rank waiting raises it too; a
    store that is gone (rank 0's trainer died) raises `PersistError` at once. A rank
    that raises between two candidates leaves the others waiting until the timeout,
    as a collective would."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seq = 0

    def collect(self, mine: Verdict | None) -> list[Verdict]:
        """Every rank's verdict that is not None, the same list on every rank (`said`).
        Every rank calls it for each candidate, in the same order."""
        self._seq += 1
        key = f"verdicts/{self._seq}"
        if self.rank == 0:
            answer = self._answer(key, mine)
        else:
            answer = self._call("post its verdict", lambda: self._post(key, mine))
        self._call("count the readers", lambda: self._read_once(key))
        out = json.loads(answer)
        if isinstance(out, dict):
            raise PersistError(str(out.get("error"))[:1000])
        return [_verdict(v) for v in out]

    def _post(self, key: str, mine: Verdict | None) -> bytes:
        own = f"{key}/{self.rank}"
        self.store.set(own, json.dumps(mine))
        answer = bytes(self.store.get(key))
        self.store.delete_key(own)  # rank 0 read it before it posted the answer
        return answer

    def _answer(self, key: str, mine: Verdict | None) -> bytes:
        keys = [f"{key}/{r}" for r in range(1, self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys, start=1) if not self._has(k)]
            reason = (
                f"rank 0: no restore verdict from rank(s) {missing} within "
                f"{self.timeout_s:.0f} s ({_first_line(exc)})"
            )
            try:
                self.store.set(key, json.dumps({"error": reason}))
            except Exception as post:  # the others fail on the store's timeout
                log.debug("could not post the failed restore verdicts: %s", post)
            raise PersistError(reason) from exc
        values = self._call("read the verdicts", lambda: self.store.multi_get(keys))
        verdicts = [mine] + [json.loads(v) for v in values]
        answer = json.dumps(said([_verdict(v) for v in verdicts if v is not None])).encode()
        self._call("post the verdicts", lambda: self.store.set(key, answer))
        return answer

    def _read_once(self, key: str) -> None:
        if int(self.store.add(f"{key}/read", 1)) >= self.world_size:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/read")

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise PersistError(
                f"rank {self.rank}: the restore's coordination failed ({what}: "
                f"{_first_line(exc)}); rank 0's trainer is gone or a rank hung"
            ) from exc


def _verdict(v: Any) -> Verdict:
    """A verdict read back from the store: a pair of strings, or `PersistError`."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, str) for x in v):
        return (v[0], v[1])
    raise PersistError(f"a restore verdict of an unexpected form: {str(v)[:200]!r}")


class Agreement:
    """Decisions every rank must take alike during training (whether a due persist
    starts, or is deferred because a worker is still busy; whether a clock-based
    policy is due), made without a collective on the training processes.

    With the coordination store (several ranks persisting in the background), the
    first rank to reach a decision takes it for every rank (`CoordinationStore.first`):
    no rank waits for another, and every rank gets the same answer. With
    ``persist="sync"`` the training threads are in collectives anyway: rank 0 decides
    and broadcasts over the side group. With one process a rank's own answer stands.

    A decision's key is its name, the step and how many decisions of that name this
    rank has taken at that step: every rank asks the same questions at the same steps,
    so the keys match, and a rank that left one out (a `PersistError` raised before it)
    meets the others again at the next step.
    """

    def __init__(self, group: Any, store: CoordinationStore | None) -> None:
        self.group = group
        self.store = store
        self._taken: dict[str, tuple[int, int]] = {}  # name -> (step, decisions at it)
        self._raised: set[str] = set()
        self._asker: _Asker | None = None

    def any_since(self, name: str, step: int, mine: bool) -> bool:
        """Whether any rank's ``mine`` has been true, the same on every rank at every
        step: a rank whose ``mine`` is true raises the flag ``name`` (`raise_flag`), and
        from the first decision taken after that, every rank is told True. Through
        the store no rank waits for another; the answer can come one step later than
        an all-reduce's when ranks meet in no collective between their calls. Without
        the store, a one-integer all-reduce."""
        if self.group.world_size == 1:
            return mine
        if self.store is None:
            return bool(self.group.any(mine))
        if mine:
            self.raise_flag(name)
        return self.decide(name, step, mine or self.store.flag(name))

    def raise_flag(self, name: str) -> None:
        """Raise the flag ``name`` in the store (once; a no-op without the store)."""
        if self.store is not None and name not in self._raised:
            self.store.raise_flag(name)
            self._raised.add(name)

    def decide(self, name: str, step: int, mine: bool) -> bool:
        """One rank's ``mine``, the same on every rank."""
        if self.group.world_size == 1:
            return mine
        if self.store is None:
            return bool(self.group.broadcast(mine, name))
        return self.store.first(self._key(name, step), "1" if mine else "0") == "1"

    def decide_later(self, name: str, step: int, mine: Callable[[], bool]) -> Pending:
        """`decide`, answered by `Pending.result`. Through the store the question goes
        out now (``mine()`` read now), on a thread of its own (the store's calls
        release the GIL), so that the caller's work meanwhile (a snapshot's copy)
        hides the round trips: at four ranks on two cores they took longer than the
        rest of a save's blocking. Otherwise (one process, or a collective that must
        run on the calling thread) ``mine()`` is read and decided in `Pending.result`,
        as `decide` would then."""
        if self.group.world_size == 1 or self.store is None:
            return Pending(lambda: self.decide(name, step, mine()))
        store, key, value = self.store, self._key(name, step), "1" if mine() else "0"
        if self._asker is None:
            self._asker = _Asker()
        return self._asker.ask(lambda: store.first(key, value) == "1")

    def close(self) -> None:
        """End the thread that asks decisions (`decide_later`), if one was started."""
        asker, self._asker = self._asker, None
        if asker is not None:
            asker.close()

    def _key(self, name: str, step: int) -> str:
        last, n = self._taken.get(name, (step, 0))
        n = n + 1 if last == step else 1
        self._taken[name] = (step, n)
        return f"agree/{name}/{step}/{n}"


class Pending:
    """A decision asked of the other ranks, answered once (`result`). Asked on the
    `_Asker`'s thread (``asked=True``), it is already out when this is built; `result`
    waits for the answer and raises what asking it raised (a `PersistError`).
    Otherwise it is asked in `result`."""

    def __init__(self, ask: Callable[[], bool], *, asked: bool = False) -> None:
        self._ask: Callable[[], bool] | None = ask
        self._answer: bool | None = None
        self._error: BaseException | None = None
        self._done = threading.Event() if asked else None

    def run(self) -> None:
        """Ask (once), keeping the answer or the error for `result`."""
        ask, self._ask = self._ask, None
        if ask is not None:
            try:
                self._answer = ask()
            except BaseException as exc:  # handed to the caller by result()
                self._error = exc
        if self._done is not None:
            self._done.set()

    def result(self) -> bool:
        """The decision (asked here if it was not asked on the thread)."""
        if self._done is not None:
            self._done.wait()
        else:
            self.run()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer

    def settle(self) -> None:
        """Let a decision asked on the thread end, its answer unused (the caller failed
        before it needed it): the question was put, so the other ranks have their
        answer; an error asking it is only logged (the caller's own is raised)."""
        if self._done is None:
            return
        self._done.wait()
        if self._error is not None:
            log.debug("a decision asked while the caller failed: %s", self._error)


class _Asker:
    """One daemon thread that asks the decisions handed to it, in order. A thread
    started per decision cost up to 15 ms before the question went out, at four ranks
    on two cores (`Thread.start` waits until the new thread runs); handing a decision
    to a running thread costs a queue put."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="resumable-agree", daemon=True)
        self._thread.start()

    def ask(self, ask: Callable[[], bool]) -> Pending:
        pending = Pending(ask, asked=True)
        self._queue.put(pending)
        return pending

    def _loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            pending.run()

    def close(self) -> None:
        """Stop after the decisions already handed over."""
        self._queue.put(None)


class StoreCoordinator:
    """One coordinated persist's exchanges through the `CoordinationStore` (used by a
    persist worker). Keys are ``<key>/<name>`` and ``<key>/<name>/<rank>``; rank 0
    removes the keys of the persist before the previous one once it has posted this
    one's outcome, or given it up (every rank has read them by then: it reported for
    the previous persist). Not when it starts it: those 2N + 2 deletes, one round trip
    each, would delay the attempt every rank waits for (about 0.1 s at 4,096 ranks;
    docs/scale.md)."""

    def __init__(self, store: Any, job: dict[str, Any]) -> None:
        self.store = store
        self.rank = int(job["rank"])
        self.world_size = int(job["world"])
        self.key = str(job["key"])
        self.timeout_s = float(job["timeout"])
        self.nodes = NodeObjects.from_job(job["nodes"]) if "nodes" in job else None

    @classmethod
    def connect(cls, job: dict[str, Any], cache: dict[tuple[str, int], Any]) -> StoreCoordinator:
        """A coordinator for ``job``, reusing a client connection from ``cache``."""
        address = (str(job["host"]), int(job["port"]))
        store = cache.get(address)
        if store is None:
            try:
                store = _store(*address, float(job["timeout"]), master=False)
            except Exception as exc:
                raise PersistError(
                    f"rank {job['rank']}: cannot reach the checkpoint coordination store "
                    f"at {address[0]}:{address[1]} ({_first_line(exc)}); rank 0's trainer "
                    "is gone or the address is unreachable (set RESUMABLE_STORE_HOST)"
                ) from exc
            cache[address] = store
        return cls(store, job)

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any, name: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        key = f"{self.key}/{name}"
        if self.coordinator:  # what the others see: an outcome posted by give_up wins
            posted = self._call("post", lambda: self.store.compare_set(key, "", json.dumps(obj)))
            if name == OUTCOME:
                self._forget(self.key)
            return json.loads(posted)
        return json.loads(self._call(f"wait for rank 0's {name}", lambda: self.store.get(key)))

    def gather(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (an empty list elsewhere)."""
        return self._collect(obj, name, 0, list(range(self.world_size)), "")

    def all_ready(self) -> None:
        """Every rank's worker holds this persist's job, its trainer's snapshot taken:
        each rank posts so, and rank 0 waits for every post before it opens the attempt
        that every rank's write waits for. No rank's write then competes with another
        rank's snapshot for the machine's cores (4 ranks on 2 cores: a `save()` 1.35x
        and 1.59x the copy floor's time without this wait, 1.23x and 1.24x with it;
        ``docs/decisions.md``, "Ranks write once every snapshot is taken"). A rank whose
        worker died posts its trainer's error instead (`CoordinationStore.give_up`);
        where one did, or a rank does not post in time, rank 0 raises `PersistError`
        naming it and posts the error as the attempt, so that the others fail at once
        instead of waiting out their timeout."""
        members = list(range(self.world_size))
        try:
            got = self._collect(True, READY, 0, members, " that it took its snapshot")
            errors = [g["error"] for g in got if isinstance(g, dict) and "error" in g]
            if errors:
                raise PersistError(f"{errors[0]}; nothing was committed by this step")
        except PersistError as exc:
            if self.coordinator:
                with contextlib.suppress(Exception):
                    self.store.compare_set(
                        f"{self.key}/{ATTEMPT}", "", json.dumps({"error": str(exc)})
                    )
            raise

    def gather_to(self, obj: Any, name: str, leader: int, members: list[int]) -> list[Any]:
        """Every one of ``members``' ``obj`` on ``leader`` (an empty list elsewhere): one
        post per rank, one wait and one read on the leader, which then removes the keys
        (a node's exchange: O(1) per rank, O(members) on the leader)."""
        got = self._collect(obj, name, leader, members, " of its node")
        if self.rank == leader:
            for r in members:
                try:
                    self.store.delete_key(f"{self.key}/{name}/{r}")
                except Exception as exc:
                    log.debug(
                        "could not remove %s/%s/%d from the store: %s", self.key, name, r, exc
                    )
        return got

    def _collect(
        self, obj: Any, name: str, leader: int, members: list[int], which: str
    ) -> list[Any]:
        """Post this rank's ``obj`` under ``<key>/<name>/<rank>``; on ``leader``, wait for
        every one of ``members``' keys and read them in one request (`multi_get`), not
        one round trip per rank on the path of every rank waiting for the outcome."""
        prefix = f"{self.key}/{name}"
        mine = f"{prefix}/{self.rank}"
        self._call("post", lambda: self.store.compare_set(mine, "", json.dumps(obj)))
        if self.rank != leader:
            return []
        keys = [f"{prefix}/{r}" for r in members]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:
            missing = [r for r, k in zip(members, keys, strict=True) if not self._has(k)]
            raise PersistError(
                f"rank {self.rank}: no report from rank(s) {missing}{which} within "
                f"{self.timeout_s:.0f} s ({_first_line(exc)}); nothing was committed by "
                "this step"
            ) from exc
        values = self._call("read", lambda: self.store.multi_get(keys))
        return [json.loads(v) for v in values]

    def abandon(self, reason: str) -> None:
        """Rank 0 gave up before an outcome: tell the ranks waiting for it."""
        try:
            self.store.compare_set(f"{self.key}/{OUTCOME}", "", json.dumps({"error": reason}))
        except Exception as exc:
            log.debug("could not post the outcome of %s: %s", self.key, exc)
            return
        self._forget(self.key)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _forget(self, key: str) -> None:
        n = int(key[1:]) - 2 if key[1:].isdigit() else 0
        if n < 1:
            return
        old = f"p{n}"
        names = [f"{old}/{ATTEMPT}", f"{old}/{OUTCOME}"]
        names += [f"{old}/{part}/{r}" for part in (READY, REPORTS) for r in range(self.world_size)]
        for k in names:
            try:
                self.store.delete_key(k)
            except Exception as exc:
                log.debug("could not remove %s from the coordination store: %s", k, exc)

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise PersistError(
                f"rank {self.rank}: checkpoint coordination failed ({what}: "
                f"{_first_line(exc)}); nothing was committed by this step"
            ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
