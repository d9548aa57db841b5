"""``resumable ls``, ``show`` and ``log``: what a checkpoint root holds.

``ls`` lists committed, corrupt and incomplete checkpoints and this host's memory-tier
snapshots of the root, and marks the one ``Checkpointer.restore()`` would load. ``show``
prints one manifest and its state tree. ``log`` prints the audit log as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from resumable._dtypes import itemsize
from resumable.audit import read_audit
from resumable.capture import CLASSES_KEY, decode, recorded_classes
from resumable.cli.common import (
    add_dir,
    add_shm_dir,
    chosen_step,
    declared_bytes,
    human_size,
    iso_time,
    metrics_text,
    open_root,
    print_json,
    rich_text,
    stdout_console,
    step_arg,
)
from resumable.cli.progress import ByteProgress, ProgressReader
from resumable.commit import (
    RenameCommit,
    list_committed,
    list_uncommitted,
    parse_step_dir,
    step_dir,
)
from resumable.errors import CheckpointError, CorruptCheckpointError
from resumable.export import has_tensors
from resumable.format import tensor_ranges
from resumable.pieces import GlobalTensor, global_tensors
from resumable.reader import CheckpointReader
from resumable.retention import pinned_steps
from resumable.storage import Storage

log = logging.getLogger(__name__)


_STAGING_PREFIX = ".tmp-"
_INLINE_LIMIT = 120


def _stored_bytes(storage: Storage, path: str) -> int | None:
    """Bytes stored under directory ``path`` (files only, recursively); None if unreadable."""
    total = 0
    try:
        for name in storage.list_dir(path):
            child = f"{path}/{name}"
            if storage.list_dir(child):
                sub = _stored_bytes(storage, child)
                if sub is None:
                    return None
                total += sub
            else:
                total += storage.size(child)
    except (CheckpointError, OSError):
        return None
    return total


def ls_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument("--verify", action="store_true", help="check every checksum (reads all data)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_shm_dir(p)


def _checkpoint_row(
    storage: Storage, step: int, pinned: set[int], full: bool, bar: ByteProgress
) -> dict[str, Any]:
    name = step_dir(step)
    row: dict[str, Any] = {
        "step": step,
        "name": name,
        "created": None,
        "created_unix": None,
        "bytes": _stored_bytes(storage, name),
        "status": "committed",
        "error": None,
        "pinned": step in pinned,
        "metrics": {},
    }
    reader = ProgressReader(storage, step, bar) if full else CheckpointReader(storage, step)
    try:
        manifest = reader.manifest
        row["bytes"] = declared_bytes(manifest)
        row["created_unix"] = manifest.get("created")
        row["created"] = iso_time(manifest.get("created"))
        row["metrics"] = manifest["metrics"]
        if full:
            reader.verify()
        else:
            reader.check_files()
    except CorruptCheckpointError as exc:
        row["status"] = "corrupt"
        row["error"] = str(exc)
    return row


def _incomplete_rows(storage: Storage, pinned: set[int]) -> list[dict[str, Any]]:
    """Step directories without a manifest, and staging directories of dead writers."""
    staging = []
    if storage.supports_rename:
        staging = [n for n in RenameCommit(storage).stale() if n.startswith(_STAGING_PREFIX)]
    rows: list[dict[str, Any]] = []
    for name in [*list_uncommitted(storage), *staging]:
        if name in staging:
            step = parse_step_dir(name[len(_STAGING_PREFIX) :].split(".")[0])
            why = "staging directory of a commit that never finished"
        else:
            step = parse_step_dir(name)
            why = (
                "step directory without a manifest (not committed)"
                if storage.supports_rename
                else "data of attempts that never committed (removed after an hour)"
            )
        rows.append(
            {
                "step": step,
                "name": name,
                "created": None,
                "created_unix": None,
                "bytes": _stored_bytes(storage, name),
                "status": "incomplete",
                "error": why,
                "pinned": step in pinned,
                "metrics": {},
            }
        )
    return rows


def _memory_rows(storage: Storage, shm_dir: Path) -> list[dict[str, Any]]:
    """The memory tier: this run's complete shared-memory snapshots on this host, in
    this user's slot directories."""
    from resumable._shm import attach_unlocked, run_key_for, slot_paths, user_dirs

    rows: list[dict[str, Any]] = []
    key = run_key_for(storage.location)
    for path in (p for d in user_dirs(shm_dir) for p in slot_paths(key, 0, d)):
        if not os.path.lexists(path):
            continue
        slot = attach_unlocked(path)
        if slot is None:
            continue
        try:
            content = slot.read()
            owner = slot.control().owner_pid
        finally:
            slot.close()
        if content is None:
            continue
        rows.append(
            {
                "step": content.step,
                "name": str(path),
                "created": iso_time(content.meta.created),
                "created_unix": content.meta.created,
                "bytes": content.slots[-1].end if content.slots else 0,
                "status": "memory",
                "error": None,
                "pinned": False,
                "metrics": dict(content.meta.metrics),
                "owner_pid": owner,
            }
        )
    return rows


