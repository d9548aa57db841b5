"""`resumable.distributed.Group.any_started`: the busy-flag all-reduce a save starts
before its snapshot copy and reads after it, on a real two-rank gloo group (two
processes, a file store): every rank gets the same answer, work between the start and
the answer does not change it, and a peer that leaves makes the answer raise
`PersistError` instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from resumable.distributed import current_group
    from resumable.errors import PersistError

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2
    )
    group = current_group(timeout_s=10)
    out = []
    out.append(group.any(rank == 1))  # one rank busy: every rank skips
    out.append(group.any(False))
    answer = group.any_started(rank == 0)
    a = torch.randn(1 << 20)
    for _ in range(20):  # a copy between the start and the answer
        b = a.clone()
    out.append(answer())
    answer = group.any_started(False)
    time.sleep(0.3 if rank else 0.0)  # the answer waits for the slower rank
    out.append(answer())
    print("answers", out, flush=True)
    if rank == 1:
        os._exit(0)  # leaves without taking part in the next one
    time.sleep(1.0)
    try:
        group.any_started(True)()
    except PersistError as exc:
        print("raised", str(exc)[:200], flush=True)
    else:
        print("no error", flush=True)
    os._exit(0)
    """
)


def test_every_rank_gets_one_answer_and_a_departed_peer_raises(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), store],
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
        assert "answers [True, False, True, False]" in out, (out, err[-2000:])
    assert "raised rank 0: checkpoint coordination with the other ranks failed" in outs[0][0], (
        outs[0][0],
        outs[0][1][-2000:],
    )
