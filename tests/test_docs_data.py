"""docs/data.md's usage block, run as a user would copy it: the names it leaves to the
reader (``dataset``, ``model``, ``optim``, ``train_step``, ``end_of_epoch``,
``num_epochs``) are defined in a few lines before it, and everything else is the block
as the page prints it. SIGKILLed inside a training step and relaunched, it goes on from
its checkpoint (the default policy persists every 100 steps) on exactly the batches an
uninterrupted run trains from there: the kill costs the steps since the checkpoint,
and nothing else changes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import resumable

REPO = Path(__file__).resolve().parents[1]
SRC = Path(resumable.__file__).resolve().parents[1]

# What the block leaves to the reader; `train_step` records each batch's sample ids and,
# when asked, SIGKILLs the process in the middle of a step. The Checkpointer's slots go
# to the test's own shared-memory directory.
PREAMBLE = """
import json, os, signal, sys
import torch
import resumable

_init = resumable.Checkpointer.__init__
def _init_with_shm_dir(self, *args, **kwargs):
    kwargs.setdefault("shm_dir", os.environ["DOC_SHM_DIR"])
    _init(self, *args, **kwargs)
resumable.Checkpointer.__init__ = _init_with_shm_dir

torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.arange(1600), torch.randn(1600, 4))
model = torch.nn.Linear(4, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.01)
num_epochs = 3
_log = open(os.environ["DOC_LOG"], "a")
_kill_at = int(os.environ.get("DOC_KILL_AT", "-1"))
_steps = 0

def train_step(batch):
    global _steps
    if _steps == _kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    ids, x = batch
    optim.zero_grad()
    model(x).pow(2).mean().backward()
    optim.step()
    _log.write(json.dumps({"batch": ids.tolist()}) + "\\n")
    _log.flush()
    _steps += 1

def end_of_epoch(epoch):
    _log.write(json.dumps({"epoch": epoch}) + "\\n")
    _log.flush()
"""


def usage_block() -> str:
    text = (REPO / "docs" / "data.md").read_text()
    section = text[text.index("## Usage") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/data.md lost its usage block"
    return match.group(1)


def launch(tmp_path: Path, name: str, kill_at: int = -1) -> list[dict[str, object]]:
    script = tmp_path / "train.py"
    script.write_text(PREAMBLE + usage_block())
    log, shm = tmp_path / f"{name}.jsonl", tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "DOC_LOG": str(log),
        "DOC_SHM_DIR": str(shm),
        "DOC_KILL_AT": str(kill_at),
    }
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=run,  # the block's "runs/exp1" lands under it
    )
    want = -signal.SIGKILL if kill_at >= 0 else 0
    assert done.returncode == want, done.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_data_usage_block_runs_and_resumes_on_the_batches_that_were_left(
    tmp_path: Path,
) -> None:
    reference = launch(tmp_path, "reference")
    batches = [e["batch"] for e in reference if "batch" in e]
    assert [e["epoch"] for e in reference if "epoch" in e] == [0, 1, 2]
    assert len(batches) == 3 * 50  # 1600 samples in batches of 32

    first = launch(tmp_path, "killed", kill_at=120)  # in the third epoch; persisted at 100
    assert [e["batch"] for e in first if "batch" in e] == batches[:120]
    assert [e["epoch"] for e in first if "epoch" in e] == [0, 1]
    both = launch(tmp_path, "killed")  # the same log, appended to by the relaunch
    assert both[: len(first)] == first
    again = both[len(first) :]
    assert [e["batch"] for e in again if "batch" in e] == batches[100:]
    # Step 100 was the last batch of epoch 1, saved before end_of_epoch(1) ran: the
    # relaunch finds that epoch's rest empty and ends it again, as the kill undid it.
    assert [e["epoch"] for e in again if "epoch" in e] == [1, 2]
