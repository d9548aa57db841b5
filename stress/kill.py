"""Campaign 1, kill -9 at random moments: a job is killed anywhere (restoring, taking a
memory snapshot, persisting, committing, applying retention, uploading to its mirror)
and relaunched, over and over; every relaunch must come back at the newest committed
checkpoint or newer, with exactly the values saved at that step, and never start over.

The job runs in a process forked from this one (torch is imported once, here; a fork
costs milliseconds where a fresh interpreter costs seconds): a `Checkpointer` with both
tiers on (memory snapshots in shared memory every step, persists on a background thread,
``Keep(last=2)``) and a local mirror; it restores, checks the restored weights against
the ones that step saves (they depend only on the step), tells this process the step it
came back at, then saves one step after another until it is killed with ``SIGKILL`` at
a random moment (uniform over the first ``window_s`` seconds; a fifth of the kills land
in the first 50 ms, during start-up and restore). After each kill this process reads the
audit log for the steps whose commit was recorded, checks that every listed checkpoint
of the root and of the mirror verifies, and expects the next launch to restore at least
the newest committed step. Chains of ``kills_per_chain`` kills share a root; each chain
ends with a launch that is not killed and must leave no staging directory behind. Every
second chain writes its data files with ``O_DIRECT`` (as large files are written), so
that kills also land inside direct writes.
"""

from __future__ import annotations

import logging
import os
import random
import select
import shutil
import signal
import tempfile
import time
from typing import Any

import torch

from resumable import Every, Keep
from resumable.storage import direct
from stress.workload import (
    broken_commit,
    checkpointer,
    make_state,
    newest_commit,
    set_step,
    torn,
)

SIZES: dict[str, dict[str, Any]] = {
    "small": {"chains": 3, "kills_per_chain": 5, "window_s": 1.5},
    "full": {"chains": 100, "kills_per_chain": 10, "window_s": 1.5},
    # `make test`'s able-to-fail run: "small"'s launches, up to the first after which a
    # problem is found (`able_to_fail` runs them all)
    "caught": {"chains": 3, "kills_per_chain": 5, "window_s": 1.5, "until_caught": True},
}
SEED = 1
LAUNCH_TIMEOUT_S = 60.0


def _job(root: str, mirror: str, shm: str, out: int, steps: int | None, direct_all: bool) -> None:
    """The child: restore, report, then save until killed (or ``steps`` more). With
    ``direct_all``, every data file, however small, is written with O_DIRECT (this
    campaign's states are far below `direct.DIRECT_MIN_BYTES`)."""
    logging.getLogger("resumable").setLevel(logging.CRITICAL)
    if direct_all:
        direct.DIRECT_MIN_BYTES = 0
    state = make_state()
    ck = checkpointer(
        root,
        state,
        persist="thread",
        memory_every=Every(steps=1),
        keep=Keep(last=2),
        mirror=mirror,
        shm_dir=shm,
        on_busy="skip",
    )
    got = ck.restore()
    expected = make_state()
    set_step(expected, got)
    same = got == 0 or all(
        torch.equal(a, b)
        for a, b in zip(
            state["model"].state_dict().values(), expected["model"].state_dict().values()
        )
    )
    os.write(out, f"restored {got} {'ok' if same else 'mismatch'}\n".encode())
    step = got
    while steps is None or step < got + steps:
        step += 1
        set_step(state, step)
        ck.save(step)
    ck.close()


def _launch(
    root: str, mirror: str, shm: str, steps: int | None, direct_all: bool
) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns
        code = 0
        try:
            os.close(r)
            _job(root, mirror, shm, w, steps, direct_all)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _first_line(fd: int) -> str:
    ready, _, _ = select.select([fd], [], [], LAUNCH_TIMEOUT_S)
    if not ready:
        return ""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def run(size: str, *, commit: str | None = None) -> dict[str, Any]:
    """``commit="manifest-first"`` breaks the save path (the able-to-fail run)."""
    cfg = SIZES[size]
    rng = random.Random(SEED)
    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    t0 = time.perf_counter()
    problems: list[str] = []
    kills = launches = 0
    restored_from: dict[str, int] = {"start (nothing committed)": 0, "committed or newer": 0}
    early = 0
    with tempfile.TemporaryDirectory(prefix="kill-") as tmp, broken_commit(commit):
        shm = tempfile.mkdtemp(prefix="kill-", dir="/dev/shm")
        try:
            for chain in range(cfg["chains"]):
                root = os.path.join(tmp, f"chain{chain}", "root")
                mirror = os.path.join(tmp, f"chain{chain}", "mirror")
                want = 0
                for k in range(cfg["kills_per_chain"] + 1):
                    last = k == cfg["kills_per_chain"]
                    pid, fd = _launch(root, mirror, shm, 3 if last else None, chain % 2 == 1)
                    launches += 1
                    t_start = time.perf_counter()
                    early_kill = not last and rng.random() < 0.2
                    delay = (
                        rng.uniform(0.0, 0.05) if early_kill else rng.uniform(0.0, cfg["window_s"])
                    )
                    line = ""
                    if early_kill:
                        time.sleep(delay)
                        os.kill(pid, signal.SIGKILL)
                        early += 1
                    else:
                        line = _first_line(fd)
                        if not last:
                            time.sleep(max(0.0, delay - (time.perf_counter() - t_start)))
                            os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    os.close(fd)
                    if not last:
                        kills += 1
                    elif not os.WIFEXITED(status) or os.WEXITSTATUS(status):
                        problems.append(f"chain {chain}: the last launch failed ({status})")
                    if line:
                        _, got, verdict = line.split()
                        if verdict != "ok":
                            problems.append(f"chain {chain} launch {k}: restored values differ")
                        if int(got) < want:
                            problems.append(
                                f"chain {chain} launch {k}: restored step {got}, but step "
                                f"{want} was committed"
                            )
                        restored_from[
                            "start (nothing committed)" if not int(got) else "committed or newer"
                        ] += 1
                    elif not early_kill:
                        problems.append(
                            f"chain {chain} launch {k}: no restore within {LAUNCH_TIMEOUT_S}s"
                        )
                    if os.path.isdir(root):
                        want = max(want, newest_commit(root))
                        problems += torn(root)
                    if os.path.isdir(mirror):
                        problems += torn(mirror)
                    if problems and cfg.get("until_caught"):
                        break
                if problems and cfg.get("until_caught"):
                    break
                leftovers = [n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-"))]
                if leftovers:
                    problems.append(f"chain {chain}: {leftovers} left after a clean launch")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    return {
        "trials": kills,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "chains": cfg["chains"],
            "kills_per_chain": cfg["kills_per_chain"],
            "launches": launches,
            "kills_in_first_50ms": early,
            "kill_window_s": cfg["window_s"],
            "chains_written_with_o_direct": cfg["chains"] // 2,
            "restores": restored_from,
            "problems": problems[:10],
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The campaign on a save path that writes the manifest before the data."""
    r = run("small", commit="manifest-first")
    return {"manifest written first": {"trials": r["trials"], "failures": r["failures"]}}
