"""The figures of ``resumable report``: a run's history computed from its audit log and
its checkpoints, as plain JSON-able data (``--json``) that `resumable.report_html`
draws.

The audit log is the only record of what happened between checkpoints, so every figure
is derived from its entries (docs/report.md says how). Contract: the log is untrusted
data. Nothing in it is executed, every field is type-checked before use, and a line
that does not parse is listed in ``warnings`` rather than failing the report.

Launches are told apart by their ``launch`` entries, or by ``restore`` entries in older
logs. Each entry belongs to the launch whose start precedes it. Only training entries
(`is_training`) make a launch's end and the run's span. The trade-off: an operator's
entries (``pin``, a ``resumable prune``) may come days after the job ended. They are
shown and counted, but time up to them is not training time.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from resumable.audit import read_audit
from resumable.commit import list_committed, step_dir
from resumable.errors import CheckpointError, CorruptCheckpointError
from resumable.reader import CheckpointReader
from resumable.storage import Storage

Entry = dict[str, Any]

TIER_NAMES = {"memory": "memory", "storage": "local", "local": "local", "mirror": "mirror"}
# Timeline lanes, top to bottom: the event kinds each one shows.
LANES: dict[str, tuple[str, ...]] = {
    "launch": ("launch", "close"),
    "restore": ("restore",),
    "snapshot": ("progress",),
    "persist": ("save_start",),
    "commit": ("commit", "emergency_commit"),
    "mirror": ("mirror_commit", "mirror_skip", "mirror_mismatch"),
    "skip": ("skip",),
    "failure": ("failure", "retry", "interrupted"),
    "preempt": ("preempt",),
    "delete": ("delete", "quarantined", "stale_removed", "uncommitted"),
}
_REACHED = ("progress", "save_start", "skip", "commit", "preempt", "close")
# What a training job writes while it runs (its trainer, persist worker and mirror).
# Not ``delete``: retention's deletes follow a commit at once, and a ``resumable
# prune`` run later writes the same entry.
TRAINING_EVENTS = frozenset(
    {
        "launch",
        "restore",
        "progress",
        "save_start",
        "commit",
        "emergency_commit",
        "skip",
        "failure",
        "retry",
        "interrupted",
        "preempt",
        "close",
        "mirror_commit",
        "mirror_skip",
        "mirror_mismatch",
        "quarantined",
        "stale_removed",
        "uncommitted",
    }
)
_LANE_OF = {kind: lane for lane, kinds in LANES.items() for kind in kinds}


_NUM_LIMIT = 1e18
"""Beyond this no time (a Unix time, a duration in seconds), byte count or step is one a
run writes; sums, differences and products of numbers within it stay finite floats."""


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a number within `_NUM_LIMIT`, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not -_NUM_LIMIT <= value <= _NUM_LIMIT:  # also NaN, and ints beyond float range
        return None
    return float(value)


def _num(entry: Entry, key: str) -> float | None:
    return _number(entry.get(key))


def _rate(nbytes: int | None, seconds: float | None) -> float | None:
    """Bytes per second, if both are known and the quotient is finite (a duration of
    1e-320 s is a number, but no rate)."""
    if not nbytes or not seconds:
        return None
    rate = nbytes / seconds
    return rate if math.isfinite(rate) else None


def _int(entry: Entry, key: str) -> int | None:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _NUM_LIMIT:
        return None
    return value


def is_training(entry: Entry) -> bool:
    """Whether ``entry`` is one a training job wrote while it ran (`TRAINING_EVENTS`);
    a ``skip`` without a step is retention's, which ``resumable prune`` writes too."""
    kind = entry.get("event")
    if not isinstance(kind, str) or kind not in TRAINING_EVENTS:
        return False
    return kind != "skip" or _int(entry, "step") is not None


def _text(entry: Entry, key: str, limit: int = 300) -> str | None:
    value = entry.get(key)
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Save:
    """One persist: from its ``save_start`` to its ``commit`` (or failure)."""

    step: int
    time: float
    launch: int
    stall_s: float | None = None  # the snapshot copy that blocked training
    persist_s: float | None = None  # save_start to durable commit, in the worker
    bytes: int | None = None
    throughput_bps: float | None = None
    ranks: int = 1
    outcome: str = "unfinished"  # committed, failed, interrupted, unfinished
    error: str | None = None


