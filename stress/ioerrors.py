"""Campaign 3, I/O errors: ``EIO`` and ``ENOSPC`` at every file-system call of a save,
once and from then on, and a real full disk.

Injected: a root holds committed steps 1 and 2 (``Keep(last=2)``, so saving step 3
also runs retention). A clean save of step 3 is counted (every interposed call inside
the root: open, write, fsync, mkdir, rename, unlink, rmdir, link, listdir, stat); then
for each call index, errno and mode, a fresh copy of the root saves step 3 with that
call failing. Each trial is judged:

- the save either raises a `CheckpointError` (a clean failure) or returns (a transient
  error is retried by the library, as a whole new attempt). It is a false commit if a
  listed checkpoint holds a file whose ``fsync`` failed and that was not written again
  from scratch since, if the save returned while a name of the new checkpoint (its
  directory in the root, its files in it) was created or renamed into place and its
  directory not synced since, or if an ``fsync`` of a descriptor is
  tried again after it failed
  (a retry that reports a false success: the kernel may have dropped the dirty pages);
- whatever the outcome, every listed checkpoint verifies (a step-3 checkpoint listed
  after a failed save must be whole), step 2 stays listed and valid, and a fresh
  `Checkpointer` restores the newest listed one;
- what the failed attempt left in the root (staging or trash directories) is counted,
  with its bytes, and must have been named in a WARNING (so it is reported, not silent).

Full disk: a tmpfs of 8 MiB is mounted (root only; skipped with the reason otherwise)
and saved into until it is full; every save that fails must fail with `StorageError`
(``ENOSPC``), leave no staging directory, and leave the newest committed checkpoint
restorable.

The broken save paths (``broken``): ``"ignore-fsync-error"`` swallows a failed fsync,
``"retry-fsync"`` retries it once; both must be reported as false commits.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import tempfile
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import resumable.retrying
from resumable.commit import list_committed
from resumable.errors import CheckpointError, StorageError
from resumable.reader import CheckpointReader
from stress.fsops import ERRNOS, Fault, FileOps
from stress.workload import checkpointer, local, make_state, set_step

SIZES: dict[str, dict[str, Any]] = {
    "small": {"errnos": ("EIO", "ENOSPC"), "modes": ("once", "sticky"), "stride": 7},
    "full": {"errnos": ("EIO", "ENOSPC"), "modes": ("once", "sticky"), "stride": 1},
    "fsyncs": {"errnos": ("EIO",), "modes": ("once",), "stride": 0},  # able-to-fail runs
}
BROKEN = ("ignore-fsync-error", "retry-fsync")
STEP = 3


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _base(root: str) -> None:
    state = make_state()
    ck = checkpointer(root, state)
    for step in (1, 2):
        set_step(state, step)
        ck.save(step)
    ck.close()


def _leftovers(root: str) -> dict[str, int]:
    out = {}
    for name in os.listdir(root):
        if name.startswith((".tmp-", ".trash-")):
            total = 0
            for d, _, files in os.walk(os.path.join(root, name)):
                total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
            out[name] = total
    return out


def trial(base: str, work: str, fault: Fault | None, broken: str | None = None) -> dict[str, Any]:
    """One save of step 3 from a copy of ``base`` with ``fault``; the verdict."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    state = make_state()
    ck = checkpointer(work, state)
    ck.restore()
    set_step(state, STEP)
    ops = FileOps(work, fault=fault, record=False, broken=broken)
    handler = _Records()
    logger = logging.getLogger("resumable")
    logger.addHandler(handler)
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    raised: BaseException | None = None
    no_backoff = SimpleNamespace(sleep=lambda s: None)  # the retries, without their waits
    try:
        with mock.patch.object(resumable.retrying, "time", no_backoff), ops.active():
            try:
                ck.save(STEP)
            except BaseException as exc:
                raised = exc
        try:
            ck.close()
        except CheckpointError:
            pass
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    problems = []
    injected = fault.injected if fault is not None else []
    if raised is not None and not isinstance(raised, CheckpointError):
        problems.append(f"unclean: {type(raised).__name__}: {raised}")
    if ops.fsync_after_failure:
        problems.append(f"false commit: fsync retried after it failed on {ops.fsync_after_failure}")
    storage = local(work)
    listed = list_committed(storage)
    final = f"step-{STEP:012d}"
    if raised is None:
        loose = sorted(p for p in ops.unsynced if p == final or p.startswith(final + "/"))
        if loose:
            problems.append(
                f"false commit: the save returned, but the directory entries of {loose} "
                "were never synced"
            )
    for step in listed:
        for d, _, files in os.walk(os.path.join(work, f"step-{step:012d}")):
            for f in files:
                st = os.stat(os.path.join(d, f))
                if (st.st_dev, st.st_ino) in ops.poisoned:
                    problems.append(
                        f"false commit: step {step} lists {f}, whose fsync failed and which "
                        "was not written again since"
                    )
    for step in listed:
        try:
            CheckpointReader(storage, step).verify()
        except CheckpointError as exc:
            problems.append(f"torn: step {step} listed but does not verify: {exc}")
    if 2 not in listed:
        problems.append("lost: the previous checkpoint (step 2) is not listed")
    if raised is None and STEP not in listed:
        problems.append("lost: the save returned but step 3 is not listed")
    try:
        ck2 = checkpointer(work, make_state())
        got = ck2.restore()
        ck2.close()
        if got != max(listed, default=0):
            problems.append(f"restore came back at {got}, newest listed is {max(listed)}")
    except CheckpointError as exc:
        problems.append(f"restore failed: {exc}")
    left = _leftovers(work)
    unreported = [n for n in left if not any(n in m for m in handler.messages)]
    if raised is not None and unreported:
        problems.append(f"left behind without a word: {unreported}")
    return {
        "outcome": "returned" if raised is None else type(raised).__name__,
        "injected": len(injected),
        "committed": STEP in listed,
        "left_bytes": sum(left.values()),
        "left_dirs": len(left),
        "problems": problems,
    }


