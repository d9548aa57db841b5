"""The ``resumable`` command: list, inspect, verify, export and prune checkpoints, and
print their audit log.

Every subcommand goes through the same library calls a training job uses (storage by
URL, `CheckpointReader`, retention), so what the command says about a checkpoint is
what ``Checkpointer.restore`` would find. Output is a `rich` table or tree for people
and ``--json`` for programs; rich drops colour and box styling when stdout is not a
terminal.

Errors the operator can act on (a `CheckpointError`, a bad path, a bad value) end as
one line ``resumable: error: <message>`` on stderr and exit status 2; ``verify`` exits
1 when it found a corrupt checkpoint. ``RESUMABLE_DEBUG=1`` re-raises with the
traceback instead.

Adding a subcommand: write ``add_arguments(parser)`` and ``run(args) -> int`` and add a
`Command` to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from resumable import __version__
from resumable.audit import AuditLog, read_audit
from resumable.capture import CLASSES_KEY, decode, recorded_classes
from resumable.commit import (
    RenameCommit,
    list_committed,
    list_uncommitted,
    parse_step_dir,
    refuse_checkpoint_as_root,
    step_dir,
)
from resumable.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from resumable.export import export_state_dict, has_tensors, write_atomic
from resumable.format import human_bytes, itemsize, tensor_ranges
from resumable.pieces import GlobalTensor, global_tensors
from resumable.policy import Keep
from resumable.reader import CheckpointReader
from resumable.retention import PINS_DIR, apply_retention, pinned_steps
from resumable.storage import OBJECT_SCHEMES, LocalStorage, Storage, open_storage

if TYPE_CHECKING:
    from resumable.shm import SegmentInfo

log = logging.getLogger(__name__)

PROG = "resumable"
DEBUG_ENV = "RESUMABLE_DEBUG"
_STAGING_PREFIX = ".tmp-"
_INLINE_LIMIT = 120


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments`` fills its parser, ``run`` returns the exit status."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # the subcommand's --help text (default: ``help``)
    show_defaults: bool = False  # --help shows each option's default


# --------------------------------------------------------------------------- helpers


# Characters that a terminal acts on instead of printing: C0 controls (ESC starts CSI
# and OSC sequences: colours, erased lines, window titles, OSC 52 clipboard writes), DEL,
# C1 controls (U+009B is a one-byte CSI), line separators, and the bidirectional
# overrides and isolates that reorder what follows them.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape
    (``\\x1b``, ``\\u202e``): what the command prints of a checkpoint (metric names
    and values, tree keys, paths, error text quoting a file) cannot recolour or erase
    lines, set the title, write the clipboard or reorder text. Applied where text
    reaches the terminal (`_text`, `_say_err`); JSON output escapes them itself."""
    return _UNPRINTABLE.sub(_escape_char, text)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _text(text: str, style: str = "") -> Text:
    """A `rich` text of ``text`` made `printable` (never parsed as markup)."""
    return Text(printable(text), style=style)


def _say_err(line: str) -> None:
    """One line on stderr, `printable`."""
    print(printable(line), file=sys.stderr)


def _console() -> Console:
    out = sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    return Console(file=out, highlight=False, soft_wrap=True, width=None if tty else 1000)


def _open(args: argparse.Namespace) -> Storage:
    """The storage of ``args.dir``; a local directory must already exist. Any other root is
    listed once here, so that an unreachable server, a missing bucket or missing
    credentials is reported against the root the user named, not against a file
    inside it that the command happened to read first. One checkpoint given as the root
    (``runs/x/step-000000000400``) is refused, naming the parent to pass instead. An
    object store is asked with ``--max-attempts`` and ``--connect-timeout``: a server
    that is not there is reported in seconds, not after a training job's retries."""
    url = args.dir
    options = None
    if urlparse(url).scheme in OBJECT_SCHEMES:
        options = {"max_attempts": args.max_attempts, "connect_timeout": args.connect_timeout}
    storage = open_storage(url, options)
    if isinstance(storage, LocalStorage):
        if not storage.root.exists():
            raise NoCheckpointError(f"no checkpoint directory at {storage.root}")
        if not storage.root.is_dir():
            raise NoCheckpointError(f"{storage.root} is not a directory")
    else:
        storage.list_dir("")
    refuse_checkpoint_as_root(storage)
    return storage


