"""``resumable shm``: list this user's shared-memory snapshot segments, or ``--clean``
the ones no process holds.

A segment holding a step its root has not committed is kept unless ``--force``: it may
be the only copy of that progress. Only local roots are checked; others count as unknown.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from rich import box
from rich.table import Table

from resumable.cli.common import (
    add_shm_dir,
    human_size,
    one_line,
    print_json,
    rich_text,
    stdout_console,
)
from resumable.commit import list_committed
from resumable.errors import CheckpointError
from resumable.storage import LocalStorage, open_storage

if TYPE_CHECKING:
    from resumable._shm import SegmentInfo


def shm_arguments(p: argparse.ArgumentParser) -> None:
    add_shm_dir(p)
    p.add_argument(
        "--clean",
        action="store_true",
        help="remove segments that no process holds (whatever owner pid they record), "
        "except those holding progress their checkpoint root has not committed",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --clean: remove those too, losing that progress",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="only the segments of this checkpoint root: named for it on this host, or "
        "recording it as their root (other jobs' segments are left alone)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="with --root: also the segments that record no root and are named for "
        "another one (written by an older version; nobody can tell whose they are)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


@dataclass(frozen=True)
class _RootState:
    """What ``resumable shm`` learned of a slot's checkpoint root: its newest committed
    step (None: none), or why it could not tell (``unknown``)."""

    newest: int | None = None
    unknown: str | None = None


def _root_state(root: str | None) -> _RootState:
    """The newest commit of a local checkpoint root. Other roots are not contacted (a
    cleanup on one host should not wait on an object store's retries)."""
    if root is None:
        return _RootState(unknown="the slot does not record its root (an older version wrote it)")
    try:
        storage = open_storage(root)
    except CheckpointError as exc:
        return _RootState(unknown=str(exc))
    if not isinstance(storage, LocalStorage):
        return _RootState(unknown=f"{root} is not a local directory; not checked")
    if not storage.root.is_dir():
        return _RootState()  # the directory is gone: nothing of it is committed
    try:
        steps = list_committed(storage)
    except (CheckpointError, OSError) as exc:
        return _RootState(unknown=f"cannot list {root}: {one_line(exc)}")
    return _RootState(newest=steps[-1] if steps else None)


def _unsaved(step: int | None, state: _RootState) -> bool | None:
    """Whether a slot's snapshot is newer than everything its root committed (None:
    cannot tell); a slot without a complete snapshot holds nothing to lose."""
    if step is None:
        return False
    if state.unknown is not None:
        return None
    return state.newest is None or step > state.newest


def run_shm(args: argparse.Namespace) -> int:
    from resumable._shm import list_segments, remove_dead_segments

    if args.force and not args.clean:
        raise ValueError("--force only applies to --clean")
    if args.all and args.root is None:
        raise ValueError("--all only applies to --root (without --root every segment is listed)")
    directory = Path(args.shm_dir)
    segments = list(list_segments(directory))
    belongs = _root_filter(args.root, args.all, segments)
    segments = [seg for seg in segments if belongs(seg.path, seg.root)]
    roots = {seg.root: _root_state(seg.root) for seg in segments}
    rows: list[dict[str, Any]] = []
    for seg in segments:
        state = roots[seg.root]
        rows.append(
            {
                "path": str(seg.path),
                "bytes": seg.size,
                "owner_pid": seg.owner_pid,
                "in_use": seg.in_use,
                "step": seg.step,
                "root": seg.root,
                "newest_commit": state.newest,
                "unsaved": _unsaved(seg.step, state),
                "unknown": state.unknown,
                "removed": False,
                "kept": False,
            }
        )
    if args.clean:
        at_risk = {Path(r["path"]) for r in rows if r["unsaved"] is not False}
        spare = set() if args.force else at_risk
        chosen = {seg.path for seg in segments}
        removed = {
            str(p)
            for p in remove_dead_segments(
                directory,
                spare=spare,
                select=None if args.root is None else lambda p: p in chosen or belongs(p, None),
            )
        }
        for r in rows:
            r["removed"] = r["path"] in removed
            r["kept"] = Path(r["path"]) in spare and not r["in_use"]
    if args.json:
        print_json(rows)
        return 0
    console = stdout_console()
    if not rows:
        of = "" if args.root is None else f" of {args.root}"
        console.print(
            rich_text(f"no resumable shared-memory segments{of} of this user in {directory}")
        )
        return 0
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("segment", "size", "owner", "step", "root", "committed", "unsaved", "state"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        if r["removed"]:
            label = "removed"
        elif r["kept"]:
            label = "kept"
        else:
            label = "in use" if r["in_use"] else "orphaned"
        table.add_row(
            rich_text(r["path"]),
            rich_text(human_size(r["bytes"])),
            rich_text(str(r["owner_pid"])),
            rich_text("-" if r["step"] is None else str(r["step"])),
            rich_text(r["root"] or "?"),
            rich_text("-" if r["newest_commit"] is None else str(r["newest_commit"])),
            rich_text({True: "yes", False: "no", None: "?"}[r["unsaved"]]),
            rich_text(label),
        )
    console.print(table)
    for r in rows:
        if r["unsaved"] is False or r["in_use"]:
            continue
        loss = _loss_text(r)
        if r["kept"]:
            console.print(rich_text(f"kept {r['path']}: {loss}; `--clean --force` removes it"))
        elif r["removed"]:
            console.print(rich_text(f"removed {r['path']}: lost {loss}"))
        elif not args.clean:
            console.print(rich_text(f"{r['path']}: {loss}; `--clean` keeps it unless --force"))
    return 0


def _root_filter(
    root: str | None, everything: bool, segments: Iterable[SegmentInfo]
) -> Callable[[Path, str | None], bool]:
    """Whether a file (its path, the root it records) belongs to ``root``: named for it
    on this host (`run_key_for` of its location: every segment of it, complete or not),
    or recording it (a segment written under another host name, such as another
    container sharing ``/dev/shm``). A file that records no root takes the root its
    sibling of the same run key records (an empty slot, a creation cut short); if none
    does, nobody can tell whose it is, and it belongs only with ``everything``. No
    ``root``: every file belongs."""
    if root is None:
        return lambda path, recorded: True
    from resumable._shm import run_key_for, run_key_of

    storage = open_storage(root)
    key = run_key_for(storage.location)
    known = {run_key_of(seg.path): seg.root for seg in segments if seg.root is not None}

    def belongs(path: Path, recorded: str | None) -> bool:
        own_key = run_key_of(path)
        if own_key == key:
            return True
        recorded = recorded or known.get(own_key)
        if recorded is None:
            return everything
        return _same_root(recorded, storage.url)

    return belongs


def _same_root(recorded: str, url: str) -> bool:
    """Whether two roots' URLs name one root: equal, or local paths to one directory."""
    if recorded == url:
        return True
    if urlparse(recorded).scheme or urlparse(url).scheme:
        return False
    try:
        return Path(recorded).resolve() == Path(url).resolve()
    except (OSError, RuntimeError):
        return False


def _loss_text(row: dict[str, Any]) -> str:
    """What removing a slot loses, for people: its step and how it compares with its
    root's newest commit."""
    step, root = row["step"], row["root"] or "its root"
    if row["unsaved"] is None:
        return f"step {step}, maybe never committed to {root} ({row['unknown']})"
    newest = row["newest_commit"]
    since = "nothing committed there" if newest is None else f"newest commit: step {newest}"
    return f"step {step} of {root}, held nowhere else ({since})"