def count_calls(base: str, work: str) -> list[tuple[str, str]]:
    """The interposed calls of a clean save of step 3 (kind, path)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    state = make_state()
    ck = checkpointer(work, state)
    ck.restore()
    set_step(state, STEP)
    ops = FileOps(work, record=False)
    with ops.active():
        ck.save(STEP)
    ck.close()
    return ops.calls


def injected(size: str, broken: str | None = None) -> dict[str, Any]:
    cfg = SIZES[size]
    t0 = time.perf_counter()
    trials = failures = not_reached = 0
    outcomes: dict[str, int] = {}
    left_bytes = left_trials = committed_after_failure = 0
    examples: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="ioerrors-") as tmp:
        base, work = os.path.join(tmp, "base"), os.path.join(tmp, "work")
        _base(base)
        calls = count_calls(base, work)
        kinds: dict[str, int] = {}
        for kind, _ in calls:
            kinds[kind] = kinds.get(kind, 0) + 1
        for name in cfg["errnos"]:
            for mode in cfg["modes"]:
                indices = set(range(0, len(calls), cfg["stride"])) if cfg["stride"] else set()
                indices |= {i for i, (kind, _) in enumerate(calls) if kind == "fsync"}
                for at in sorted(indices):
                    fault = Fault(ERRNOS[name], at, sticky=mode == "sticky")
                    verdict = trial(base, work, fault, broken)
                    if not verdict["injected"]:
                        not_reached += 1
                        continue
                    trials += 1
                    outcomes[verdict["outcome"]] = outcomes.get(verdict["outcome"], 0) + 1
                    if verdict["outcome"] != "returned" and verdict["committed"]:
                        committed_after_failure += 1
                    if verdict["left_dirs"]:
                        left_trials += 1
                        left_bytes += verdict["left_bytes"]
                    if verdict["problems"]:
                        failures += 1
                        if len(examples) < 5:
                            call = calls[at] if at < len(calls) else ("?", "?")
                            examples.append(
                                {
                                    "errno": name,
                                    "mode": mode,
                                    "call": at,
                                    "at": f"{call[0]} {call[1]}",
                                    "problems": verdict["problems"],
                                }
                            )
    return {
        "trials": trials,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "calls_per_save": len(calls),
            "call_kinds": kinds,
            "errnos": list(cfg["errnos"]),
            "modes": list(cfg["modes"]),
            "calls_tried": "every call"
            if cfg["stride"] == 1
            else f"every fsync, and every {cfg['stride']}th call"
            if cfg["stride"]
            else "every fsync",
            "outcomes": outcomes,
            "failed_but_committed_whole": committed_after_failure,
            "trials_leaving_files": left_trials,
            "bytes_left_behind": left_bytes,
            "not_reached": not_reached,
            "examples": examples,
        },
    }


def _unmount(mnt: str) -> None:
    """Unmount the campaign's tmpfs and remove its mount point. A persist worker that
    has not quite exited can keep it busy for a moment (a fresh-clone CI run once met
    EBUSY here): retried for up to 5 s, then detached lazily, so that it goes once free."""
    for _ in range(50):
        if subprocess.run(["umount", mnt], capture_output=True, check=False).returncode == 0:
            break
        time.sleep(0.1)
    else:
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    os.rmdir(mnt)


def full_disk(mb: int = 8) -> dict[str, Any]:
    """Save into a real ``mb`` MiB tmpfs until it is full (root only)."""
    t0 = time.perf_counter()
    mnt = tempfile.mkdtemp(prefix="fulldisk-")
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
    saves = failed = 0
    last_ok = 0
    left: dict[str, int] = {}
    try:
        root = os.path.join(mnt, "root")
        state = make_state(400)  # 640 KiB a checkpoint
        ck = checkpointer(root, state, keep=None)
        logging.getLogger("resumable").setLevel(logging.CRITICAL)
        step = 0
        while failed < 3 and step < 100:
            step += 1
            set_step(state, step)
            saves += 1
            try:
                ck.save(step)
                last_ok = step
            except StorageError as exc:
                failed += 1
                if exc.errno != errno.ENOSPC:
                    problems.append(f"step {step}: StorageError with errno {exc.errno}")
            except BaseException as exc:
                failed += 1
                problems.append(f"step {step}: unclean {type(exc).__name__}: {exc}")
            left.update(_leftovers(root))
        ck.close()
        storage = local(root)
        listed = list_committed(storage)
        for s in listed:
            try:
                CheckpointReader(storage, s).verify()
            except CheckpointError as exc:
                problems.append(f"torn: step {s}: {exc}")
        if not listed or max(listed) != last_ok:
            problems.append(f"newest listed {listed[-1:]} is not the last saved {last_ok}")
        ck2 = checkpointer(root, make_state(400), keep=None)
        got = ck2.restore()
        ck2.close()
        if got != last_ok:
            problems.append(f"restore came back at {got}, not {last_ok}")
        used = shutil.disk_usage(mnt).used
    finally:
        logging.getLogger("resumable").setLevel(logging.NOTSET)
        _unmount(mnt)
    return {
        "saves": saves,
        "failed_saves": failed,
        "committed": last_ok,
        "staging_left_behind": left,
        "disk_used_bytes_at_end": used,
        "problems": problems,
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
    """The checks run on each broken save path (EIO once at each fsync)."""
    out = {}
    for kind in BROKEN:
        r = injected("fsyncs", broken=kind)
        out[kind] = {"trials": r["trials"], "failures": r["failures"]}
    return out