def _human_bytes(n: int | None) -> str:
    return "?" if n is None else human_bytes(n)


def _iso_time(created: Any) -> str | None:
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return None
    try:
        return datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return None


def _metrics_text(metrics: Any) -> str:
    if not isinstance(metrics, dict):
        return ""
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


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


def _declared_bytes(manifest: dict[str, Any]) -> int:
    """A checkpoint's size as ``ls``, ``show`` and ``verify`` report it: the bytes of
    its data files, as its manifest declares them."""
    return sum(int(f["size"]) for f in manifest["files"].values())


def _newest(storage: Storage) -> int:
    steps = list_committed(storage)
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint in {storage.url}")
    return steps[-1]


def _require_step(storage: Storage, step: int) -> int:
    steps = list_committed(storage)
    if step not in steps:
        listed = ", ".join(str(s) for s in steps[-10:]) or "none"
        raise NoCheckpointError(
            f"no committed checkpoint for step {step} in {storage.url}; committed steps: {listed}"
        )
    return step


def _step_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="checkpoint root: a local path or URL")
    remote = parser.add_argument_group("object storage (s3://, gs://, az://)")
    remote.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=2,
        metavar="N",
        help="tries per request, the first included (default: 2)",
    )
    remote.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="seconds to wait for a connection (default: 5)",
    )


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------- ls


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument("--verify", action="store_true", help="check every checksum (reads all data)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    _add_shm_dir(p)


def _add_shm_dir(p: argparse.ArgumentParser) -> None:
    from resumable.shm import SHM_DIR

    p.add_argument(
        "--shm-dir",
        default=str(SHM_DIR),
        help="the shared-memory directory (snapshots are in its resumable-<uid> directory)",
    )


def _checkpoint_row(
    storage: Storage, step: int, pinned: set[int], full: bool, bar: _ByteProgress
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
    reader = _ProgressReader(storage, step, bar) if full else CheckpointReader(storage, step)
    try:
        manifest = reader.manifest
        row["bytes"] = _declared_bytes(manifest)
        row["created_unix"] = manifest.get("created")
        row["created"] = _iso_time(manifest.get("created"))
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
    from resumable.shm import ShmSlot, run_key_for, slot_paths, unusable, user_dirs

    rows: list[dict[str, Any]] = []
    key = run_key_for(storage.location)
    for path in (p for d in user_dirs(shm_dir) for p in slot_paths(key, 0, d)):
        if not os.path.lexists(path):
            continue
        try:
            slot = ShmSlot.attach(path, lock=False)
        except (OSError, CheckpointError) as exc:
            log.warning("ignoring a shared-memory snapshot file: %s", unusable(path, exc))
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
                "created": _iso_time(content.meta.get("created")),
                "created_unix": content.meta.get("created"),
                "bytes": content.slots[-1].end if content.slots else 0,
                "status": "memory",
                "error": None,
                "pinned": False,
                "metrics": content.meta.get("metrics", {}),
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
    storage = _open(args)
    pinned = pinned_steps(storage)
    steps = list_committed(storage)
    with _ByteProgress("verifying", enabled=args.verify) as bar:
        if bar.active:
            bar.set_total(_checkpoint_bytes(storage, steps))
        rows = [_checkpoint_row(storage, s, pinned, args.verify, bar) for s in steps]
    rows += _incomplete_rows(storage, pinned)
    rows = _merge_memory(rows, _memory_rows(storage, Path(args.shm_dir)))
    rows.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["name"]))
    picked = _restore_pick(rows)
    for r in rows:
        r["restore"] = r is picked
    if args.json:
        _print_json(rows)
        return 0
    console = _console()
    if not rows:
        console.print(_text(f"no checkpoints in {storage.url}"))
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
            _text("-" if r["step"] is None else str(r["step"])),
            _text(r["created"] or "-"),
            _text(_human_bytes(r["bytes"])),
            _text(r["status"], style=styles.get(r["status"], "")),
            _text(", ".join(r["where"])),
            _text("yes" if r["pinned"] else "no"),
            _text("<-" if r["restore"] else ""),
            _text(_metrics_text(r["metrics"])),
        )
    console.print(table)
    for r in rows:
        if r["error"]:
            console.print(_text(f"{r['name']}: {r['status']}: {r['error']}"))
    return 0


