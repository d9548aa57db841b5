"""`ResumableCallback` on Keras' TensorFlow backend: ``examples/integrations/keras_mlp.py``
run with ``KERAS_BACKEND=tensorflow``, killed and relaunched, ends bit-identical to a run
never stopped.

TensorFlow is not in the dev environment (its install pulls its own NumPy and protobuf):
``make test-tf`` makes ``.venv-tf`` with ``tensorflow-cpu`` and runs this file there. In any
environment without TensorFlow the tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import resumable

from .jobs import Job, steps_in

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "keras_mlp.py"
JOB = Job(
    EXAMPLE, "--epochs", "3", env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
)
example = JOB.command
run_to_end = JOB.run_to_end
run_until = JOB.run_until

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow (make test-tf)"
)


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


EXHAUSTED_STEP = """
import json, numpy as np, keras, tensorflow as tf
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5),
                          keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse")
x, y = np.ones((2, 4), "float32"), np.ones((2, 1), "float32")
model.fit(x, y, verbose=0)
iterator = iter(tf.data.Dataset.from_tensors((x, y)))
model.train_function(iterator)
variables = [*model.variables, *model.optimizer.variables]
before = [v.numpy().copy() for v in variables]
try:
    model.train_function(iterator)
    raised = False
except tf.errors.OutOfRangeError:
    raised = True
changed = {v.path: (v.numpy() / b).ravel().tolist() if b.dtype.kind == "f"
           else (v.numpy() - b).ravel().tolist()
           for v, b in zip(variables, before) if not np.array_equal(v.numpy(), b)}
print(json.dumps({"raised": raised, "changed": changed}))
"""


def test_a_step_on_an_exhausted_input_still_changes_variables() -> None:
    """The cause `ResumableCallback._hold_variables` undoes: on TensorFlow, Keras' train
    step called on an exhausted input raises ``OutOfRangeError`` but still runs the ops
    that do not read the batch: ``iterations += 1``, AdamW's weight decay (every weight
    times ``1 - lr * wd`` = ``1 - 0.01 * 0.004``) and the dropout seed state ``+= [0, 1]``.
    If a Keras or TensorFlow release stops doing this, this test says so."""
    proc = subprocess.run([sys.executable, "-c", EXHAUSTED_STEP], capture_output=True,
                          text=True, timeout=120, check=False, env=JOB.env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"]
    changed = out["changed"]
    assert changed.pop("adam_w/iteration") == [1]
    assert changed.pop("seed_generator/seed_generator_state") == [0, 1]
    assert sorted(changed) == [f"sequential/{d}/{w}" for d in ("dense", "dense_1")
                               for w in ("bias", "kernel")]  # fmt: skip
    for ratios in changed.values():
        assert ratios == pytest.approx([1 - 0.01 * 0.004] * len(ratios), rel=1e-6)


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


def test_sigkilled_between_persists_ends_bit_identical(tmp_path: Path, reference: str) -> None:
    """Persisted every 5 batches, no memory tier: SIGKILLed twice (mid epoch 0 and across
    the epoch 1 boundary), each relaunch resumes from the newest commit on disk. Each kill
    waits for a commit newer than the one the run resumed from (the background persist of
    the first one also starts its worker, which can take longer than a few batches)."""
    cmd = example(tmp_path, "--save-freq", "5", "--step-time", "0.05")
    for at in (8, 23):
        before = steps_in(tmp_path)
        rc = run_until(cmd, at, signal.SIGKILL, ready=lambda b=before: steps_in(tmp_path) != b)
        assert rc in (-signal.SIGKILL, 0)
        assert steps_in(tmp_path) != before
    assert run_to_end(cmd) == reference
