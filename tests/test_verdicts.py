"""The restore's verdicts (`resumable.coordination.StoreVerdicts`, `GroupVerdicts`).

Every rank says what it found wrong with a restore candidate (None: nothing), and every
rank gets the same list back, so all ranks take the candidate or all fall back. Through
the store each rank sets one key and reads one answer, whatever the number of ranks:
checked here on N ranks as threads, each with its own client of one real TCPStore, with
the store operations counted. The answer names at most `MAX_SAID` ranks in full, keeps
one verdict of each kind, and leaves no key behind. A rank that never answers makes
every rank raise `PersistError` within the timeout, not hang.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from resumable.coordination import MAX_SAID, GroupVerdicts, StoreVerdicts, Verdict, said
from resumable.errors import PersistError


class Counted:
    """A store client counting its operations by name."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.ops[name] += 1
            return fn(*args)

        return counted


def _store(port: int, *, master: bool, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


class Job:
    """``n`` ranks' `StoreVerdicts`, each on a counting client of one store."""

    def __init__(self, n: int, timeout_s: float = 60.0) -> None:
        self.master = _store(0, master=True, timeout_s=timeout_s)
        port = int(self.master.port)
        with ThreadPoolExecutor(n) as pool:  # one connect now and then stalls for seconds
            stores = list(
                pool.map(lambda _: _store(port, master=False, timeout_s=timeout_s), range(n))
            )
        self.clients = [Counted(store) for store in stores]
        self.ranks = [StoreVerdicts(c, r, n, timeout_s) for r, c in enumerate(self.clients)]

    def run(self, fn: Callable[[int], Any], ranks: list[int] | None = None) -> list[Any]:
        """``fn(rank)`` on a thread per rank of ``ranks`` (all); each result or error."""
        ranks = list(range(len(self.ranks))) if ranks is None else ranks
        out: list[Any] = [None] * len(self.ranks)

        def body(r: int) -> None:
            try:
                out[r] = fn(r)
            except Exception as exc:
                out[r] = exc

        threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def collect(self, verdicts: list[Verdict | None]) -> list[Any]:
        return self.run(lambda r: self.ranks[r].collect(verdicts[r]))


def test_no_verdict_is_an_empty_answer_on_every_rank() -> None:
    job = Job(5)
    assert job.collect([None] * 5) == [[]] * 5
    assert job.master.num_keys() == 0


@pytest.mark.parametrize("who", [0, 3])
def test_one_rank_s_verdict_reaches_every_rank(who: int) -> None:
    job = Job(5)
    verdicts: list[Verdict | None] = [None] * 5
    verdicts[who] = ("corrupt", f"rank {who}: rank-00003.safetensors is missing")
    assert job.collect(verdicts) == [[verdicts[who]]] * 5
    # The next candidate meets under keys of its own.
    assert job.collect([None] * 5) == [[]] * 5
    assert job.master.num_keys() == 0


@pytest.mark.parametrize("n", [4, 16])
def test_each_rank_makes_the_same_few_store_operations_at_any_n(n: int) -> None:
    job = Job(n)
    job.collect([None] * n)
    ops = [c.ops for c in job.clients]
    # Rank 0: wait for the N - 1 keys, read them in one multi_get, post the answer,
    # count itself a reader. Others: post, read the answer, remove their key, count
    # themselves. The last reader also removes the answer and its count.
    assert ops[0]["multi_get"] == ops[0]["wait"] == 1
    assert all(sum(o.values()) in (4, 6) for o in ops)
    assert sum(sum(o.values()) for o in ops) == 4 * n + 2
    assert job.master.num_keys() == 0


def test_the_answer_names_a_bounded_number_of_ranks_and_every_kind() -> None:
    n = MAX_SAID + 4
    verdicts: list[Verdict | None] = [("corrupt", f"rank {r}: bad") for r in range(n)]
    verdicts[n - 1] = ("mismatch", f"rank {n - 1}: another state")
    answers = Job(n).collect(verdicts)
    assert all(a == answers[0] for a in answers)
    got = answers[0]
    assert got[:MAX_SAID] == verdicts[:MAX_SAID]
    assert got[MAX_SAID] == verdicts[n - 1]  # the only mismatch is kept
    assert got[-1] == ("corrupt", f"and {n - MAX_SAID - 1} more rank(s) (each logged its own)")
    assert len(got) == MAX_SAID + 2


def test_said_keeps_short_lists_as_they_are() -> None:
    verdicts = [("corrupt", f"rank {r}") for r in range(MAX_SAID)]
    assert said(verdicts) == verdicts
    assert said([]) == []


def test_a_rank_that_never_answers_fails_every_rank_instead_of_hanging() -> None:
    job = Job(3, timeout_s=1.0)
    out = job.run(lambda r: job.ranks[r].collect(None), ranks=[0, 1])
    assert isinstance(out[0], PersistError)
    assert "no restore verdict from rank(s) [2]" in str(out[0])
    # Rank 1 reads rank 0's reason, or its own wait for the answer runs out first.
    assert isinstance(out[1], PersistError)


class _Group:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.world_size = len(answers)

    def all_gather(self, obj: Any, name: str = "") -> list[Any]:
        return self.answers


def test_over_the_group_the_answer_is_the_same_list() -> None:
    n = 2 * MAX_SAID
    verdicts: list[Any] = [("corrupt", f"rank {r}: bad") for r in range(n)]
    verdicts[1] = None
    got = GroupVerdicts(_Group(verdicts)).collect(None)
    assert got == said([v for v in verdicts if v is not None])
    assert GroupVerdicts(_Group([None])).collect(None) == []
