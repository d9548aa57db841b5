"""Campaign 7b, endurance at two ranks: campaign 7 (`stress.endurance`) for a job of two
ranks in a real ``torch.distributed`` gloo process group, with the background pipeline.

Two processes are forked from this one and join a gloo group through a ``TCPStore`` this
process hosts on a free loopback port. Each rank runs a `Checkpointer` on one shared
root with both tiers: a memory snapshot in shared memory every step and every save
persisted by its persist worker process, which coordinate each commit through rank 0's
store (``docs/distributed.md``); ``Keep(last=3)``; ``on_busy="wait"``, so every save
persists. Each rank saves ``saves`` steps in a row. After a warm-up (a tenth of the run)
and at the end, both ranks wait for their persists, meet at a barrier, and sample, for
the trainer and for its persist worker: resident memory, open descriptors, threads; the
shared-memory segments of the job; and (rank 0) the bytes in the root. Checks:

- resources flat on each rank: descriptors, threads and shared-memory segments equal at
  the end to the warm-up values; resident memory within `stress.endurance.RSS_SLACK`;
- disk within the retention bound: checkpoint directories hold at most ``last + 1``
  checkpoints' bytes (sampled every 50 saves on rank 0);
- after both ranks closed, each restores the newest checkpoint with a fresh
  `Checkpointer` (a collective restore): the last step, on both ranks, with exactly the
  values saved at it (a replicated model and a per-rank tensor).

The broken save paths of `stress.endurance.broken_save` (a descriptor leaked per file
written, no retention) are patched in this process and so in both forked ranks; with
them the persists run on a thread (``persist="thread"``), where the patches apply.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any

from resumable import Every, Keep
from resumable.commit import list_committed
from stress.endurance import KEEP, _proc, _tree_bytes, broken_save, flat, settled
from stress.killranks import WORLD, _same, _set, _state
from stress.workload import checkpointer, local

SIZES = {"small": {"saves": 100}, "full": {"saves": 10_000}}
DIST_TIMEOUT_S = 30.0
LIMIT_S_PER_SAVE = 1.0
"""How long a rank may take per save before the run counts as hung (killed)."""


def _segments(shm: str) -> int:
    return sum(len(files) for _, _, files in os.walk(shm))


def _job(rank: int, port: int, root: str, shm: str, out: int, saves: int, persist: str) -> None:
    """One rank: join the group, save ``saves`` steps with samples after the warm-up and
    at the end, close, restore with a fresh checkpointer; report as one JSON line."""
    import torch.distributed as dist

    logging.getLogger("resumable").setLevel(logging.ERROR)
    timeout = timedelta(seconds=DIST_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    warm = max(saves // 10, 20)
    state = _state()
    ck = checkpointer(
        root,
        state,
        persist=persist,
        memory_every=Every(steps=1),
        keep=Keep(last=KEEP),
        on_busy="wait",
        shm_dir=shm,
        dist_timeout_s=DIST_TIMEOUT_S,
    )
    samples: dict[str, Any] = {}
    max_steps_bytes = max_ckpt = 0
    for step in range(1, saves + 1):
        _set(state, step, rank)
        ck.save(step)
        if step in (warm, saves):
            ck.wait()
            dist.barrier()
            sample: dict[str, Any] = {"trainer": _proc(os.getpid()), "shm": _segments(shm)}
            if ck.worker_pid is not None:
                sample["worker"] = settled(ck.worker_pid, root if rank == 0 else None)
            if rank == 0:
                steps_bytes, _, _, largest = _tree_bytes(root)
                sample["checkpoint_bytes"] = steps_bytes
                sample["checkpoints"] = len(list_committed(local(root)))
                max_ckpt = max(max_ckpt, largest)
            samples["warm" if step == warm else "end"] = sample
            dist.barrier()
        if rank == 0 and step % 50 == 0:
            steps_bytes, _, _, largest = _tree_bytes(root)
            max_steps_bytes = max(max_steps_bytes, steps_bytes)
            max_ckpt = max(max_ckpt, largest)
    ck.close()
    dist.barrier()
    fresh = _state()
    again = checkpointer(root, fresh, keep=None, shm_dir=shm, dist_timeout_s=DIST_TIMEOUT_S)
    got = again.restore()
    again.close()
    expected = _state()
    _set(expected, got, rank)
    report = {
        "rank": rank,
        "warm": warm,
        "samples": samples,
        "restored": got,
        "restored_same": _same(fresh, expected),
        "max_steps_bytes": max_steps_bytes,
        "max_ckpt_bytes": max_ckpt,
    }
    os.write(out, (json.dumps(report) + "\n").encode())
    dist.barrier()


def _fork(port: int, root: str, shm: str, saves: int, persist: str) -> list[tuple[int, int]]:
    ranks: list[tuple[int, int]] = []
    for rank in range(WORLD):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns: no teardown (gloo's exit race)
            code = 0
            try:
                os.close(r)
                for _, fd in ranks:
                    os.close(fd)
                _job(rank, port, root, shm, w, saves, persist)
            except BaseException as exc:
                code = 1
                os.write(w, (json.dumps({"rank": rank, "error": repr(exc)[:500]}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(w)
        ranks.append((pid, r))
    return ranks


def _collect(ranks: list[tuple[int, int]], limit_s: float) -> tuple[list[dict[str, Any]], bool]:
    """Each rank's report; whether every rank ended within ``limit_s`` (else killed)."""
    deadline = time.perf_counter() + limit_s
    data = {fd: b"" for _, fd in ranks}
    ended = {pid: False for pid, _ in ranks}
    while not all(ended.values()) and time.perf_counter() < deadline:
        for pid, _ in ranks:
            if not ended[pid] and os.waitpid(pid, os.WNOHANG)[0]:
                ended[pid] = True
        for fd in select.select(list(data), [], [], 0.05)[0]:
            data[fd] += os.read(fd, 65536)
    in_time = all(ended.values())
    for pid, _ in ranks:
        if not ended[pid]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    reports = []
    for _, fd in ranks:
        while chunk := os.read(fd, 65536):
            data[fd] += chunk
        os.close(fd)
        lines = data[fd].decode(errors="replace").splitlines()
        reports.append(json.loads(lines[-1]) if lines else {"error": "said nothing"})
    return reports, in_time


