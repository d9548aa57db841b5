"""`resumable.coordination.Agreement` and `resumable.group.Group.any`, on a real
two-rank gloo group (two processes, a file store) and the real coordination store:

- through the store, the first rank to decide decides for both, and neither waits for
  the other (rank 1 decides only once rank 0's decision returned: a decision that
  waited for the other rank would never return);
- a decision asked later (`Agreement.decide_later`) is out before its answer is
  asked for, and gets the same answer a decision would;
- a decision taken again at the same step is a decision of its own; a rank that left
  one out meets the other again at the next step; every key is removed once both ranks
  read it;
- a stop asked on one rank (`Agreement.any_since`) is answered True on every rank from
  the first decision after it, at one step;
- without the store (``persist="sync"``) rank 0 decides, and a stop is all-reduced;
- the store gone, a decision raises `PersistError` instead of hanging;
- `Group.any` is true on every rank when one rank's flag is, and a peer that left makes
  it raise `PersistError`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    from resumable.coordination import Agreement, CoordinationStore
    from resumable.group import current_group
    from resumable.errors import PersistError

    rank, out = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(out / "filestore"), 2), rank=rank, world_size=2
    )
    group = current_group(timeout_s=10)
    store = CoordinationStore(group, 10)
    agree = Agreement(group, store)

    def after(name):  # wait until the other rank wrote ``name``
        while not (out / name).exists():
            time.sleep(0.01)

    def done(name):
        (out / name).write_text("1")

    answers = []
    # step 5: rank 0 first (busy); step 6: rank 1 first (free), twice at that step
    if rank == 0:
        answers.append(agree.decide("busy", 5, True))
        done("r0-5")
        after("r1-6")
        answers.append(agree.decide("busy", 6, True))
        answers.append(agree.decide("busy", 6, True))
        done("r0-6")
    else:
        after("r0-5")
        answers.append(agree.decide("busy", 5, False))
        answers.append(agree.decide("busy", 6, False))
        done("r1-6")
        after("r0-6")
        answers.append(agree.decide("busy", 6, False))
    # step 7: rank 1 leaves the decision out; step 8: rank 1 first (True)
    if rank == 0:
        answers.append(agree.decide("due", 7, False))
        after("r1-8")
        answers.append(agree.decide("due", 8, False))
    else:
        answers.append(agree.decide("due", 8, True))
        done("r1-8")
    answers.append(Agreement(group, None).decide("sync", 9, rank == 1))  # rank 0 decides
    print("answers", answers, flush=True)
    # step 30, asked later: rank 0's question is out (its key is in the store) before
    # anything asks for its answer, and rank 1, asking after that, gets rank 0's answer
    if rank == 0:
        reads = []
        pending = agree.decide_later("later", 30, lambda: reads.append(1) or True)
        probe = dist.TCPStore(
            store.host, store.port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=10),
        )
        while not probe.check(["agree/later/30/1"]):
            time.sleep(0.001)
        done("r0-30")
        after("r1-30")
        print("later", [pending.result(), pending.result(), len(reads)], flush=True)
    else:
        after("r0-30")
        print("later", [agree.decide("later", 30, False)], flush=True)
        done("r1-30")
    # a stop asked on rank 1 after rank 0 decided step 21: every rank stops at 22
    if rank == 0:
        stops = [agree.any_since("stop", 20, False), agree.any_since("stop", 21, False)]
        done("r0-21")
        after("r1-21")
        stops.append(agree.any_since("stop", 22, False))
    else:
        stops = [agree.any_since("stop", 20, False)]
        after("r0-21")
        stops.append(agree.any_since("stop", 21, True))
        done("r1-21")
        stops.append(agree.any_since("stop", 22, True))
    stops.append(Agreement(group, None).any_since("stop", 23, rank == 1))  # an all-reduce
    print("stops", stops, flush=True)
    answers = [group.any(rank == 1), group.any(False)]
    print("any", answers, flush=True)

    group.any(False)  # both have decided everything: which keys are left?
    client = dist.TCPStore(
        store.host, store.port, is_master=False, wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )
    keys = ["agree/busy/5/1", "agree/busy/6/1", "agree/busy/6/2", "agree/due/8/1"]
    keys += ["agree/later/30/1"]
    keys += [f"agree/stop/{step}/1" for step in (20, 21, 22)]
    keys += [k + "/n" for k in keys]
    print("left", [k for k in keys if client.check([k])], flush=True)
    group.any(False)
    if rank == 0:
        os._exit(0)  # leaves: its store and its side of the group go with it
    time.sleep(1.0)
    for what, fn in (("store", lambda: agree.decide("busy", 10, False)),
                     ("later", lambda: agree.decide_later("busy", 11, lambda: False).result()),
                     ("any", lambda: group.any(True))):
        try:
            fn()
        except PersistError as exc:
            print("raised", what, str(exc)[:300], flush=True)
        else:
            print("no error", what, flush=True)
    os._exit(0)
    """
)


