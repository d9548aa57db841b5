"""``resumable export``: the command line of `resumable.export.export_state_dict`.

Without ``--step`` or ``--exact`` it exports the newest checkpoint that checks out,
skipping corrupt ones with a line on stderr.
"""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from resumable.cli.common import (
    PROG,
    add_dir,
    chosen_step,
    human_size,
    open_root,
    rich_text,
    say_err,
    stdout_console,
    step_arg,
)
from resumable.cli.progress import ByteProgress
from resumable.commit import list_committed, step_dir
from resumable.errors import CorruptCheckpointError, NoCheckpointError
from resumable.export import export_state_dict
from resumable.storage import Storage


def export_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument("--step", type=step_arg, help="checkpoint to export (default: newest valid one)")
    p.add_argument("--key", required=True, help="top-level state key to export, e.g. model")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors file")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument(
        "--exact",
        action="store_true",
        help="export the newest checkpoint or fail; never fall back to an older one",
    )


class _ExportBar:
    """The byte bar told of an export's progress (`ExportProgress`)."""

    def __init__(self, bar: ByteProgress, text: str) -> None:
        self._bar = bar
        self._text = text

    def start(self, total: int) -> None:
        self._bar.start_over(self._text, total)

    def advance(self, nbytes: int) -> None:
        self._bar.advance(nbytes)


def _export(storage: Storage, step: int, key: str, out: Path, bar: ByteProgress) -> tuple[int, int]:
    progress = _ExportBar(bar, f"exporting {key} of {step_dir(step)}")
    return export_state_dict(storage, step, key, out, progress)


def run_export(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"--out {out} is a directory; name a file")
    if out.exists() and not args.force:
        raise FileExistsError(errno.EEXIST, f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"directory {out.parent} of --out does not exist")
    storage = open_root(args)
    with ByteProgress("exporting") as bar:
        if args.step is not None or args.exact:
            step = chosen_step(storage, args.step)
            try:
                count, nbytes = _export(storage, step, args.key, out, bar)
            except CorruptCheckpointError as exc:
                if args.step is not None:
                    raise
                raise CorruptCheckpointError(
                    f"{exc}; --exact does not fall back to an older checkpoint (leave it out to "
                    "export the newest valid one)"
                ) from exc
        else:
            candidates = list(reversed(list_committed(storage)))
            if not candidates:
                raise NoCheckpointError(f"no committed checkpoint in {storage.url}")
            problems = []
            for step in candidates:
                try:
                    count, nbytes = _export(storage, step, args.key, out, bar)
                    break
                except CorruptCheckpointError as exc:
                    say_err(f"{PROG}: skipping corrupt {step_dir(step)}: {exc}")
                    problems.append(step_dir(step))
            else:
                raise CorruptCheckpointError(
                    f"none of the {len(candidates)} checkpoint(s) in {storage.url} is valid "
                    f"({', '.join(problems)}); run `resumable verify --all {args.dir}`"
                )
    stdout_console().print(
        rich_text(
            f"exported {count} tensors ({human_size(nbytes)}) of {args.key!r} "
            f"from {step_dir(step)} to {out}"
        )
    )
    return 0
