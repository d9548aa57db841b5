"""The persist worker process imports only what the trainer trusts: not the modules in
the directory a job was launched from, whatever their names, while ``resumable`` and
its dependencies found only through ``PYTHONPATH`` still import.

Each case runs a real trainer (a script in its own directory) from a launch directory
that holds hostile modules named after ones the worker imports; each writes a marker
file when imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import resumable

SRC = Path(resumable.__file__).resolve().parents[1]
TORCH_SITE = Path(torch.__file__).resolve().parents[1]
# Modules the worker imports after it starts (none is loaded by the interpreter's
# start-up), so a copy in the launch directory would shadow the real one.
HOSTILE = ("signal", "json", "argparse", "socket", "struct", "select", "xxhash", "resumable")

TRAINER = """
import json, sys
import torch
import resumable

state = {"w": torch.arange(8.0)}
with resumable.Checkpointer(sys.argv[1], state, persist="process", shm_dir=sys.argv[2]) as ck:
    ck.save(1)
    ck.wait()
    steps = ck.steps()
print(json.dumps({"steps": steps, "mode": ck.persist_mode}))
"""


def plant_hostile_modules(directory: Path) -> None:
    for name in HOSTILE:
        target = directory / name if name == "resumable" else directory
        target.mkdir(exist_ok=True)
        module = target / ("__init__.py" if name == "resumable" else f"{name}.py")
        marker = directory / f"{name}.imported"
        module.write_text(f"open({str(marker)!r}, 'w').close()\n")


def run_trainer(tmp_path: Path, python: str, env: dict[str, str]) -> dict[str, object]:
    launch = tmp_path / "launch"
    launch.mkdir()
    plant_hostile_modules(launch)
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(textwrap.dedent(TRAINER))
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.run(
        [python, str(job / "train.py"), str(tmp_path / "ckpt"), str(shm)],
        cwd=launch,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = sorted(p.stem for p in launch.glob("*.imported"))
    assert imported == [], f"modules of the launch directory were imported: {imported}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTHON") and k != "RESUMABLE_PERSIST"
    }
    env.update(extra)
    return env


def test_the_worker_never_imports_modules_of_the_launch_directory(tmp_path: Path) -> None:
    """The way this suite runs: the project's interpreter, ``resumable`` on PYTHONPATH."""
    result = run_trainer(tmp_path, sys.executable, clean_env(PYTHONPATH=str(SRC)))
    assert result == {"steps": [1], "mode": "process"}


def test_packages_found_only_through_pythonpath_reach_the_worker(tmp_path: Path) -> None:
    """The base interpreter (outside any virtual environment), with ``resumable`` and torch
    importable only through PYTHONPATH, which the isolated worker does not read."""
    python = os.path.realpath(sys.executable)
    result = run_trainer(
        tmp_path, python, clean_env(PYTHONPATH=os.pathsep.join([str(SRC), str(TORCH_SITE)]))
    )
    assert result == {"steps": [1], "mode": "process"}


def test_with_pythonhome_the_worker_is_still_kept_from_the_launch_directory(
    tmp_path: Path,
) -> None:
    """PYTHONHOME, which ``-I`` would ignore, makes the worker start without ``-I``; the import
    path is still replaced before the worker's first import."""
    python = os.path.realpath(sys.executable)
    env = clean_env(
        PYTHONHOME=os.pathsep.join([sys.base_prefix, sys.base_exec_prefix]),
        PYTHONPATH=os.pathsep.join([str(SRC), str(TORCH_SITE)]),
    )
    result = run_trainer(tmp_path, python, env)
    assert result == {"steps": [1], "mode": "process"}


KILLED = """
import os, signal, sys, time
import torch
import resumable

state = {"w": torch.arange(1024.0)}
ck = resumable.Checkpointer(sys.argv[1], state, persist="process", shm_dir=sys.argv[2])
for step in range(1, 4):
    ck.save(step)
time.sleep(3)  # the worker's replies wait, unread, in this end of the socket
print("killing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_worker_ends_quietly_when_its_trainer_is_killed(tmp_path: Path) -> None:
    """A SIGKILLed trainer leaves the worker a reset connection (its replies were never
    read): the worker ends as on a clean EOF, printing no traceback to the job's log."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(KILLED))
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # stderr is shared with the worker, so reading it to its end waits for the worker too.
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck"), str(shm)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    assert "killing" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Error" not in proc.stderr, proc.stderr