def _merge_memory(
    stored: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per step: a memory snapshot of a step that storage also holds (committed
    or corrupt) joins that row (``where``: storage, memory; ``memory_path``, its slot
    file); one of a step only memory holds is a row of status ``memory``."""
    for r in stored:
        r["where"] = ["storage"]
    by_step = {r["step"]: r for r in stored if r["status"] in ("committed", "corrupt")}
    rows = list(stored)
    for m in memory:
        m["where"] = ["memory"]
        same = by_step.get(m["step"])
        if same is None:
            by_step[m["step"]] = m
            rows.append(m)
        elif "memory" not in same["where"]:
            same["where"].append("memory")
            same["memory_path"] = m["name"]
    return rows


def _restore_pick(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row ``Checkpointer.restore()`` (``tier="auto"``) would load: the newest
    complete memory snapshot if it is at least as new as every committed checkpoint,
    else the newest committed checkpoint that checks out (corrupt ones are skipped)."""
    committed = [r for r in rows if r["status"] in ("committed", "corrupt")]
    valid = [r for r in committed if r["status"] == "committed"]
    newest_step = max((r["step"] for r in committed), default=-1)
    memory = [r for r in rows if "memory" in r["where"] and r["step"] >= newest_step]
    if memory:
        return max(memory, key=lambda r: r["step"])
    return max(valid, key=lambda r: r["step"]) if valid else None


def run_ls(args: argparse.Namespace) -> int:
    storage = open_root(args)
    pinned = pinned_steps(storage)
    steps = list_committed(storage)
    with ByteProgress("verifying", enabled=args.verify) as bar:
        bar.count(storage, steps)
        rows = [_checkpoint_row(storage, s, pinned, args.verify, bar) for s in steps]
    rows += _incomplete_rows(storage, pinned)
    rows = _merge_memory(rows, _memory_rows(storage, Path(args.shm_dir)))
    rows.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["name"]))
    picked = _restore_pick(rows)
    for r in rows:
        r["restore"] = r is picked
    if args.json:
        print_json(rows)
        return 0
    console = stdout_console()
    if not rows:
        console.print(rich_text(f"no checkpoints in {storage.url}"))
        return 0
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col, justify in (
        ("step", "right"),
        ("time", "left"),
        ("size", "right"),
        ("status", "left"),
        ("where", "left"),
        ("pinned", "left"),
        ("restore", "left"),
        ("metrics", "left"),
    ):
        wraps = col == "metrics"
        table.add_column(
            col,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=not wraps,
            overflow="fold" if wraps else "ellipsis",
        )
    styles = {"committed": "green", "corrupt": "bold red", "incomplete": "yellow", "memory": "cyan"}
    for r in rows:
        table.add_row(
            rich_text("-" if r["step"] is None else str(r["step"])),
            rich_text(r["created"] or "-"),
            rich_text(human_size(r["bytes"])),
            rich_text(r["status"], style=styles.get(r["status"], "")),
            rich_text(", ".join(r["where"])),
            rich_text("yes" if r["pinned"] else "no"),
            rich_text("<-" if r["restore"] else ""),
            rich_text(metrics_text(r["metrics"])),
        )
    console.print(table)
    for r in rows:
        if r["error"]:
            console.print(rich_text(f"{r['name']}: {r['status']}: {r['error']}"))
    return 0


