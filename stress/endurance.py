"""Campaign 7, endurance: many consecutive saves with retention, both tiers on.

One `Checkpointer` (persist in its worker process, memory snapshots in shared memory,
``Keep(last=3)``, ``on_busy="wait"`` so every save persists) saves ``saves`` steps in a
row. After a warm-up (a tenth of the run) and at the end it samples, for the trainer and
for the persist worker: resident memory, open descriptors, threads; the shared-memory
segments in its own shm directory; and the bytes in the root. It checks:

- resources flat: descriptors, threads and shared-memory segments equal at the end to
  the warm-up values; resident memory within ``RSS_SLACK`` (allocator noise) of them;
- disk within the retention bound: checkpoint directories hold at most ``last + 1``
  checkpoints' bytes (the ones kept and one being written), a checkpoint's bytes being
  the largest one seen in any sample (a later checkpoint can be a few bytes longer than
  the warm-up's, which an average of the warm-up's checkpoints once missed by 2 bytes);
  the audit log, which grows
  by design, is reported in bytes per save;
- the newest checkpoint restores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock

import resumable.pipeline._worker_jobs
from resumable import Checkpointer, Every, Keep
from resumable.commit import list_committed
from resumable.storage.base import Buffer
from resumable.storage.local import LocalStorage
from stress.workload import checkpointer, local, make_state, set_step

SIZES = {"small": {"saves": 200}, "full": {"saves": 10_000}}
KEEP = 3
RSS_SLACK = 32 << 20


def _proc(pid: int) -> dict[str, int]:
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
    }


def settled(pid: int, root: str | None = None, timeout: float = 5.0) -> dict[str, int]:
    """`_proc` of a persist worker once it is idle: its descriptors and threads the same
    in two samples 50 ms apart, and no checkpoint directory of ``root`` still being
    removed (the worker removes those retention deleted on a thread of its own, after
    it replied). A leak stays; a removal in progress ends."""
    deadline = time.monotonic() + timeout
    last = _proc(pid)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _proc(pid)
        trash = root is not None and any(n.startswith(".trash-") for n in os.listdir(root))
        if not trash and (now["fds"], now["threads"]) == (last["fds"], last["threads"]):
            return now
        last = now
    return last


def _size(path: str) -> int:
    """0 for a file gone since it was listed: retention's discard thread removes trash
    directories while the walk runs (a file listed, then unlinked, failed a CI run)."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _tree_bytes(root: str) -> tuple[int, int, int, int]:
    """(bytes in step directories, bytes in hidden staging/trash ones, other bytes, bytes
    of the largest step directory)."""
    steps = hidden = other = 0
    per_step: dict[str, int] = {}
    for d, _, files in os.walk(root):
        rel = os.path.relpath(d, root)
        size = sum(_size(os.path.join(d, f)) for f in files)
        if rel == ".":
            other += size
        elif rel.startswith("step-"):
            steps += size
            top = rel.split(os.sep, 1)[0]
            per_step[top] = per_step.get(top, 0) + size
        elif rel.startswith("."):
            hidden += size
        else:
            other += size
    return steps, hidden, other, max(per_step.values(), default=0)


def _sample(shm: str, root: str, worker: int | None) -> dict[str, Any]:
    segments = sum(len(files) for _, _, files in os.walk(shm))
    steps, hidden, other, largest = _tree_bytes(root)
    out: dict[str, Any] = {
        "trainer": settled(os.getpid(), root),
        "shm_segments": segments,
        "checkpoint_bytes": steps,
        "largest_checkpoint_bytes": largest,
        "staging_bytes": hidden,
        "other_bytes": other,
        "checkpoints": len(list_committed(local(root))),
    }
    if worker is not None:
        out["worker"] = settled(worker, root)
    return out


@contextlib.contextmanager
def broken_save(kind: str | None) -> Iterator[None]:
    """Within the block, in-process persists break: ``"leak-fd"`` leaves a descriptor
    open per file written, ``"no-retention"`` never deletes a checkpoint."""
    if kind is None:
        yield
        return
    if kind == "no-retention":
        jobs = resumable.pipeline._worker_jobs
        with mock.patch.object(jobs, "apply_retention", lambda *a, **k: []):
            yield
        return
    if kind != "leak-fd":
        raise ValueError(f"unknown broken save {kind!r}")
    leaked: list[int] = []
    write = LocalStorage.write

    def leaky(self: LocalStorage, path: str, chunks: Iterable[Buffer]) -> int:
        leaked.append(os.open(os.devnull, os.O_RDONLY))
        return write(self, path, chunks)

    try:
        with mock.patch.object(LocalStorage, "write", leaky):
            yield
    finally:
        for fd in leaked:
            os.close(fd)