def _problems(reports: list[dict[str, Any]], saves: int) -> list[str]:
    problems = []
    for r, rep in enumerate(reports):
        if "error" in rep:
            problems.append(f"rank {r} failed: {rep['error']}")
            continue
        if rep["restored"] != saves or not rep["restored_same"]:
            problems.append(
                f"rank {r} restored step {rep['restored']} "
                f"({'the values saved' if rep['restored_same'] else 'other values'}), "
                f"not step {saves}"
            )
        base, end = rep["samples"]["warm"], rep["samples"]["end"]
        problems += flat(base, end, f"rank {r} ")
        if end["shm"] != base["shm"]:
            problems.append(f"rank {r}: shm segments {base['shm']} -> {end['shm']}")
        if r == 0:
            bound = (KEEP + 1) * rep["max_ckpt_bytes"]
            held = max(rep["max_steps_bytes"], end["checkpoint_bytes"])
            if held > bound:
                problems.append(f"checkpoints held {held} bytes, bound {bound}")
    return problems


def run(size: str, *, saves: int | None = None, broken: str | None = None) -> dict[str, Any]:
    from torch.distributed import TCPStore

    saves = saves or SIZES[size]["saves"]
    t0 = time.perf_counter()
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="endurance2-") as tmp:
        shm = tempfile.mkdtemp(prefix="endurance2-", dir="/dev/shm")
        try:
            root = os.path.join(tmp, "root")
            with broken_save(broken):
                ranks = _fork(
                    int(store.port), root, shm, saves, "process" if broken is None else "thread"
                )
                reports, in_time = _collect(ranks, 60.0 + LIMIT_S_PER_SAVE * saves)
            audit = os.path.join(root, "audit.jsonl")
            audit_bytes = os.path.getsize(audit) if os.path.exists(audit) else 0
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    problems = _problems(reports, saves)
    if not in_time:
        problems.append(f"a rank ran over {60.0 + LIMIT_S_PER_SAVE * saves:.0f} s and was killed")
    return {
        "trials": saves,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "saves": saves,
            "ranks": WORLD,
            "persist": "process" if broken is None else "thread",
            "warm_up_saves": next((r.get("warm") for r in reports if "warm" in r), None),
            "samples": [r.get("samples") for r in reports],
            "checkpoint_bytes_max_sampled": reports[0].get("max_steps_bytes"),
            "retention_bound_bytes": (KEEP + 1) * reports[0].get("max_ckpt_bytes", 0),
            "audit_log_bytes": audit_bytes,
            "audit_log_bytes_per_save": round(audit_bytes / saves, 1),
            "restored_steps": [r.get("restored") for r in reports],
            "problems": problems,
        },
    }


BROKEN = ("leak-fd", "no-retention")


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks run on each broken save path (60 saves, persists on a thread)."""
    out = {}
    for kind in BROKEN:
        r = run("small", saves=60, broken=kind)
        out[kind] = {"trials": r["trials"], "failures": r["failures"]}
    return out
