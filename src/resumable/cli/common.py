"""What every subcommand shares: opening the root the user named, the argument types,
and output that is safe for a terminal.

Text from a checkpoint reaches the terminal only through `rich_text`, `say_err` or
`print_json`. The first two make it `printable`; JSON escapes control characters itself.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlparse

from rich.console import Console
from rich.text import Text

from resumable import settings
from resumable.commit import list_committed, refuse_checkpoint_as_root
from resumable.errors import NoCheckpointError
from resumable.format import human_bytes
from resumable.storage import OBJECT_SCHEMES, LocalStorage, Storage, open_storage

_T = TypeVar("_T")

PROG = "resumable"
DEBUG_ENV = settings.DEBUG.name


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
    reaches the terminal (`rich_text`, `say_err`); JSON output escapes them itself."""
    return _UNPRINTABLE.sub(_escape_char, text)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def rich_text(text: str, style: str = "") -> Text:
    """A `rich` text of ``text`` made `printable` (never parsed as markup)."""
    return Text(printable(text), style=style)


def say_err(line: str) -> None:
    """One line on stderr, `printable`."""
    print(printable(line), file=sys.stderr)


def stdout_console() -> Console:
    out = sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    return Console(file=out, highlight=False, soft_wrap=True, width=None if tty else 1000)


def open_root(args: argparse.Namespace) -> Storage:
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


def human_size(n: int | None) -> str:
    return "?" if n is None else human_bytes(n)


def iso_time(created: Any) -> str | None:
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return None
    try:
        return datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return None


def metrics_text(metrics: Any) -> str:
    if not isinstance(metrics, dict):
        return ""
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def declared_bytes(manifest: dict[str, Any]) -> int:
    """A checkpoint's size as ``ls``, ``show`` and ``verify`` report it: the bytes of
    its data files, as its manifest declares them."""
    return sum(int(f["size"]) for f in manifest["files"].values())


def newest_step(storage: Storage) -> int:
    steps = list_committed(storage)
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint in {storage.url}")
    return steps[-1]


def require_step(storage: Storage, step: int) -> int:
    steps = list_committed(storage)
    if step not in steps:
        listed = ", ".join(str(s) for s in steps[-10:]) or "none"
        raise NoCheckpointError(
            f"no committed checkpoint for step {step} in {storage.url}; committed steps: {listed}"
        )
    return step


def chosen_step(storage: Storage, step: int | None) -> int:
    """The checkpoint a command was asked for: ``step``, which must be committed
    (`require_step`), or the newest committed one when it is None (`newest_step`).
    Raises `NoCheckpointError` when there is no such checkpoint."""
    return newest_step(storage) if step is None else require_step(storage, step)


def _parsed(text: str, convert: Callable[[str], _T], expected: str) -> _T:
    """``convert(text)``; a usage error naming what was ``expected`` if it fails."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def step_arg(text: str) -> int:
    """An argparse type: a step number (an integer >= 0)."""
    value = _parsed(text, int, "a step number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _parsed(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _parsed(text, float, "a positive number")
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="checkpoint root: a local path or URL")
    remote = parser.add_argument_group("object storage (s3://, gs://, az://)")
    remote.add_argument(
        "--max-attempts",
        type=positive_int,
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


def add_shm_dir(p: argparse.ArgumentParser) -> None:
    from resumable._shm import SHM_DIR

    p.add_argument(
        "--shm-dir",
        default=str(SHM_DIR),
        help="the shared-memory directory (snapshots are in its resumable-<uid> directory)",
    )


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
        if exc.filename and str(exc.filename) not in text:
            text = f"{text}: {exc.filename}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())
