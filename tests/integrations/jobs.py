"""Running the scripts of ``examples/integrations`` as a user would: to the end, or until
they print ``step <N>`` and then a signal (SIGKILL, SIGTERM), and kill campaigns of those.

Each script takes ``--dir``, resumes by itself, prints ``step <N>`` after each optimizer
step and, as its last line, ``final step=<N> params_sha256=<hex>``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300.0


def steps_in(root: Path) -> list[int]:
    """The steps of the checkpoint directories under ``root``."""
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


class Job:
    """One example script with its fixed arguments and environment."""

    def __init__(self, script: Path, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.script = script
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}

    def command(self, directory: Path, *extra: str) -> list[str]:
        return [sys.executable, str(self.script), "--dir", str(directory), *self.args, *extra]

    def run_to_end(self, cmd: list[str]) -> str:
        """Run ``cmd`` to its end (exit code 0); its last line."""
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=self.env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    def run_until(
        self,
        cmd: list[str],
        step: int,
        sig: signal.Signals,
        *,
        pause: float = 0.0,
        ready: Callable[[], bool] = lambda: True,
    ) -> int:
        """Start ``cmd``, send ``sig`` once it printed ``step <step>`` (or a later step) and
        ``ready()`` holds, after ``pause`` seconds; its exit code."""
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith("step ") and int(line.split()[1]) >= step and ready():
                    time.sleep(pause)
                    proc.send_signal(sig)
                    break
            proc.stdout.read()
        finally:
            proc.stdout.close()
            rc = proc.wait(timeout=120)
        return rc

    def kill_campaign(
        self,
        directory: Path,
        kills: int,
        seed: int,
        *extra: str,
        last_step: int,
        while_killed: tuple[str, ...] = (),
        max_pause: float = 0.0,
    ) -> str:
        """SIGKILL the job ``kills`` times at random steps (1 to ``last_step``, then up to
        ``max_pause`` seconds later), relaunching each time with ``while_killed`` added
        (a per-step sleep, say), then run it to the end; its last line."""
        rng = random.Random(seed)
        for _ in range(kills):
            step = rng.randint(1, last_step)
            pause = rng.uniform(0.0, max_pause) if max_pause else 0.0
            cmd = self.command(directory, *while_killed, *extra)
            rc = self.run_until(cmd, step, signal.SIGKILL, pause=pause)
            assert rc in (-signal.SIGKILL, 0)
        return self.run_to_end(self.command(directory, *extra))
