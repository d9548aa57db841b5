"""One object per node under real ``torchrun`` launchers: two simulated nodes
(``--nnodes=2 --node-rank=K`` on 127.0.0.1) of two ranks each, DDP on gloo,
``node_objects=True``, each node staging in a directory of its own
(``RESUMABLE_NODE_STAGING``), in both persist modes: the persist workers meeting in the
coordination store (``auto``: `StoreCoordinator.gather_to`) and the training threads
meeting over gloo (``sync``: `Group.gather_to`).

A run to step 6 commits checkpoints that hold their manifest (format version 6) and one
object per node, nothing else, that verify, and leaves nothing staged; a relaunch on the
same root restores step 6 on every rank and ends bit-identical to a run never
interrupted. A rank of node 1 SIGKILLed mid-run, after a commit: the relaunch resumes
from the newest committed step (with ``persist="sync"``; in the background modes the
memory tier may hold a newer snapshot of every rank) and ends identical too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stress.nodes import free_port, kill_node

from launch import start
from resumable.commit import list_committed, step_dir
from resumable.format import MANIFEST
from resumable.reader import CheckpointReader
from resumable.storage import open_storage
from test_replicas_job import finish

JOB = Path(__file__).with_name("node_objects_job.py")
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS, FIRST = 10, 6  # the relaunched runs train to STEPS; the first run stops at FIRST
GATE = 4  # the killed run: after step GATE every rank waits for a commit, then slows down
OBJECTS = {"node-00000.bin", "node-00002.bin"}  # one per node, named after its leader


def launch(
    port: int, root: Path, stage: list[Path], out: Path, steps: int, mode: str, gate: int = 0
) -> list[subprocess.Popen[str]]:
    out.mkdir(exist_ok=True)
    return [
        start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={NODES}",
                f"--node-rank={k}",
                f"--nproc-per-node={PER_NODE}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(JOB),
                str(root),
                str(out),
                str(steps),
                mode,
                str(gate),
            ],
            {"RESUMABLE_NODE_STAGING": str(stage[k])},
        )
        for k in range(NODES)
    ]


def results(out: Path, what: str) -> list[dict[str, object]]:
    return [json.loads((out / f"{what}-r{r}.json").read_text()) for r in range(WORLD)]


def staged(stage: list[Path]) -> list[Path]:
    return [p for s in stage for p in s.rglob("*") if p.is_file()]


def check_committed(root: Path) -> list[int]:
    """Every committed step of ``root`` holds its manifest (version 6) and one object
    per node, each node's ranks in their node's object, and verifies. Its steps."""
    storage = open_storage(str(root))
    steps = list_committed(storage)
    assert steps
    for step in steps:
        d = root / step_dir(step)
        assert {p.name for p in d.iterdir()} == {MANIFEST, *OBJECTS}, step
        top = json.loads((d / MANIFEST).read_text())
        assert top["format_version"] == 7
        assert set(top["objects"]) == OBJECTS
        for r in range(WORLD):
            leader = r - r % PER_NODE
            for name in (f"rank-{r:05d}.safetensors", f"part-{r:05d}.json.gz"):
                assert top["segments"][name]["object"] == f"node-{leader:05d}.bin", name
        assert CheckpointReader(storage, step).verify() > 0
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The final digest of each rank of a run from scratch to STEPS, never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    stage = [tmp / f"stage-{k}" for k in range(NODES)]
    finish(launch(free_port(), tmp / "root", stage, tmp / "out", STEPS, "auto"))
    finals = results(tmp / "out", "final")
    assert [f["restored"] for f in finals] == [0] * WORLD
    return [str(f["digest"]) for f in finals]


@pytest.mark.parametrize("mode", ["auto", "sync"])
def test_a_torchrun_job_on_two_nodes_writes_one_object_per_node(
    tmp_path: Path, reference: list[str], mode: str
) -> None:
    root = tmp_path / "root"
    stage = [tmp_path / f"stage-{k}" for k in range(NODES)]
    output = finish(launch(free_port(), root, stage, tmp_path / "out1", FIRST, mode))
    steps = check_committed(root)
    assert steps[-1] == FIRST, output[-6000:]
    assert len(steps) <= 2  # Keep(last=2) removed the older ones, objects and all
    assert not staged(stage), output[-3000:]

    output = finish(launch(free_port(), root, stage, tmp_path / "out2", STEPS, mode))
    assert [r["step"] for r in results(tmp_path / "out2", "restored")] == [FIRST] * WORLD
    assert [f["digest"] for f in results(tmp_path / "out2", "final")] == reference
    assert check_committed(root)[-1] == STEPS
    assert not staged(stage), output[-3000:]


@pytest.mark.parametrize("mode", ["auto"])  # the persist workers' path; sync writes above
def test_a_rank_killed_on_node_one_resumes_from_the_last_commit(
    tmp_path: Path, reference: list[str], mode: str
) -> None:
    root, out = tmp_path / "root", tmp_path / "out1"
    stage = [tmp_path / f"stage-{k}" for k in range(NODES)]
    victim = WORLD - 1  # node 1's second rank
    procs = launch(free_port(), root, stage, out, STEPS, mode, GATE)
    committed = False
    try:
        storage = open_storage(str(root))
        deadline = time.monotonic() + 180
        while not any(p.poll() is not None for p in procs) and time.monotonic() < deadline:
            if root.exists() and list_committed(storage):
                committed = True
                os.kill(int((out / f"pid-r{victim}").read_text()), signal.SIGKILL)
                break
            time.sleep(0.05)
        # node 1's launcher ends its other rank and fails; node 0's ranks may wait on
        # their peers: both launchers are killed after a while
        ends = time.monotonic() + 20
        while committed and any(p.poll() is None for p in procs) and time.monotonic() < ends:
            time.sleep(0.1)
    finally:
        output = "\n".join(kill_node(p) for p in procs)
    assert committed, f"no commit, or a launcher ended first:\n{output[-6000:]}"
    assert not (out / f"final-r{victim}.json").exists(), "the job ended before the kill"
    last = check_committed(root)[-1]
    assert last < STEPS

    out2 = tmp_path / "out2"
    output = finish(launch(free_port(), root, stage, out2, STEPS, mode))
    restored = [int(str(r["step"])) for r in results(out2, "restored")]
    assert len(set(restored)) == 1, restored
    if mode == "sync":
        assert restored[0] == last, output[-6000:]
    else:  # the memory tier's snapshots may hold a step newer than the last commit
        assert last <= restored[0] < STEPS, output[-6000:]
    assert [f["digest"] for f in results(out2, "final")] == reference
    assert check_committed(root)[-1] == STEPS