@dataclass
class Launch:
    """One start of the training job (one `Checkpointer`)."""

    index: int
    start: float
    end: float
    host: str | None = None
    pid: int | None = None
    persist_mode: str | None = None
    world_size: int = 1
    restored_step: int | None = None  # None: it never restored; 0 with ``fresh``
    fresh: bool = False
    tier: str | None = None  # memory, local, mirror
    restore_s: float | None = None
    first_step_time: float | None = None  # the first ``progress`` entry
    reached: int | None = None  # the newest step any of its entries names
    step_time_s: float | None = None  # measured seconds per training step
    closed: bool = False  # a ``close`` entry: it ended by itself
    steps_lost: int | None = None  # of the launch before it, at this restart
    lost_s: float | None = None
    downtime_s: float | None = None  # previous launch's last entry to this one's start
    stall_s: float = 0.0
    snapshots: int = 0
    commits: int = 0
    skips: int = 0
    failures: int = 0


@dataclass
class Goodput:
    """Useful training time over wall time, and what the rest went to (seconds)."""

    wall_s: float = 0.0
    useful_s: float = 0.0
    ratio: float | None = None
    checkpoint_stall_s: float = 0.0  # snapshot copies (and sync persists) on the training thread
    restore_s: float = 0.0
    startup_s: float = 0.0  # launch to its first step, less the restore
    downtime_s: float = 0.0  # between a launch's last entry and the next launch
    lost_work_s: float = 0.0  # steps computed again after a restart
    checkpointing_s: float = 0.0  # what checkpointing itself cost: the stall
    failures_s: float = (
        0.0  # what failures cost: downtime, restarts' start-up and restores, lost work
    )


@dataclass
class Checkpoint:
    step: int
    name: str
    bytes: int | None
    created: float | None
    status: str  # committed, corrupt
    error: str | None = None


@dataclass
class Report:
    url: str
    generated: float
    entries: int
    first_time: float | None  # the log's first and last entries, of any kind
    last_time: float | None
    run_start: float | None = None  # the first and last training entries (`is_training`)
    run_end: float | None = None
    warnings: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    mirror: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    goodput: Goodput = field(default_factory=Goodput)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @property
    def restarts(self) -> list[Launch]:
        return self.launches[1:]

    @property
    def empty(self) -> bool:
        return not self.entries and not self.checkpoints

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["restarts"] = len(self.restarts)
        return out


def build_report(
    storage: Storage,
    *,
    progress: Callable[[Iterable[int], int, str], Iterable[int]] | None = None,
    now: float | None = None,
) -> Report:
    """The report of the checkpoint root ``storage``. ``progress`` wraps the loop over
    checkpoints (one manifest read each; slow on a remote root) to show a bar."""
    skipped: list[str] = []
    entries = [e for e in read_audit(storage, skipped) if _num(e, "time") is not None]
    report = Report(
        url=storage.url,
        generated=time.time() if now is None else now,
        entries=len(entries),
        first_time=_num(entries[0], "time") if entries else None,
        last_time=_num(entries[-1], "time") if entries else None,
    )
    report.warnings += [f"skipped an unreadable audit line: {s}" for s in skipped]
    report.checkpoints = _checkpoints(storage, progress, report.warnings)
    if not entries:
        return report
    for e in entries:
        kind = str(e.get("event"))
        report.counts[kind] = report.counts.get(kind, 0) + 1
    training = [e for e in entries if is_training(e)]
    if training:
        report.run_start = _num(training[0], "time")
        report.run_end = _num(training[-1], "time")
    report.launches = _launches(training or entries)
    by_index = _assign(entries, report.launches)
    for launch in report.launches:
        _fill_launch(launch, by_index[launch.index])
    _restarts(report.launches)
    report.saves = _saves(entries, report.launches)
    for launch in report.launches:
        launch.commits = sum(
            1 for s in report.saves if s.launch == launch.index and s.outcome == "committed"
        )
    report.mirror = _mirror(entries)
    report.timeline = _timeline(entries, report.launches)
    report.ranks = sorted({ln.world_size for ln in report.launches})
    report.goodput = _goodput(report)
    return report


# ------------------------------------------------------------------ launches


def _launches(entries: list[Entry]) -> list[Launch]:
    marks = [e for e in entries if e.get("event") == "launch"]
    if not marks:  # a log from before `launch` entries: one restore per launch
        marks = [e for e in entries if e.get("event") == "restore"]
    if not marks:
        marks = [entries[0]]
    launches = []
    for i, e in enumerate(marks):
        t = _num(e, "time")
        assert t is not None
        launch = Launch(index=i, start=t, end=t, host=_text(e, "host", 100), pid=_int(e, "pid"))
        if e.get("event") == "launch":
            launch.persist_mode = _text(e, "persist", 20)
            launch.world_size = max(1, _int(e, "world_size") or 1)
        launches.append(launch)
    launches[0].start = min(launches[0].start, _num(entries[0], "time") or launches[0].start)
    return launches


