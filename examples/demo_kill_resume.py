"""`make demo`: run the demo, SIGKILL it part-way, run the same command again, and show
that the resumed run ends with exactly the line an uninterrupted run prints.

    python examples/demo_kill_resume.py --dir runs/demo [--steps 600] [--every 50]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time


def demo_cmd(directory: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "resumable.cli",
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
    print(f"\n$ {' '.join(cmd[2:])}    # {label}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        print(f"  | {line}")
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(f"{label} failed with exit code {proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def run_and_kill(cmd: list[str], kill_after_step: int) -> None:
    print(f"\n$ {' '.join(cmd[2:])}    # will be killed with SIGKILL after step {kill_after_step}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  | {line.rstrip()}", flush=True)
        if line.startswith("step ") and int(line.split()[1]) >= kill_after_step:
            time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"  X killed (exit status {proc.returncode})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="runs/demo")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    reference_dir = args.dir.rstrip("/") + "-uninterrupted"
    for d in (args.dir, reference_dir):
        shutil.rmtree(d, ignore_errors=True)

    reference = run_to_end(demo_cmd(reference_dir, args), "uninterrupted reference run")
    run_and_kill(demo_cmd(args.dir, args), kill_after_step=args.steps // 2)
    resumed = run_to_end(demo_cmd(args.dir, args), "same command again: resumes by itself")

    print(f"\nuninterrupted: {reference}\nkill + resume: {resumed}")
    if resumed != reference:
        print("MISMATCH: the resumed run did not end bit-identical", file=sys.stderr)
        return 1
    print("identical: the killed-and-resumed run ended bit for bit where the uninterrupted one did")
    print(f"inspect it with: resumable ls {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