def flat(base: dict[str, Any], end: dict[str, Any], who_prefix: str = "") -> list[str]:
    """Problems: the trainer's or the worker's descriptors or threads changed between the
    samples ``base`` and ``end``, or its resident memory grew by more than `RSS_SLACK`."""
    problems = []
    for who in ("trainer", "worker"):
        if who not in base or who not in end:
            continue
        for key in ("fds", "threads"):
            if end[who][key] != base[who][key]:
                problems.append(
                    f"{who_prefix}{who} {key}: {base[who][key]} after warm-up, "
                    f"{end[who][key]} at end"
                )
        grew = end[who]["rss_bytes"] - base[who]["rss_bytes"]
        if grew > RSS_SLACK:
            problems.append(f"{who_prefix}{who} resident memory grew by {grew >> 20} MiB")
    return problems


def run(size: str, *, saves: int | None = None, broken: str | None = None) -> dict[str, Any]:
    """``broken`` (with ``persist="thread"``, so the patch reaches the persist) is for
    showing that the checks fail on a leaking save path."""
    saves = saves or SIZES[size]["saves"]
    warm = max(saves // 10, 20)
    t0 = time.perf_counter()
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="endurance-") as tmp:
        shm = tempfile.mkdtemp(prefix="endurance-", dir="/dev/shm")
        leaking = contextlib.ExitStack()
        ck: Checkpointer | None = None
        try:
            root = os.path.join(tmp, "root")
            state = make_state()
            ck = checkpointer(
                root,
                state,
                persist="process" if broken is None else "thread",
                memory_every=Every(steps=1),
                keep=Keep(last=KEEP),
                on_busy="wait",
                shm_dir=shm,
            )
            leaking.enter_context(broken_save(broken))
            worker: int | None = None
            base: dict[str, Any] = {}
            max_ckpt = 0
            max_steps_bytes = 0
            for step in range(1, saves + 1):
                set_step(state, step)
                ck.save(step)
                if step in (warm, saves):
                    ck.wait()
                    worker = ck.worker_pid
                    sample = _sample(shm, root, worker)
                    if step == warm:
                        base = sample
                    max_ckpt = max(max_ckpt, sample["largest_checkpoint_bytes"])
                if step % 50 == 0:
                    steps_bytes, _, _, largest = _tree_bytes(root)
                    max_steps_bytes = max(max_steps_bytes, steps_bytes)
                    max_ckpt = max(max_ckpt, largest)
            ck.wait()
            end = _sample(shm, root, worker)
            max_ckpt = max(max_ckpt, end["largest_checkpoint_bytes"])
            leaking.close()
            audit_bytes = os.path.getsize(os.path.join(root, "audit.jsonl"))
            ck.close()
            restored = checkpointer(root, make_state(), keep=None)
            got = restored.restore()
            restored.close()
        finally:
            leaking.close()
            if ck is not None:  # its threads stop writing before the directory goes
                with contextlib.suppress(Exception):
                    ck.close()
            shutil.rmtree(shm, ignore_errors=True)
    if got != saves:
        problems.append(f"restore came back at {got}, not {saves}")
    problems += flat(base, end)
    if end["shm_segments"] != base["shm_segments"]:
        problems.append(f"shm segments: {base['shm_segments']} -> {end['shm_segments']}")
    bound = (KEEP + 1) * max_ckpt
    if max(max_steps_bytes, end["checkpoint_bytes"]) > bound:
        problems.append(f"checkpoints held {max_steps_bytes} bytes, bound {bound}")
    return {
        "trials": saves,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "saves": saves,
            "warm_up_saves": warm,
            "after_warm_up": base,
            "at_end": end,
            "checkpoint_bytes_max_sampled": max_steps_bytes,
            "retention_bound_bytes": bound,
            "audit_log_bytes": audit_bytes,
            "audit_log_bytes_per_save": round(audit_bytes / saves, 1),
            "restored_step": got,
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