# --------------------------------------------------------------------------- show


def _show_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument("--step", type=_step_arg, help="checkpoint to show (default: newest)")
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
    return f"{label}: {kind} {name} {info['dtype']} {info['shape']} {_human_bytes(nbytes)}{where}"


def _global_line(label: str, fqn: str, globals_: dict[str, GlobalTensor]) -> str:
    """A tensor of several ranks: its global shape and how many pieces hold it."""
    spec = globals_.get(fqn)
    if spec is None:
        return f"{label}: global {fqn} (no pieces in the tensor index)"
    nbytes = sum(math.prod(p.shape) for p in spec.pieces) * itemsize(spec.dtype)
    return (
        f"{label}: global {fqn} {spec.dtype} {list(spec.shape)} {_human_bytes(nbytes)} "
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
    storage = _open(args)
    step = _newest(storage) if args.step is None else _require_step(storage, args.step)
    m = CheckpointReader(storage, step).manifest
    if args.json:
        _print_json(m)
        return 0
    files = m["files"]
    index = m["tensors"]
    versions: dict[str, Any] = m["versions"] if isinstance(m.get("versions"), dict) else {}
    summary = [
        ("checkpoint", f"{step_dir(step)} in {storage.url}"),
        ("step", str(m["step"])),
        ("created", _iso_time(m.get("created")) or "?"),
        ("format", f"{m['format']} v{m['format_version']}"),
        ("versions", " ".join(f"{k}={v}" for k, v in versions.items())),
        ("host", str(m.get("hostname", "?"))),
        ("world size", str(m.get("world_size", "?"))),
        ("metrics", _metrics_text(m["metrics"]) or "-"),
        ("files", f"{len(files)} ({_human_bytes(_declared_bytes(m))})"),
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
    console = _console()
    for line in lines:
        console.print(_text(line))
    return 0


# --------------------------------------------------------------------------- verify


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_step_arg, help="checkpoint to verify (default: newest)")
    which.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.add_argument("--json", action="store_true", help="print a JSON list of results")


def run_verify(args: argparse.Namespace) -> int:
    storage = _open(args)
    if args.all:
        steps = list_committed(storage)
        if not steps:
            raise NoCheckpointError(f"nothing to verify: no committed checkpoint in {storage.url}")
    elif args.step is not None:
        steps = [_require_step(storage, args.step)]
    else:
        steps = [_newest(storage)]
    results: list[dict[str, Any]] = []
    with _ByteProgress("verifying") as bar:
        if bar.active:
            bar.set_total(_checkpoint_bytes(storage, steps))
        for step in steps:
            bar.describe(f"verifying {step_dir(step)}")
            try:
                nbytes = _ProgressReader(storage, step, bar).verify()
            except CorruptCheckpointError as exc:
                results.append({"step": step, "ok": False, "bytes": None, "error": str(exc)})
            else:
                results.append({"step": step, "ok": True, "bytes": nbytes, "error": None})
    if args.json:
        _print_json(results)
    else:
        console = _console()
        for r in results:
            if r["ok"]:
                line = _text(f"OK       {step_dir(r['step'])}  {_human_bytes(r['bytes'])} verified")
                line.stylize("green", 0, 2)
            else:
                line = _text(f"CORRUPT  {step_dir(r['step'])}  {r['error']}")
                line.stylize("bold red", 0, 7)
            console.print(line)
    return 0 if all(r["ok"] for r in results) else 1


# --------------------------------------------------------------------------- export


def _export_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--step", type=_step_arg, help="checkpoint to export (default: newest valid one)"
    )
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

    def __init__(self, bar: _ByteProgress, text: str) -> None:
        self._bar = bar
        self._text = text

    def start(self, total: int) -> None:
        self._bar.start_over(self._text, total)

    def advance(self, nbytes: int) -> None:
        self._bar.advance(nbytes)


def _export(
    storage: Storage, step: int, key: str, out: Path, bar: _ByteProgress
) -> tuple[int, int]:
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
    storage = _open(args)
    with _ByteProgress("exporting") as bar:
        if args.step is not None or args.exact:
            step = _newest(storage) if args.step is None else _require_step(storage, args.step)
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
                    _say_err(f"{PROG}: skipping corrupt {step_dir(step)}: {exc}")
                    problems.append(step_dir(step))
            else:
                raise CorruptCheckpointError(
                    f"none of the {len(candidates)} checkpoint(s) in {storage.url} is valid "
                    f"({', '.join(problems)}); run `resumable verify --all {args.dir}`"
                )
    _console().print(
        _text(
            f"exported {count} tensors ({_human_bytes(nbytes)}) of {args.key!r} "
            f"from {step_dir(step)} to {out}"
        )
    )
    return 0


