"""Campaign 1d, a node lost: two simulated nodes under real ``torchrun --nnodes=2``
launchers on 127.0.0.1, one rank each, each node with its own shared-memory directory,
``replicas=2``, a memory snapshot every step and a persist every
`stress.nodekill_job.PERSIST_EVERY` steps.

At a random moment (uniform over ``window_s`` seconds after both ranks restored) both
nodes are SIGKILLed, each launcher with every process under it (a job restart), and
one of them, at random, loses its memory directory (a replaced machine). Before the
relaunch this process reads each rank's newest snapshotted step (``progress``, written
after each snapshot) and the newest committed step. The relaunch must restore on both
ranks one step, with exactly the values that step saved (the job checks them and exits
3 otherwise), no older than one snapshot before the newest step every rank had
snapshotted: the lost node's rank fetches its snapshot from its peer's replica, which
is at most one snapshot behind. The figures say how many steps each kill cost, and how
many the same kill would have cost without replicas (back to the newest commit).

``able_to_fail``: the same kills with ``replicas=1`` (no copy on the other node): the
checks must catch the steps lost.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from resumable.commit import list_committed
from resumable.errors import CheckpointError
from resumable.storage import LocalStorage
from stress.nodes import free_port, kill_node

HERE = Path(__file__).resolve().parent
JOB = HERE / "nodekill_job.py"
SIZES: dict[str, dict[str, Any]] = {
    "small": {"chains": 1, "kills_per_chain": 2, "window_s": 2.0},
    "full": {"chains": 4, "kills_per_chain": 8, "window_s": 3.0},
    "broken": {"chains": 1, "kills_per_chain": 3, "window_s": 3.0},
}
SEED = 4
START_TIMEOUT_S = 120.0


def _launch(root: Path, shm: list[Path], out: Path, replicas: int) -> list[subprocess.Popen[str]]:
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE.parent)]),
    }
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={k}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(JOB),
                str(root),
                str(shm[k]),
                str(out),
                str(replicas),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for k in range(2)
    ]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _campaign(size: str, replicas: int) -> dict[str, Any]:
    cfg = SIZES[size]
    rng = random.Random(SEED)
    t0 = time.perf_counter()
    problems: list[str] = []
    lost: list[int] = []  # steps each kill cost (from the newest step every rank held)
    without: list[int] = []  # what it would have cost going back to the newest commit
    from_peers = kills = 0
    victims = {"node 0": 0, "node 1": 0}
    with tempfile.TemporaryDirectory(prefix="resumable-nodekill-") as tmp:
        base = Path(tmp)
        shm_base = Path(tempfile.mkdtemp(prefix="resumable-nodekill-", dir="/dev/shm"))
        try:
            for chain in range(cfg["chains"]):
                root, out = base / f"c{chain}" / "ck", base / f"c{chain}" / "out"
                out.mkdir(parents=True)
                shm = [shm_base / f"c{chain}-node{k}" for k in range(2)]
                for d in shm:
                    d.mkdir()
                expect: tuple[int, int] | None = None  # (newest common step, commit)
                for _ in range(cfg["kills_per_chain"]):
                    procs = _launch(root, shm, out, replicas)
                    outputs = ["", ""]
                    try:
                        deadline = time.monotonic() + START_TIMEOUT_S
                        while time.monotonic() < deadline:
                            if all((out / f"restored-r{r}").exists() for r in range(2)):
                                break
                            if any(p.poll() is not None for p in procs):
                                break
                            time.sleep(0.05)
                        ended = [p.poll() is not None for p in procs]
                        started = all((out / f"restored-r{r}").exists() for r in range(2))
                        if started and not any(ended):
                            time.sleep(rng.uniform(0.2, cfg["window_s"]))
                            ended = [p.poll() is not None for p in procs]
                    finally:
                        for k, p in enumerate(procs):
                            outputs[k] = kill_node(p)
                    restored = [_read_int(out / f"restored-r{r}") for r in range(2)]
                    if not started or any(ended):
                        problems.append(
                            f"chain {chain}: a launch did not restore or ended by itself "
                            f"(restored {restored}): " + " | ".join(o[-1500:] for o in outputs)
                        )
                        break
                    kills += 1
                    if expect is not None:
                        common, committed = expect
                        r0 = restored[0]
                        if restored[0] != restored[1] or r0 is None:
                            problems.append(f"chain {chain}: the ranks restored {restored}")
                        elif r0 < common - 1:
                            problems.append(
                                f"chain {chain}: restored step {r0}, but every rank held step "
                                f"{common} and a replica is at most one snapshot behind"
                                f" (newest commit {committed})"
                            )
                        if r0 is not None:
                            lost.append(max(0, common - r0))
                            without.append(max(0, common - committed))
                        if "from peers' replicas" in outputs[0] + outputs[1]:
                            from_peers += 1
                    progress = [_read_int(out / f"progress-r{r}") for r in range(2)]
                    try:
                        committed = max(list_committed(LocalStorage(str(root))), default=0)
                    except CheckpointError:
                        committed = 0
                    common = min((p for p in progress if p is not None), default=0)
                    expect = (common, committed)
                    victim = rng.randrange(2)
                    victims[f"node {victim}"] += 1
                    shutil.rmtree(shm[victim], ignore_errors=True)
                    shm[victim].mkdir()
                    for f in out.iterdir():
                        f.unlink()
                # the last kill's relaunch: checked, then ended
                if expect is not None and not problems:
                    procs = _launch(root, shm, out, replicas)
                    deadline = time.monotonic() + START_TIMEOUT_S
                    while time.monotonic() < deadline and not all(
                        (out / f"restored-r{r}").exists() for r in range(2)
                    ):
                        if any(p.poll() is not None for p in procs):
                            break
                        time.sleep(0.05)
                    outputs = [kill_node(p) for p in procs]
                    restored = [_read_int(out / f"restored-r{r}") for r in range(2)]
                    common, committed = expect
                    if restored[0] is None or restored[0] != restored[1]:
                        problems.append(f"chain {chain}: the last relaunch restored {restored}")
                    else:
                        if restored[0] < common - 1:
                            problems.append(
                                f"chain {chain}: restored step {restored[0]}, but every rank "
                                f"held step {common} (newest commit {committed})"
                            )
                        lost.append(max(0, common - restored[0]))
                        without.append(max(0, common - committed))
                        if "from peers' replicas" in outputs[0] + outputs[1]:
                            from_peers += 1
        finally:
            shutil.rmtree(shm_base, ignore_errors=True)
    return {
        "trials": kills,
        "failures": len(problems),
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "replicas": replicas,
            "node_losses": len(lost),
            "victims": victims,
            "restored_with_peers_replicas": from_peers,
            "steps_lost": {
                "max": max(lost, default=0),
                "median": median(lost) if lost else 0,
                "zero": sum(1 for x in lost if x == 0),
                "one": sum(1 for x in lost if x == 1),
            },
            "steps_lost_without_replicas": {
                "max": max(without, default=0),
                "median": median(without) if without else 0,
            },
            "problems": problems[:10],
        },
    }


def run(size: str) -> dict[str, Any]:
    return _campaign(size, replicas=2)


def able_to_fail() -> dict[str, Any]:
    r = _campaign("broken", replicas=1)
    return {"no replicas (replicas=1)": {"trials": r["trials"], "failures": r["failures"]}}
