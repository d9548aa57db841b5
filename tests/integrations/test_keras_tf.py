"""`ResumableCallback` on Keras' TensorFlow backend: ``examples/integrations/keras_mlp.py``
run with ``KERAS_BACKEND=tensorflow``, killed and relaunched, ends bit-identical to a run
never stopped.

TensorFlow is not in the dev environment (its install pulls its own NumPy and protobuf):
``make test-tf`` makes ``.venv-tf`` with ``tensorflow-cpu`` and runs this file there. In any
environment without TensorFlow the tests skip.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import resumable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "keras_mlp.py"
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT / "src"),
    "KERAS_BACKEND": "tensorflow",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow (make test-tf)"
)


def example(directory: Path, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--dir", str(directory), "--epochs", "3", *extra]


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def run_to_end(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def run_until(cmd: list[str], step: int, sig: signal.Signals) -> int:
    """Start the job, send ``sig`` once it printed ``step <step>``; returns the exit code."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= step:
                proc.send_signal(sig)
                break
        proc.stdout.read()
    finally:
        proc.stdout.close()
        rc = proc.wait(timeout=120)
    return rc


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    line = run_to_end(example(tmp_path_factory.mktemp("tf-ref")))
    assert line.startswith("final step=36 params_sha256=")
    return line


def test_sigkilled_after_an_epoch_end_resumes_bit_identical(tmp_path: Path, reference: str) -> None:
    """Epoch-end checkpoints (``save_freq="epoch"``): SIGKILLed late in epoch 1 and in epoch
    2, each relaunch resumes at the newest committed epoch end; the last ends bit-identical."""
    cmd = example(tmp_path, "--step-time", "0.05")
    for at in (22, 33):
        assert run_until(cmd, at, signal.SIGKILL) in (-signal.SIGKILL, 0)
    assert run_to_end(cmd) == reference


MID_EPOCH = pytest.mark.xfail(
    strict=True,
    reason="mid-epoch resume on TensorFlow is not exact yet: the loader position is counted "
    "from trained batches and the step count is put back, but the weights still differ "
    "(docs/integrations.md, Keras on TensorFlow)",
)


@MID_EPOCH
def test_sigterm_then_sigkill_end_bit_identical(tmp_path: Path, reference: str) -> None:
    """SIGTERM: an emergency checkpoint mid epoch 0 and exit code 75; the relaunch is
    SIGKILLed at a later step (memory snapshots every step); the last relaunch ends with
    the variables of a run never stopped."""
    cmd = example(tmp_path, "--preempt", "--memory-every", "1", "--step-time", "0.05",
                  "--save-freq", "1000")  # fmt: skip
    assert run_until(cmd, 7, signal.SIGTERM) == resumable.REQUEUE_EXIT_CODE
    committed = steps_in(tmp_path)
    assert len(committed) == 1 and 7 <= committed[0] < 12
    rc = run_until(cmd, random.Random(13).randint(committed[0] + 2, 33), signal.SIGKILL)
    assert rc in (-signal.SIGKILL, 0)
    assert run_to_end(cmd) == reference


@MID_EPOCH
def test_sigkilled_between_persists_ends_bit_identical(tmp_path: Path, reference: str) -> None:
    """Persisted every 5 batches, no memory tier: SIGKILLed twice (mid epoch 0 and across
    the epoch 1 boundary), each relaunch resumes from the newest commit on disk."""
    cmd = example(tmp_path, "--save-freq", "5", "--step-time", "0.05")
    for at in (8, 23):
        assert run_until(cmd, at, signal.SIGKILL) in (-signal.SIGKILL, 0)
        assert steps_in(tmp_path)
    assert run_to_end(cmd) == reference
