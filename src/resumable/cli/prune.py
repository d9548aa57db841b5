"""``resumable prune``, ``pin`` and ``unpin``: retention from the command line.

Each goes through the library's retention and pins, and is recorded in the audit log.
"""

from __future__ import annotations

import argparse

from resumable.audit import AuditLog
from resumable.cli.common import (
    add_dir,
    open_root,
    positive_int,
    require_step,
    rich_text,
    stdout_console,
    step_arg,
)
from resumable.cli.progress import progress_bar
from resumable.commit import list_committed, step_dir
from resumable.errors import CheckpointError
from resumable.policy import Keep
from resumable.retention import PINS_DIR, apply_retention, pinned_steps


def prune_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument(
        "--keep-last",
        type=positive_int,
        required=True,
        metavar="K",
        help="keep the K newest checkpoints (pinned ones are always kept)",
    )
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")


def run_prune(args: argparse.Namespace) -> int:
    storage = open_root(args)
    before = list_committed(storage)
    doomed = apply_retention(
        storage,
        Keep(last=args.keep_last),
        AuditLog(storage),
        dry_run=args.dry_run,
        each=lambda steps: progress_bar(steps, len(steps), "deleting"),
    )
    console = stdout_console()
    verb = "would delete" if args.dry_run else "deleted"
    for s in doomed:
        console.print(rich_text(f"{verb} {step_dir(s)}"))
    kept = [s for s in before if s not in doomed]
    console.print(
        rich_text(
            f"{verb} {len(doomed)} checkpoint(s), "
            f"{'would keep' if args.dry_run else 'kept'} {len(kept)}: "
            + (", ".join(str(s) for s in kept) or "none")
        )
    )
    return 0


def pin_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument("step", metavar="STEP", type=step_arg, help="step of the checkpoint")


def run_pin(args: argparse.Namespace) -> int:
    """Exempt a committed checkpoint from retention (``prune`` and the training job's
    ``keep``), as `Checkpointer.pin` does; recorded in the audit log."""
    storage = open_root(args)
    step = require_step(storage, args.step)
    name = step_dir(step)
    if step in pinned_steps(storage):
        stdout_console().print(rich_text(f"{name} was already pinned"))
        return 0
    storage.write(f"{PINS_DIR}/{name}", [b""])
    AuditLog(storage).record("pin", step=step, by="cli")
    stdout_console().print(rich_text(f"pinned {name}: retention will not delete it"))
    return 0


def run_unpin(args: argparse.Namespace) -> int:
    """Let retention delete a pinned checkpoint again; an error if it is not pinned."""
    storage = open_root(args)
    pinned = pinned_steps(storage)
    name = step_dir(args.step)
    if args.step not in pinned:
        listed = ", ".join(str(s) for s in sorted(pinned)) or "none"
        raise CheckpointError(
            f"step {args.step} is not pinned in {storage.url}; pinned steps: {listed}"
        )
    storage.delete(f"{PINS_DIR}/{name}")
    AuditLog(storage).record("unpin", step=args.step, by="cli")
    stdout_console().print(rich_text(f"unpinned {name}: retention may delete it"))
    return 0