# --------------------------------------------------------------------------- prune


def _prune_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--keep-last",
        type=_positive_int,
        required=True,
        metavar="K",
        help="keep the K newest checkpoints (pinned ones are always kept)",
    )
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")


def run_prune(args: argparse.Namespace) -> int:
    storage = _open(args)
    before = list_committed(storage)
    doomed = apply_retention(
        storage,
        Keep(last=args.keep_last),
        AuditLog(storage),
        dry_run=args.dry_run,
        each=lambda steps: progress_bar(steps, len(steps), "deleting"),
    )
    console = _console()
    verb = "would delete" if args.dry_run else "deleted"
    for s in doomed:
        console.print(_text(f"{verb} {step_dir(s)}"))
    kept = [s for s in before if s not in doomed]
    console.print(
        _text(
            f"{verb} {len(doomed)} checkpoint(s), "
            f"{'would keep' if args.dry_run else 'kept'} {len(kept)}: "
            + (", ".join(str(s) for s in kept) or "none")
        )
    )
    return 0


# --------------------------------------------------------------------------- pin, unpin


def _pin_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument("step", metavar="STEP", type=_step_arg, help="step of the checkpoint")


def run_pin(args: argparse.Namespace) -> int:
    """Exempt a committed checkpoint from retention (``prune`` and the training job's
    ``keep``), as `Checkpointer.pin` does; recorded in the audit log."""
    storage = _open(args)
    step = _require_step(storage, args.step)
    name = step_dir(step)
    if step in pinned_steps(storage):
        _console().print(_text(f"{name} was already pinned"))
        return 0
    storage.write(f"{PINS_DIR}/{name}", [b""])
    AuditLog(storage).record("pin", step=step, by="cli")
    _console().print(_text(f"pinned {name}: retention will not delete it"))
    return 0


def run_unpin(args: argparse.Namespace) -> int:
    """Let retention delete a pinned checkpoint again; an error if it is not pinned."""
    storage = _open(args)
    pinned = pinned_steps(storage)
    name = step_dir(args.step)
    if args.step not in pinned:
        listed = ", ".join(str(s) for s in sorted(pinned)) or "none"
        raise CheckpointError(
            f"step {args.step} is not pinned in {storage.url}; pinned steps: {listed}"
        )
    storage.delete(f"{PINS_DIR}/{name}")
    AuditLog(storage).record("unpin", step=args.step, by="cli")
    _console().print(_text(f"unpinned {name}: retention may delete it"))
    return 0


# --------------------------------------------------------------------------- log


def _log_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--event",
        action="append",
        metavar="NAME",
        help="only events of this kind (commit, delete, restore, ...); repeatable",
    )


def run_log(args: argparse.Namespace) -> int:
    wanted = set(args.event or ())
    for entry in read_audit(_open(args)):
        if not wanted or entry.get("event") in wanted:
            sys.stdout.write(json.dumps(entry, default=str) + "\n")
    return 0


# --------------------------------------------------------------------------- report


def _report_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--out", default="report.html", help="the HTML file to write (default: report.html)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the figures as JSON instead of writing HTML"
    )


def run_report(args: argparse.Namespace) -> int:
    """One self-contained HTML page (or ``--json``) of the run's history."""
    from resumable.report import build_report
    from resumable.report_html import render_html

    storage = _open(args)
    report = build_report(storage, progress=progress_bar)
    for warning in report.warnings:
        _say_err(f"{PROG}: warning: {warning}")
    if args.json:
        _print_json(report.to_json())
        return 0
    out = Path(args.out)
    write_atomic([render_html(report).encode()], out)
    what = (
        "nothing to report yet (no audit entries, no checkpoints)"
        if report.empty
        else (
            f"{len(report.launches)} launch(es), {len(report.saves)} save(s), "
            f"{len(report.checkpoints)} checkpoint(s)"
        )
    )
    _console().print(_text(f"wrote {out}: {what}"))
    return 0