def show_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument("--step", type=step_arg, help="checkpoint to show (default: newest)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def _inline(node: Any) -> str:
    """A one-line rendering of a subtree without tensors, shortened if long."""
    try:
        value = decode(node, {})
        text = json.dumps(value, default=repr, allow_nan=True)
    except (CheckpointError, TypeError, ValueError, RecursionError):
        text = "<malformed>"
    if len(text) > _INLINE_LIMIT:
        text = text[: _INLINE_LIMIT - 1] + "…"
    return text


@dataclass(frozen=True)
class _Index:
    """The tensor index of the checkpoint shown, and its global tensors (grouped once)."""

    tensors: dict[str, Any]
    globals: dict[str, GlobalTensor]


def _tensor_line(label: str, kind: str, name: str, index: dict[str, Any]) -> str:
    info = index.get(name)
    if not isinstance(info, dict):
        return f"{label}: {kind} {name} (not in the tensor index)"
    nbytes = math.prod(info["shape"]) * itemsize(info["dtype"])
    where = ""
    if "chunks" in info or "extents" in info:
        steps = sorted({s for s, *_ in tensor_ranges(info) if s is not None})
        if steps:
            where = f" (in step {', '.join(map(str, steps))})"
    return f"{label}: {kind} {name} {info['dtype']} {info['shape']} {human_size(nbytes)}{where}"


def _global_line(label: str, fqn: str, globals_: dict[str, GlobalTensor]) -> str:
    """A tensor of several ranks: its global shape and how many pieces hold it."""
    spec = globals_.get(fqn)
    if spec is None:
        return f"{label}: global {fqn} (no pieces in the tensor index)"
    nbytes = sum(math.prod(p.shape) for p in spec.pieces) * itemsize(spec.dtype)
    return (
        f"{label}: global {fqn} {spec.dtype} {list(spec.shape)} {human_size(nbytes)} "
        f"in {len(spec.pieces)} piece(s)"
    )


def _tree_lines(node: Any, label: str, depth: int, index: _Index, out: list[str]) -> None:
    pad = "  " * depth
    if isinstance(node, dict):
        for kind in ("tensor", "ndarray", "torch_generator"):
            if isinstance(node.get(kind), str):
                out.append(pad + _tensor_line(label, kind, node[kind], index.tensors))
                return
        if isinstance(node.get("global"), str):
            out.append(pad + _global_line(label, node["global"], index.globals))
            return
    if not has_tensors(node):
        out.append(f"{pad}{label}: {_inline(node)}")
        return
    if "stateful" in node:
        out.append(f"{pad}{label}: (state_dict)")
        _children(node["stateful"], depth + 1, index, out)
    elif "np_generator" in node:
        out.append(f"{pad}{label}: (numpy generator)")
        _children(node["np_generator"], depth + 1, index, out)
    else:
        out.append(f"{pad}{label}:")
        _children(node, depth + 1, index, out)


def _children(node: Any, depth: int, index: _Index, out: list[str]) -> None:
    if not isinstance(node, dict):
        out.append("  " * depth + _inline(node))
        return
    if isinstance(node.get("dict"), list):
        for pair in node["dict"]:
            if isinstance(pair, list) and len(pair) == 2:
                _tree_lines(pair[1], str(pair[0]), depth, index, out)
        return
    for tag in ("list", "tuple"):
        if isinstance(node.get(tag), list):
            for i, item in enumerate(node[tag]):
                _tree_lines(item, f"[{i}]", depth, index, out)
            return
    _tree_lines(node, "(value)", depth, index, out)


def _split_classes(tree: Any) -> tuple[Any, list[tuple[tuple[Any, ...], str]]]:
    """The tree without its ``__classes__`` entry, and the classes it records (shown
    apart: they describe the entries, they are not state)."""
    pairs = tree.get("dict") if isinstance(tree, dict) else None
    if not isinstance(pairs, list):
        return tree, []
    rest = [p for p in pairs if not (isinstance(p, list) and p[:1] == [CLASSES_KEY])]
    node = next((p[1] for p in pairs if isinstance(p, list) and p[:1] == [CLASSES_KEY]), None)
    try:
        classes = recorded_classes(decode(node, {})) if node is not None else []
    except CheckpointError:
        return tree, []
    return {**tree, "dict": rest}, classes


def run_show(args: argparse.Namespace) -> int:
    storage = open_root(args)
    step = chosen_step(storage, args.step)
    m = CheckpointReader(storage, step).manifest
    if args.json:
        print_json(m)
        return 0
    files = m["files"]
    index = m["tensors"]
    versions: dict[str, Any] = m["versions"] if isinstance(m.get("versions"), dict) else {}
    summary = [
        ("checkpoint", f"{step_dir(step)} in {storage.url}"),
        ("step", str(m["step"])),
        ("created", iso_time(m.get("created")) or "?"),
        ("format", f"{m['format']} v{m['format_version']}"),
        ("versions", " ".join(f"{k}={v}" for k, v in versions.items())),
        ("host", str(m.get("hostname", "?"))),
        ("world size", str(m.get("world_size", "?"))),
        ("metrics", metrics_text(m["metrics"]) or "-"),
        ("files", f"{len(files)} ({human_size(declared_bytes(m))})"),
        ("tensors", str(len(index))),
    ]
    width = max(len(k) for k, _ in summary)
    lines = [f"{k.ljust(width)}  {v}" for k, v in summary]
    ranks = m["ranks"]
    for r in ranks:
        lines.append("")
        lines.append("state" if len(ranks) == 1 else f"state (rank {r.get('rank', '?')})")
        tree, classes = _split_classes(r["tree"])
        _children(tree, 1, _Index(index, global_tensors(index)), lines)
        if classes:
            lines.append("classes")
            lines.extend(f"  {'/'.join(map(str, p))}: {c.replace(':', '.')}" for p, c in classes)
    console = stdout_console()
    for line in lines:
        console.print(rich_text(line))
    return 0


def log_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument(
        "--event",
        action="append",
        metavar="NAME",
        help="only events of this kind (commit, delete, restore, ...); repeatable",
    )


def run_log(args: argparse.Namespace) -> int:
    wanted = set(args.event or ())
    for entry in read_audit(open_root(args)):
        if not wanted or entry.get("event") in wanted:
            sys.stdout.write(json.dumps(entry, default=str) + "\n")
    return 0
