"""The environment variables resumable reads, in one place.

Each `Knob` names one variable, its default and what it does; docs/environment.md lists
the same table (a test keeps the two in step, and fails on a ``RESUMABLE_*`` variable
read anywhere else). The modules that use a knob parse and check its value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, the default when unset, what it changes."""

    name: str
    default: str
    doc: str

    def read(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in ``environ`` (default: the process's), None if unset."""
        return (os.environ if environ is None else environ).get(self.name)


PERSIST = Knob(
    "RESUMABLE_PERSIST",
    "auto",
    "The persist mode of a `Checkpointer` built with persist='auto': process, thread or sync.",
)
PROGRESS_EVERY_S = Knob(
    "RESUMABLE_PROGRESS_EVERY_S",
    "5",
    "Seconds between 'progress' entries of the audit log (0: one at every step).",
)
WORKER_NICE = Knob(
    "RESUMABLE_WORKER_NICE",
    "10",
    "Niceness added to the persist worker process, 0 (the trainer's priority) to 19.",
)
DIRECT_IO = Knob(
    "RESUMABLE_DIRECT_IO",
    "1",
    "0, false or no: write every data file through the page cache (no O_DIRECT).",
)
STORE_HOST = Knob(
    "RESUMABLE_STORE_HOST",
    "",
    "The address other ranks reach rank 0's coordination store at (default: loopback "
    "when every rank runs on one host, else rank 0's fully qualified host name).",
)
REPLICA_HOST = Knob(
    "RESUMABLE_REPLICA_HOST",
    "",
    "The address other ranks reach this rank's replica server at, with replicas > 1 "
    "(default: loopback when every rank runs on one host, else this host's fully "
    "qualified name).",
)
REPLICA_RATE = Knob(
    "RESUMABLE_REPLICA_RATE",
    "0",
    "The most MiB per second each rank sends to its replica peers, with replicas > 1 "
    "(0: no limit); the next snapshot waits for a push that pacing stretches.",
)
NODE_STAGING = Knob(
    "RESUMABLE_NODE_STAGING",
    "",
    "With node_objects=True, the directory on each node where its ranks stage their "
    "files for the node's object (default: the temporary directory's resumable-nodes).",
)
WATCH = Knob(
    "RESUMABLE_WATCH",
    "",
    "Cloud termination notices to watch for: a comma list of aws, gcp, azure (none by default).",
)
WATCH_ENDPOINT = Knob(
    "RESUMABLE_WATCH_ENDPOINT",
    "",
    "The metadata endpoint the watchers of RESUMABLE_WATCH poll (default: each cloud's own).",
)
DEBUG = Knob(
    "RESUMABLE_DEBUG",
    "",
    "1: the command line shows tracebacks and the storage clients' logs.",
)

KNOBS: tuple[Knob, ...] = (
    PERSIST,
    PROGRESS_EVERY_S,
    WORKER_NICE,
    DIRECT_IO,
    STORE_HOST,
    REPLICA_HOST,
    REPLICA_RATE,
    NODE_STAGING,
    WATCH,
    WATCH_ENDPOINT,
    DEBUG,
)