def _assign(entries: list[Entry], launches: list[Launch]) -> dict[int, list[Entry]]:
    """Each entry to the last launch that started at or before it."""
    out: dict[int, list[Entry]] = {ln.index: [] for ln in launches}
    i = 0
    for e in entries:
        t = _num(e, "time") or 0.0
        while i + 1 < len(launches) and launches[i + 1].start <= t:
            i += 1
        out[launches[i].index].append(e)
    return out


def _fill_launch(launch: Launch, entries: list[Entry]) -> None:
    steps: list[int] = []
    progress: list[tuple[float, int]] = []
    for e in entries:
        kind = e.get("event")
        t = _num(e, "time") or launch.start
        if not is_training(e):
            continue  # an operator's pin, prune...: neither the launch's end nor a step
        launch.end = max(launch.end, t)
        step = _int(e, "step")
        if kind == "restore" and launch.restored_step is None:
            launch.restored_step = step or 0
            launch.fresh = bool(e.get("fresh")) or step == 0
            launch.tier = None if launch.fresh else TIER_NAMES.get(str(e.get("tier")), "local")
            launch.restore_s = _num(e, "duration_s") or 0.0
            ranks = _int(e, "ranks")
            if ranks:
                launch.world_size = max(launch.world_size, ranks)
        elif kind == "progress" and step is not None:
            progress.append((t, step))
            launch.snapshots += _int(e, "snapshots") or 0
            launch.stall_s += _num(e, "snapshot_s") or 0.0
            if launch.first_step_time is None:
                launch.first_step_time = t
        elif kind == "close":
            launch.closed = True
        elif kind == "skip" and step is not None and "tier" not in e and "url" not in e:
            launch.skips += 1
        elif kind == "failure":
            launch.failures += 1
        elif kind == "commit" and launch.persist_mode == "sync":
            launch.stall_s += _num(e, "duration_s") or 0.0  # a sync persist blocks training
        if step is not None and kind in _REACHED and not ("url" in e or "tier" in e):
            steps.append(step)  # a step the loop reached (a restore's skip names older ones)
    launch.reached = max(steps) if steps else launch.restored_step
    launch.step_time_s = _step_time(progress, entries)


