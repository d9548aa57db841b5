"""The README's complete training loop, run as a user would copy it: SIGKILLed part-way
and relaunched, it ends bit-identical to an uninterrupted run, and relaunching the
finished run changes nothing. The block is taken from README.md itself, so the README
cannot drift from code that works."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import resumable

REPO = Path(__file__).resolve().parents[1]
SRC = Path(resumable.__file__).resolve().parents[1]
DATA_FILE = "rank-00000.safetensors"
# Global random streams the script never seeds nor uses: they differ from launch to launch.
UNSEEDED = ("__rng__/numpy", "__rng__/python", "__rng__/random")

# Runs the README block with two test-only additions: slots in the test's own
# shared-memory directory, and a SIGKILL right after maybe_save(KILL_AT) returns.
RUNNER = """
import os, runpy, signal, sys
import resumable

script, root, shm_dir, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
init, maybe_save = resumable.Checkpointer.__init__, resumable.Checkpointer.maybe_save

def patched_init(self, *args, **kwargs):
    kwargs.setdefault("shm_dir", shm_dir)
    init(self, *args, **kwargs)

def patched_maybe_save(self, step, *args, **kwargs):
    due = maybe_save(self, step, *args, **kwargs)
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return due

resumable.Checkpointer.__init__ = patched_init
resumable.Checkpointer.maybe_save = patched_maybe_save
sys.argv = [script, root]
runpy.run_path(script, run_name="__main__")
"""


def readme_loop() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## A complete training loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md lost its complete training loop"
    return match.group(1)


def launch(tmp_path: Path, root: Path, kill_at: int = -1) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(readme_loop())
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), str(root), str(shm), str(kill_at)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        cwd=tmp_path,
    )


def final_tensors(root: Path) -> dict[str, torch.Tensor]:
    steps = sorted(p for p in root.glob("step-*") if (p / "manifest.json").exists())
    assert steps and steps[-1].name == "step-000000000300", [p.name for p in steps]
    return load_file(str(steps[-1] / DATA_FILE))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_readme_loop_killed_and_relaunched_ends_bit_identical(tmp_path: Path) -> None:
    reference = launch(tmp_path, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = launch(tmp_path, tmp_path / "run", kill_at=130)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "run" / "step-000000000300").exists()
    resumed = launch(tmp_path, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    last = reference.stdout.strip().splitlines()[-1]
    assert last.startswith("step 300, epochs 9, loss ")
    assert resumed.stdout.strip().splitlines()[-1] == last
    want, got = final_tensors(tmp_path / "reference"), final_tensors(tmp_path / "run")
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        if name.startswith(UNSEEDED):
            continue
        assert torch.equal(bits(tensor), bits(got[name])), name

    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    again = launch(tmp_path, tmp_path / "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == last
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