# --------------------------------------------------------------------------- progress


def _stderr_is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress_bar(items: Iterable[Any], total: int, what: str) -> Iterator[Any]:
    """``items``, with a progress bar on stderr while it is a terminal and ``total`` is
    more than one; silent otherwise (pipes, logs, tests)."""
    if total <= 1 or not _stderr_is_terminal():
        yield from items
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(what, total=total)
        for item in items:
            yield item
            bar.advance(task)


# Tensors read and checked per step of the bar: large enough that the checks still
# share the cores (`CheckpointReader.tensors` does from 8 MiB), small enough that the
# bar moves every fraction of a second.
_PROGRESS_BATCH = 64 << 20


class _ByteProgress:
    """A bar of bytes read and checked, on stderr while it is a terminal; silent (and
    `active` false) otherwise: pipes, logs, tests. Used as a context manager by the
    command that reads; `set_total` once the total is known, `advance` per batch."""

    def __init__(self, what: str, enabled: bool = True) -> None:
        self.what = what
        self.active = enabled and _stderr_is_terminal()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> _ByteProgress:
        if self.active:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=printable(text))

    def start_over(self, text: str, total: int) -> None:
        """The bar empty again, for ``total`` bytes of another piece of work."""
        if self._bar is not None:
            self._bar.update(self._task, description=printable(text), total=total, completed=0)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, nbytes)


def _tensor_nbytes(info: Any) -> int:
    try:
        return math.prod(info["shape"]) * itemsize(info["dtype"])
    except (KeyError, TypeError, ValueError, CheckpointError):
        return 0


def _checkpoint_bytes(storage: Storage, steps: Iterable[int]) -> int:
    """The tensor bytes of ``steps`` a full check reads (unreadable manifests: 0)."""
    total = 0
    for step in steps:
        try:
            index = CheckpointReader(storage, step).manifest["tensors"]
        except (CheckpointError, OSError):
            continue
        total += sum(_tensor_nbytes(info) for info in index.values())
    return total


class _ProgressReader(CheckpointReader):
    """A `CheckpointReader` whose read of every tensor (``tensors()``, as `verify`
    makes it) goes in batches of `_PROGRESS_BATCH` bytes in the files' order, each
    batch read and checked as one, the bar advanced after each. Without an active bar
    it reads as its parent does, in one call."""

    def __init__(self, storage: Storage, step: int, bar: _ByteProgress) -> None:
        super().__init__(storage, step)
        self._bar = bar

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        verify: bool = True,
        into: Any = None,
    ) -> dict[str, torch.Tensor]:
        if names is not None or into is not None or not self._bar.active:
            return super().tensors(names, verify=verify, into=into)
        index = self.manifest["tensors"]
        out: dict[str, torch.Tensor] = {}
        for batch in _batches(index):
            out.update(super().tensors(batch, verify=verify))
            self._bar.advance(sum(_tensor_nbytes(index[n]) for n in batch))
        return out


def _batches(index: dict[str, Any]) -> Iterator[list[str]]:
    """The tensor names of ``index`` in the files' order (tensors in pieces last), cut
    into runs of about `_PROGRESS_BATCH` bytes."""

    def where(name: str) -> tuple[int, str, int]:
        info = index[name]
        if "chunks" in info or "extents" in info or "offsets" not in info:
            return (1, "", 0)
        return (0, str(info.get("file")), int(info["offsets"][0]))

    batch: list[str] = []
    size = 0
    for name in sorted(index, key=where):
        batch.append(name)
        size += _tensor_nbytes(index[name])
        if size >= _PROGRESS_BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --------------------------------------------------------------------------- shm


