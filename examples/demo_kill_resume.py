"""`make demo`: run the demo, SIGKILL it part-way, run the same command again, and show
that the resumed run ends with exactly the line an uninterrupted run prints.

    .venv/bin/python examples/demo_kill_resume.py [--dir runs/demo] [--steps 600] [--every 50]

It first deletes the runs an earlier demo left in DIR and DIR-uninterrupted (saying so),
and prints every command it runs as a line to paste into a shell from this directory.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resumable.demo import remove_run
from resumable.errors import CheckpointError


def cli_command() -> list[str]:
    """The `resumable` command of this interpreter: the console script beside it (where
    `make` puts it: .venv/bin/resumable), else ``python -m resumable.cli``."""
    script = Path(sys.executable).with_name("resumable")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "resumable.cli"]


def shown_program(program: str) -> str:
    """``program`` as typed in a shell here: its bare name when PATH finds this very file,
    else its path relative to the current directory when it lies below it, else absolute."""
    found = shutil.which(Path(program).name)
    if found is not None and os.path.abspath(found) == os.path.abspath(program):
        return Path(program).name
    relative = os.path.relpath(program)
    if relative.startswith(os.pardir):
        return os.path.abspath(program)
    return relative if os.sep in relative else os.path.join(os.curdir, relative)


def shown(cmd: list[str]) -> str:
    """``cmd`` as one line to paste into a shell from the current directory."""
    return shlex.join([shown_program(cmd[0]), *cmd[1:]])


def demo_cmd(cli: list[str], directory: str, args: argparse.Namespace) -> list[str]:
    return [
        *cli,
        "demo",
        "--dir",
        directory,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--seed",
        str(args.seed),
    ]


def run_to_end(cmd: list[str], label: str) -> str:
    print(f"\n$ {shown(cmd)}    # {label}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        print(f"  | {line}")
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def run_and_kill(cmd: list[str], kill_after_step: int) -> None:
    print(f"\n$ {shown(cmd)}    # to be killed with SIGKILL after step {kill_after_step}")
    # Its stderr is shown only if it fails by itself, as for the other runs: after the
    # kill, its orphaned helper processes may still report that their peer vanished.
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  | {line.rstrip()}", flush=True)
            if line.startswith("step ") and int(line.split()[1]) >= kill_after_step:
                time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                break
        proc.stdout.close()
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            print("  X killed with SIGKILL")
        elif proc.returncode == 0:
            print("  X finished before the kill")
        else:
            stderr.seek(0)
            print(stderr.read(), file=sys.stderr)
            raise SystemExit(f"the run to be killed failed with exit code {proc.returncode}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="runs/demo", help="a local directory (deleted first)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if "://" in args.dir:
        p.error(f"--dir must be a local directory, got {args.dir}")
    reference_dir = args.dir.rstrip("/") + "-uninterrupted"

    try:
        for d in (args.dir, reference_dir):
            remove_run(d, echo=lambda line: print(line, flush=True))
    except CheckpointError as exc:
        p.error(str(exc))

    cli = cli_command()
    reference = run_to_end(demo_cmd(cli, reference_dir, args), "uninterrupted reference run")
    run_and_kill(demo_cmd(cli, args.dir, args), kill_after_step=args.steps // 2)
    resumed = run_to_end(demo_cmd(cli, args.dir, args), "the same command again: resumes")

    print(f"\nuninterrupted: {reference}\nkill + resume: {resumed}")
    if resumed != reference:
        print("MISMATCH: the resumed run did not end bit-identical", file=sys.stderr)
        return 1
    print("identical: the killed-and-resumed run ended bit for bit where the uninterrupted one did")
    print(f"\ninspect it with:  {shown([*cli, 'ls', args.dir])}")
    program = shown_program(cli[0])
    if Path(cli[0]).name == "resumable" and program != "resumable":
        where = os.path.dirname(program)
        activate = os.path.join(where, "activate")
        how = f"`source {activate}`" if os.path.isfile(activate) else "adding it to PATH"
        print(f"(the `resumable` command lies in {where}; {how} lets you type just `resumable`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
