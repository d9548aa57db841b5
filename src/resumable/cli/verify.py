"""``resumable verify``: read every byte of checkpoints and check each checksum.

Exits 1 when a checkpoint is corrupt, 0 when all are sound.
"""

from __future__ import annotations

import argparse
from typing import Any

from resumable.cli.common import (
    add_dir,
    chosen_step,
    human_size,
    open_root,
    print_json,
    rich_text,
    stdout_console,
    step_arg,
)
from resumable.cli.progress import ByteProgress, ProgressReader
from resumable.commit import list_committed, step_dir
from resumable.errors import CorruptCheckpointError, NoCheckpointError


def verify_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, help="checkpoint to verify (default: newest)")
    which.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.add_argument("--json", action="store_true", help="print a JSON list of results")


def run_verify(args: argparse.Namespace) -> int:
    storage = open_root(args)
    if args.all:
        steps = list_committed(storage)
        if not steps:
            raise NoCheckpointError(f"nothing to verify: no committed checkpoint in {storage.url}")
    else:
        steps = [chosen_step(storage, args.step)]
    results: list[dict[str, Any]] = []
    with ByteProgress("verifying") as bar:
        bar.count(storage, steps)
        for step in steps:
            bar.describe(f"verifying {step_dir(step)}")
            try:
                nbytes = ProgressReader(storage, step, bar).verify()
            except CorruptCheckpointError as exc:
                results.append({"step": step, "ok": False, "bytes": None, "error": str(exc)})
            else:
                results.append({"step": step, "ok": True, "bytes": nbytes, "error": None})
    if args.json:
        print_json(results)
    else:
        console = stdout_console()
        for r in results:
            if r["ok"]:
                line = rich_text(
                    f"OK       {step_dir(r['step'])}  {human_size(r['bytes'])} verified"
                )
                line.stylize("green", 0, 2)
            else:
                line = rich_text(f"CORRUPT  {step_dir(r['step'])}  {r['error']}")
                line.stylize("bold red", 0, 7)
            console.print(line)
    return 0 if all(r["ok"] for r in results) else 1