def _shm_arguments(p: argparse.ArgumentParser) -> None:
    _add_shm_dir(p)
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
        return _RootState(unknown=f"cannot list {root}: {_one_line(exc)}")
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
    from resumable.shm import list_segments, remove_dead_segments

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
        _print_json(rows)
        return 0
    console = _console()
    if not rows:
        of = "" if args.root is None else f" of {args.root}"
        console.print(_text(f"no resumable shared-memory segments{of} of this user in {directory}"))
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
            _text(r["path"]),
            _text(_human_bytes(r["bytes"])),
            _text(str(r["owner_pid"])),
            _text("-" if r["step"] is None else str(r["step"])),
            _text(r["root"] or "?"),
            _text("-" if r["newest_commit"] is None else str(r["newest_commit"])),
            _text({True: "yes", False: "no", None: "?"}[r["unsaved"]]),
            _text(label),
        )
    console.print(table)
    for r in rows:
        if r["unsaved"] is False or r["in_use"]:
            continue
        loss = _loss_text(r)
        if r["kept"]:
            console.print(_text(f"kept {r['path']}: {loss}; `--clean --force` removes it"))
        elif r["removed"]:
            console.print(_text(f"removed {r['path']}: lost {loss}"))
        elif not args.clean:
            console.print(_text(f"{r['path']}: {loss}; `--clean` keeps it unless --force"))
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
    from resumable.shm import run_key_for, run_key_of

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


COMMANDS: dict[str, Command] = {
    "ls": Command("list checkpoints with their status", _ls_arguments, run_ls),
    "show": Command("show one checkpoint's manifest and state tree", _show_arguments, run_show),
    "verify": Command("verify every checksum of checkpoints", _verify_arguments, run_verify),
    "export": Command(
        "export one state key as a plain safetensors state dict", _export_arguments, run_export
    ),
    "prune": Command("delete old checkpoints by retention", _prune_arguments, run_prune),
    "pin": Command("exempt a checkpoint from retention", _pin_arguments, run_pin),
    "unpin": Command("let retention delete a pinned checkpoint again", _pin_arguments, run_unpin),
    "log": Command("print the audit log (JSON lines, oldest first)", _log_arguments, run_log),
    "report": Command(
        "write one self-contained HTML page of the run's history (or --json)",
        _report_arguments,
        run_report,
    ),
    "shm": Command("list (or --clean) shared-memory snapshot segments", _shm_arguments, run_shm),
    "demo": Command(
        "train a small classifier that checkpoints and resumes by itself",
        lambda p: _demo().add_arguments(p),
        lambda args: _demo().run(args),
        description="Train a small classifier on scikit-learn's digits data set (CPU), "
        "checkpointing into --dir. Kill it and run it again: it goes on where it stopped, "
        "and ends bit-identical to a run never stopped (its last line hashes the "
        "parameters). Needs scikit-learn.",
        show_defaults=True,
    ),
}


def _demo() -> Any:
    from resumable import demo  # imports scikit-learn lazily: only the demo needs it

    return demo


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in --help, except where there is none to show (a
    required option, a default of None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and operate resumable checkpoints.",
        epilog=f"Set {DEBUG_ENV}=1 to see tracebacks.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            formatter_class=_DefaultsFormatter if cmd.show_defaults else argparse.HelpFormatter,
        )
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
        if exc.filename and str(exc.filename) not in text:
            text = f"{text}: {exc.filename}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


# The storage clients' loggers: their errors reach the user as the command's own line.
_THIRD_PARTY_LOGGERS = (
    "gcsfs",
    "google",
    "urllib3",
    "botocore",
    "boto3",
    "s3transfer",
    "azure",
    "adlfs",
    "aiohttp",
    "fsspec",
    "asyncio",
)


class _WarningFormatter(logging.Formatter):
    """The library's warnings while a command runs: one `printable` line each."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(f"{PROG}: warning: {' '.join(record.getMessage().split())}")


@contextlib.contextmanager
def _command_logging() -> Iterator[None]:
    """For the length of one command, the library's warnings go to stderr as
    `printable` lines (not through logging's last-resort handler, which prints them
    raw), and the storage clients' loggers are silenced (gcsfs logs a traceback of
    fifty lines before it raises; the command ends with its own one-line error).
    Undone after, so that `main` called in-process leaves logging as it found it;
    ``RESUMABLE_DEBUG=1`` keeps the clients' logs."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_WarningFormatter())
    package = logging.getLogger("resumable")
    package.addHandler(handler)
    quiet = [] if os.environ.get(DEBUG_ENV) == "1" else _THIRD_PARTY_LOGGERS
    levels = {name: logging.getLogger(name).level for name in quiet}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        package.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse usage errors: 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        with _command_logging():
            return int(args._run(args))
    except BrokenPipeError:
        try:  # the reader went away (`resumable ls | head`): stay quiet at exit too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, OSError, ValueError) as exc:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        _say_err(f"{PROG}: error: {_one_line(exc)}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
