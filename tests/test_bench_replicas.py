"""`benchmarks/replicas_bench.py` end to end, small: two simulated nodes of one rank
each under real ``torchrun`` launchers, one repeat, a 256 KiB model, one warm-up step and two
timed steps, a stop at step 3 with a persist every 2 (one step lost from the disk), no S3.
The benchmark's six launches of both nodes are its cost (each interpreter imports torch:
one rank per node starts four, not six); the smallest sizes that still tell every checked
field apart are used (`make bench` runs it at its full defaults: two ranks per node).

Structural checks only (no timings): the results file is written with the table; a
replaced node resumes at the stop step from its peers at ``replicas=2`` and at the
newest commit at ``replicas=1``; replication sends bytes at ``replicas=2`` and none at
``replicas=1``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "replicas_bench.py"
STOP, PERSIST_EVERY, STEPS = 3, 2, 2


def test_the_replicas_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(BENCH),
        "--per-node=1",
        "--param-mib=0.25",
        "--repeats=1",
        "--warmup=1",
        f"--steps={STEPS}",
        f"--stop={STOP}",
        f"--persist-every={PERSIST_EVERY}",
        "--no-s3",
        f"--results-dir={tmp_path}",
    ]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert got.returncode == 0, (got.stdout + got.stderr)[-6000:]
    (path,) = tmp_path.glob("replicas-*.json")
    results = json.loads(path.read_text())
    assert results["table"] in got.stdout
    world = 2

    tp = results["throughput_runs"]
    (one,), (two,) = tp["replicas=1"], tp["replicas=2"]
    assert one["bytes_sent"] == 0 and one["pushes"] == 0
    assert two["bytes_sent"] > 0
    assert two["pushes"] == world * STEPS  # every timed step's snapshot, from every rank
    assert two["failures"] == 0
    assert len(one["job_step_s"]) == len(two["job_step_s"]) == STEPS

    (peers,) = results["recovery_runs"]["peers"]
    assert peers["restored"] == [STOP] * world
    assert peers["steps_lost"] == 0
    assert peers["fetches"] == [0, 1]  # node 1's rank fetched its snapshot from node 0
    assert "from peers' replicas" in peers["restore_line"]

    (disk,) = results["recovery_runs"]["disk"]
    assert disk["last_commit"] == PERSIST_EVERY
    assert disk["restored"] == [disk["last_commit"]] * world
    assert disk["steps_lost"] == STOP - PERSIST_EVERY
    assert disk["fetches"] == [0] * world

    summary = results["summary"]
    assert summary["recovery"]["peers"]["steps_lost"] == 0
    assert summary["not_measured"]["s3"].startswith("not measured")
    assert "not measured: --no-s3" in results["table"]
