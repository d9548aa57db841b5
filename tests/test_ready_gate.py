"""A coordinated persist's workers write only once every rank's worker holds its job
(`resumable.coordination.StoreCoordinator.all_ready`): rank 0 opens the attempt that
every rank's write waits for only after every rank posted that its snapshot is taken.
Checked on ranks as threads, each with its own client of one real TCPStore."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from resumable.coordination import ATTEMPT, OUTCOME, READY, StoreCoordinator
from resumable.errors import PersistError
from test_verdicts import _store


class Ranks:
    """``n`` ranks' clients of one store; `job` makes the coordinators of persist ``seq``."""

    def __init__(self, n: int, timeout_s: float) -> None:
        self.n, self.timeout_s = n, timeout_s
        self.master = _store(0, master=True, timeout_s=timeout_s)
        port = int(self.master.port)
        self.clients = [_store(port, master=False, timeout_s=timeout_s) for _ in range(n)]

    def job(self, seq: int) -> list[StoreCoordinator]:
        return [
            StoreCoordinator(
                c,
                {"rank": r, "world": self.n, "key": f"p{seq}", "timeout": self.timeout_s},
            )
            for r, c in enumerate(self.clients)
        ]


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_rank_0_opens_the_attempt_only_after_the_last_rank_is_ready() -> None:
    ranks = Ranks(3, timeout_s=30.0)
    c = ranks.job(1)
    c[1].all_ready()  # the others go on at once: they wait for the attempt instead
    late = threading.Event()

    def rank_0() -> Any:
        c[0].all_ready()
        assert late.is_set(), "rank 0 went on before rank 2 was ready"
        return c[0].broadcast({"path": "attempt"}, ATTEMPT)

    t0, out0 = _in_thread(rank_0)
    t1, out1 = _in_thread(lambda: c[1].broadcast(None, ATTEMPT))
    t0.join(0.5)
    t1.join(0.01)
    assert t0.is_alive() and t1.is_alive(), "the attempt was opened with rank 2 not ready"
    assert not ranks.master.check([f"p1/{ATTEMPT}"])
    late.set()
    c[2].all_ready()
    t0.join(30)
    t1.join(30)
    assert out0 == [{"path": "attempt"}] and out1 == [{"path": "attempt"}]
    assert c[2].broadcast(None, ATTEMPT) == {"path": "attempt"}


def test_a_rank_never_ready_fails_rank_0_by_name_and_the_others_at_once() -> None:
    ranks = Ranks(3, timeout_s=1.0)
    c = ranks.job(1)
    c[1].all_ready()
    with pytest.raises(PersistError, match=r"no report from rank\(s\) \[2\] that it took its"):
        c[0].all_ready()
    # rank 1, waiting for the attempt, is told at once (its timeout would be a second
    # later), and nothing was opened: the attempt is the error
    got = c[1].broadcast(None, ATTEMPT)
    assert "error" in got and "rank(s) [2]" in got["error"]
    assert json.loads(ranks.master.get(f"p1/{ATTEMPT}")) == got


def test_the_ready_keys_of_old_persists_are_removed_with_the_others() -> None:
    ranks = Ranks(2, timeout_s=30.0)
    for seq in (1, 2, 3):
        c = ranks.job(seq)
        c[1].all_ready()
        c[0].all_ready()
        c[0].broadcast({"nbytes": 1}, OUTCOME)  # rank 0 removes persist seq - 2's keys
    gone = [f"p1/{READY}/0", f"p1/{READY}/1", f"p1/{OUTCOME}"]
    assert not any(ranks.master.check([k]) for k in gone)
    assert ranks.master.check([f"p3/{READY}/0"]) and ranks.master.check([f"p2/{READY}/1"])


def test_a_rank_whose_worker_died_fails_the_gate_at_once_with_its_trainer_s_reason() -> None:
    """Rank 1's trainer posts in its dead worker's place (`CoordinationStore.give_up`):
    rank 0 stops at the gate with that reason, long before its timeout, and rank 1's
    next worker, were it to wait for this persist's attempt, reads the error."""
    from resumable.coordination import CoordinationStore

    ranks = Ranks(2, timeout_s=60.0)
    c = ranks.job(1)
    trainer_1 = CoordinationStore.__new__(CoordinationStore)  # its store client only
    trainer_1.rank, trainer_1.nodes, trainer_1._store = 1, None, ranks.clients[1]
    trainer_1.give_up("p1", "the persist process (pid 7) exited with code -9")
    with pytest.raises(PersistError, match=r"rank 1: the persist process \(pid 7\) exited"):
        c[0].all_ready()
    assert "exited with code -9" in c[1].broadcast(None, ATTEMPT)["error"]
