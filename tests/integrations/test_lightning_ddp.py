"""`ResumableCheckpoint` under Lightning's ``strategy="ddp"``: two CPU ranks (gloo)
launched by ``torchrun``; the job is `lightning_ddp_job`.

A run interrupted on both ranks (an exception at the same step) and relaunched with
``ckpt_path="last"`` ends, on each rank, with the parameters and optimizer state of an
uninterrupted two-rank run, after reading the same samples from the restored step on.
Each launch takes ~40 s on a 2-core machine (Lightning's import and DDP setup), so the
campaign is ``slow`` (``make campaign``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

JOB = Path(__file__).with_name("lightning_ddp_job.py")
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300.0

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed gloo",
    ),
    pytest.mark.slow,
    pytest.mark.timeout(1800),
]


def launch(
    root: Path, out: Path, crash_at: int | None = None, preempt_at: int | None = None
) -> list[dict[str, Any]]:
    """Both ranks' reports of one ``torchrun --nproc-per-node=2`` launch of the job."""
    out.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(JOB), str(root), str(out), *([str(crash_at)] if crash_at else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    if preempt_at is not None:
        env["PREEMPT_AT"] = str(preempt_at)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: our own session
        output, _ = proc.communicate()
        pytest.fail(f"the launch ran over {LAUNCH_TIMEOUT_S} s:\n{output[-4000:]}")
    reports = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in reports), f"rc {proc.returncode}:\n{output[-6000:]}"
    return [json.loads(p.read_text()) for p in reports]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp-ref")
    ranks = launch(tmp / "root", tmp / "out")
    assert [r["error"] for r in ranks] == [None, None]
    assert [r["global_step"] for r in ranks] == [18, 18]
    ids = [set(i for _, _, batch in r["seen"][:6] for i in batch) for r in ranks]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 48  # an epoch, split by rank
    assert ranks[0]["digest"] == ranks[1]["digest"]  # DDP keeps the replicas equal
    return ranks


@pytest.mark.parametrize("crash_at, resumed_from", [(7, 6), (11, 10)])
def test_an_interrupted_ddp_fit_resumes_bit_identical_on_both_ranks(
    tmp_path: Path, reference: list[dict[str, Any]], crash_at: int, resumed_from: int
) -> None:
    """Resumed at an epoch boundary (step 6: 6 batches per rank and epoch) and mid-epoch
    (step 10); the crash callback runs before ours, so the newest checkpoint is the step
    before the crash."""
    crashed = launch(tmp_path / "root", tmp_path / "crashed", crash_at)
    assert all("crash at step" in (r["error"] or "") for r in crashed)
    resumed = launch(tmp_path / "root", tmp_path / "resumed")
    for ref, run in zip(reference, resumed, strict=True):
        assert run["error"] is None
        assert run["restored_step"] == resumed_from
        assert run["seen"] == [s for s in ref["seen"] if s[1] >= resumed_from]
        assert run["digest"] == ref["digest"]


def test_sigterm_to_one_rank_checkpoints_both_and_resumes_bit_identical(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    """SIGTERM to rank 0 alone, after every hook of step 8 (where Lightning's own handler
    used to end fit with exit code 0): both ranks agree, checkpoint step 9 together and
    exit with the requeue code; the relaunch (no preemption) ends bit-identical."""
    root = tmp_path / "root"
    preempted = launch(root, tmp_path / "preempted", preempt_at=8)
    assert [r["exit_code"] for r in preempted] == [75, 75]
    assert [r["global_step"] for r in preempted] == [9, 9]
    assert sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) == [9]
    resumed = launch(root, tmp_path / "resumed")
    for ref, run in zip(reference, resumed, strict=True):
        assert run["error"] is None and run["exit_code"] is None
        assert run["restored_step"] == 9
        assert run["seen"] == [s for s in ref["seen"] if s[1] >= 9]
        assert run["digest"] == ref["digest"]