def _step_time(progress: list[tuple[float, int]], entries: list[Entry]) -> float | None:
    """Seconds per step: the slope between the first and last entries that name a step
    the loop reached (``progress``, else ``save_start``)."""
    points = progress or [
        (t, s)
        for e in entries
        if e.get("event") == "save_start"
        and (t := _num(e, "time")) is not None
        and (s := _int(e, "step")) is not None
    ]
    if len(points) < 2:
        return None
    (t0, s0), (t1, s1) = points[0], points[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return (t1 - t0) / (s1 - s0)


def _restarts(launches: list[Launch]) -> None:
    before = -1  # the newest step any launch before ``prev`` reached
    for prev, launch in itertools.pairwise(launches):
        restored = launch.restored_step
        if (
            restored is not None
            and prev.reached is not None
            and restored > max(prev.reached, before)
        ):
            # No launch before ``prev`` got this far, so ``prev`` wrote the checkpoint this
            # one resumed from (a memory snapshot, typically): it reached that step after
            # its last ``progress`` entry, before it was killed.
            prev.reached = restored
        before = max(before, prev.reached if prev.reached is not None else -1)
        launch.downtime_s = max(0.0, launch.start - prev.end)
        if prev.reached is not None and launch.restored_step is not None:
            launch.steps_lost = max(0, prev.reached - launch.restored_step)
            if prev.step_time_s is not None:
                launch.lost_s = launch.steps_lost * prev.step_time_s


# --------------------------------------------------------------------- saves


def _saves(entries: list[Entry], launches: list[Launch]) -> list[Save]:
    saves: list[Save] = []
    open_: dict[int, Save] = {}  # step -> its newest unfinished save
    li = 0
    for e in entries:
        kind = e.get("event")
        t = _num(e, "time") or 0.0
        while li + 1 < len(launches) and launches[li + 1].start <= t:
            li += 1
            open_.clear()  # a new launch: the old one's pending saves never finished
        step = _int(e, "step")
        if step is None:
            continue
        if kind == "save_start":
            save = Save(step=step, time=t, launch=launches[li].index)
            save.stall_s = _num(e, "snapshot_s")
            save.bytes = _int(e, "bytes")
            saves.append(save)
            open_[step] = save
        elif kind == "commit" and "source" not in e:
            found = open_.pop(step, None)
            if found is None:  # e.g. an emergency save, or a log cut at its start
                found = Save(step=step, time=t, launch=launches[li].index)
                saves.append(found)
            save = found
            save.outcome = "committed"
            save.persist_s = _num(e, "duration_s")
            save.bytes = _int(e, "bytes") if _int(e, "bytes") is not None else save.bytes
            save.ranks = max(1, _int(e, "ranks") or 1)
            save.throughput_bps = _rate(save.bytes, save.persist_s)
        elif kind in ("failure", "interrupted") and e.get("stage") is None:
            found = open_.pop(step, None)
            if found is not None:
                found.outcome = "failed" if kind == "failure" else "interrupted"
                found.error = _text(e, "error")
    return saves


def _mirror(entries: list[Entry]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        kind = e.get("event")
        if kind == "mirror_commit" or (kind == "failure" and e.get("stage") == "mirror"):
            seconds, nbytes = _num(e, "duration_s"), _int(e, "bytes")
            out.append(
                {
                    "time": _num(e, "time"),
                    "step": _int(e, "step"),
                    "outcome": "uploaded" if kind == "mirror_commit" else "failed",
                    "url": _text(e, "url"),
                    "bytes": nbytes,
                    "duration_s": seconds,
                    "throughput_bps": _rate(nbytes, seconds),
                    "error": _text(e, "error"),
                }
            )
    return out


def _timeline(entries: list[Entry], launches: list[Launch]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        kind = str(e.get("event"))
        lane = _LANE_OF.get(kind, "other")
        if kind == "progress" and not _int(e, "snapshots"):
            continue
        detail: dict[str, Any] = {}
        for k in ("step", "tier", "reason", "error", "stage", "bytes", "duration_s"):
            if k in e:
                number: float | None = _int(e, k)  # a step or byte count stays an integer
                if number is None:
                    number = _num(e, k)
                detail[k] = _text(e, k) if number is None else number
        out.append({"time": _num(e, "time"), "lane": lane, "event": kind[:40], **detail})
    return out


# ------------------------------------------------------------------- goodput


def _goodput(report: Report) -> Goodput:
    g = Goodput()
    if report.run_start is None or report.run_end is None:
        return g
    g.wall_s = max(0.0, report.run_end - report.run_start)
    for launch in report.launches:
        g.checkpoint_stall_s += launch.stall_s
        g.restore_s += launch.restore_s or 0.0
        if launch.first_step_time is not None:
            g.startup_s += max(
                0.0, launch.first_step_time - launch.start - (launch.restore_s or 0.0)
            )
        g.downtime_s += launch.downtime_s or 0.0
        g.lost_work_s += launch.lost_s or 0.0
    g.checkpointing_s = g.checkpoint_stall_s
    first = report.launches[0] if report.launches else None
    first_startup = 0.0
    if first is not None and first.first_step_time is not None:
        first_startup = max(0.0, first.first_step_time - first.start - (first.restore_s or 0.0))
        first_startup += first.restore_s or 0.0
    g.failures_s = g.downtime_s + g.lost_work_s + (g.startup_s + g.restore_s - first_startup)
    spent = g.checkpoint_stall_s + g.restore_s + g.startup_s + g.downtime_s + g.lost_work_s
    g.useful_s = max(0.0, g.wall_s - spent)
    g.ratio = g.useful_s / g.wall_s if g.wall_s > 0 else None
    return g


# --------------------------------------------------------------- checkpoints


def _checkpoints(
    storage: Storage,
    progress: Callable[[Iterable[int], int, str], Iterable[int]] | None,
    warnings: list[str],
) -> list[Checkpoint]:
    steps = list_committed(storage)
    rows = []
    loop: Iterable[int] = steps if progress is None else progress(steps, len(steps), "manifests")
    for step in loop:
        row = Checkpoint(
            step=step, name=step_dir(step), bytes=None, created=None, status="committed"
        )
        try:
            manifest = CheckpointReader(storage, step).top  # no part read
            row.bytes = sum(int(f["size"]) for f in manifest["files"].values())
            row.created = _number(manifest.get("created"))
        except CorruptCheckpointError as exc:
            row.status, row.error = "corrupt", str(exc)[:500]
            warnings.append(f"checkpoint {row.name} is corrupt: {row.error}")
        except CheckpointError as exc:
            row.status, row.error = "unreadable", str(exc)[:500]
            warnings.append(f"checkpoint {row.name} is unreadable: {row.error}")
        rows.append(row)
    return rows
