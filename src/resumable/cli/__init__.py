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

Adding a subcommand: write ``add_arguments(parser)`` and ``run(args) -> int`` in a
module of this package and add a `Command` to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from resumable import settings
from resumable._version import __version__
from resumable.cli.common import DEBUG_ENV, PROG, one_line, printable, say_err
from resumable.cli.export import export_arguments, run_export
from resumable.cli.listing import (
    log_arguments,
    ls_arguments,
    run_log,
    run_ls,
    run_show,
    show_arguments,
)
from resumable.cli.prune import pin_arguments, prune_arguments, run_pin, run_prune, run_unpin
from resumable.cli.report import report_arguments, run_report
from resumable.cli.shm import run_shm, shm_arguments
from resumable.cli.verify import run_verify, verify_arguments
from resumable.errors import CheckpointError

__all__ = ["COMMANDS", "DEBUG_ENV", "PROG", "Command", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments`` fills its parser, ``run`` returns the exit status."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # the subcommand's --help text (default: ``help``)
    show_defaults: bool = False  # --help shows each option's default


COMMANDS: dict[str, Command] = {
    "ls": Command("list checkpoints with their status", ls_arguments, run_ls),
    "show": Command("show one checkpoint's manifest and state tree", show_arguments, run_show),
    "verify": Command("verify every checksum of checkpoints", verify_arguments, run_verify),
    "export": Command(
        "export one state key as a plain safetensors state dict", export_arguments, run_export
    ),
    "prune": Command("delete old checkpoints by retention", prune_arguments, run_prune),
    "pin": Command("exempt a checkpoint from retention", pin_arguments, run_pin),
    "unpin": Command("let retention delete a pinned checkpoint again", pin_arguments, run_unpin),
    "log": Command("print the audit log (JSON lines, oldest first)", log_arguments, run_log),
    "report": Command(
        "write one self-contained HTML page of the run's history (or --json)",
        report_arguments,
        run_report,
    ),
    "shm": Command("list (or --clean) shared-memory snapshot segments", shm_arguments, run_shm),
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
    quiet = [] if settings.DEBUG.read() == "1" else _THIRD_PARTY_LOGGERS
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
        if settings.DEBUG.read() == "1":
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, OSError, ValueError) as exc:
        if settings.DEBUG.read() == "1":
            raise
        say_err(f"{PROG}: error: {one_line(exc)}")
        return 2