def test_the_first_rank_decides_for_both_without_waiting(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err[-3000:]
        assert "any [True, False]" in out, (out, err[-2000:])
        assert "left []" in out, (out, err[-2000:])
        assert "stops [False, False, True, True]" in out, (out, err[-2000:])
    (out0, err0), (out1, err1) = outs
    # rank 0 answers: 5 (its own), 6 (rank 1's), 6 again (its own, first), 7 (alone,
    # its own), 8 (rank 1's); rank 1: 5 (rank 0's), 6 (its own), 6 again (rank 0's),
    # 8 (its own); and rank 0's value without the store
    assert "answers [True, False, True, False, True, False]" in out0, (out0, err0[-2000:])
    assert "answers [True, False, True, True, False]" in out1, (out1, err1[-2000:])
    # asked later: rank 0's own value, read once; rank 1 told rank 0's
    assert "later [True, True, 1]" in out0, (out0, err0[-2000:])
    assert "later [True]" in out1, (out1, err1[-2000:])
    assert "raised store rank 1: cannot reach the checkpoint coordination store" in out1, (
        out1,
        err1[-2000:],
    )
    assert "raised later rank 1: cannot reach the checkpoint coordination store" in out1, (
        out1,
        err1[-2000:],
    )
    assert "raised any rank 1: checkpoint coordination with the other ranks failed" in out1, (
        out1,
        err1[-2000:],
    )


def test_a_decision_asked_later_alone_reads_its_value_when_answered() -> None:
    """One process: `decide_later` reads the value only when its answer is asked for
    (a persist's worker may finish during the snapshot copy), once."""
    from resumable.coordination import Agreement
    from resumable.group import Group

    agree = Agreement(Group(0, 1), None)
    worker_busy = [True]
    pending = agree.decide_later("busy", 3, lambda: worker_busy[0])
    worker_busy[0] = False  # the copy ran; the worker finished meanwhile
    assert pending.result() is False
    worker_busy[0] = True
    assert pending.result() is False  # answered once


def test_a_decision_asked_on_a_thread_hands_its_error_to_the_caller() -> None:
    """What asking raised comes out of `Pending.result`, on the caller's thread; a
    caller that failed before it needed the answer lets it end (`settle`) without a
    second error over its own. The decisions are asked in order, on one thread."""
    import threading

    from resumable.coordination import _Asker
    from resumable.errors import PersistError

    seen: list[str] = []

    def ask() -> bool:
        seen.append(threading.current_thread().name)
        raise PersistError("rank 1: cannot reach the checkpoint coordination store")

    asker = _Asker()
    pending = asker.ask(ask)
    try:
        pending.result()
    except PersistError as exc:
        assert "cannot reach" in str(exc)
    else:
        raise AssertionError("no PersistError")
    asker.ask(ask).settle()  # no error of its own
    later = [asker.ask(lambda i=i: seen.append(str(i)) or i % 2 == 0) for i in range(5)]
    assert [p.result() for p in later] == [True, False, True, False, True]
    assert seen == ["resumable-agree", "resumable-agree", "0", "1", "2", "3", "4"]
    asker.close()
    asker._thread.join(timeout=10)
    assert not asker._thread.is_alive()
