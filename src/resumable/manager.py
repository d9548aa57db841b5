"""`Checkpointer`: the one object a training script talks to.

It wires the layers: capture the state, snapshot it into the arena (the only blocking
part), persist and commit it, apply retention, and record everything in the audit log.
On ``restore()`` it finds the newest *valid* checkpoint, verifying before touching the
live objects, and skips corrupt ones with a WARNING; it refuses to start over silently
when checkpoints exist but none is valid.

Threading contract: every public method is called from the training thread (the one
that owns ``state``). Persistence is synchronous in this version: ``save`` returns after
the commit is durable. Errors of a save are raised by that ``save``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from resumable import capture as capture_mod
from resumable.audit import AuditLog
from resumable.commit import RenameCommit, list_committed, parse_step_dir, step_dir
from resumable.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from resumable.persist import PersistResult, write_checkpoint
from resumable.policy import Entry, Every, Keep
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage import Storage, open_storage

log = logging.getLogger("resumable")

PINS_DIR = "pins"
DEFAULT_KEEP = Keep(last=3)


class Checkpointer:
    """Checkpoints ``state`` into ``url`` and puts it back on the next launch.

    Args:
        url: a local directory, ``file://`` URL or ``memory://name`` (tests).
        state: named objects with ``state_dict()``/``load_state_dict()``, plain
            containers of tensors and JSON values, or generators.
        persist_every: when `maybe_save` saves (default every 100 steps).
        keep: retention applied after each commit (default the 3 newest); ``None`` keeps all.
        map_location: device (or callable mapping a recorded device string to one) for
            tensors that are rebuilt rather than copied into existing ones.
        capture_rng: also capture Python, NumPy, torch CPU and CUDA random streams.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Storage,
        state: Mapping[str, Any],
        *,
        persist_every: Every | None = None,
        keep: Keep | None = DEFAULT_KEEP,
        map_location: Any = None,
        capture_rng: bool = True,
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict of named objects, found {type(state).__name__}")
        self.storage = open_storage(url)
        self.url = self.storage.url
        self.state = state
        self.persist_every = persist_every if persist_every is not None else Every(steps=100)
        self.keep = keep
        self.map_location = map_location
        self.capture_rng = capture_rng
        self.audit = AuditLog(self.storage)
        self._committer = RenameCommit(self.storage)
        self._arena = Arena()
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._metrics_cache: dict[int, Mapping[str, Any]] = {}
        self._closed = False
        self.last_result: PersistResult | None = None
        self._remove_stale()

    # ------------------------------------------------------------------ saving

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> PersistResult:
        """Checkpoint the state as of ``step`` now, and commit it.

        On return the checkpoint is committed and durable. Raises on failure; nothing
        committed earlier is lost.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        captured = capture_mod.capture(self.state, include_rng=self.capture_rng)
        snap = self._arena.snapshot(captured.tensors)
        blocked = time.perf_counter() - t0
        self.audit.record("save_start", step=step, bytes=snap.nbytes, snapshot_s=round(blocked, 6))
        try:
            result = write_checkpoint(
                self.storage,
                self._committer,
                step=step,
                snapshot=snap,
                tree=captured.tree,
                metrics=metrics,
            )
        except BaseException as exc:
            self.audit.record("failure", step=step, error=repr(exc)[:500])
            log.error("saving step %d to %s failed: %s", step, self.url, exc)
            raise
        self.audit.record(
            "commit",
            step=step,
            bytes=result.nbytes,
            duration_s=round(result.seconds + blocked, 6),
            snapshot_s=round(blocked, 6),
            replaced=result.replaced,
            metrics=result.manifest["metrics"],
        )
        self._metrics_cache[step] = result.manifest["metrics"]
        self._last_step = step
        self._last_time = time.monotonic()
        self.last_result = result
        self._apply_retention(just_written=step)
        return result

    def maybe_save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Save if the ``persist_every`` policy says so; returns whether it saved."""
        self._check_open()
        due = self.persist_every.due(
            step, last_step=self._last_step, since_last_s=time.monotonic() - self._last_time
        )
        if due:
            self.save(step, metrics)
        return due

    def wait(self) -> None:
        """Block until every pending persist committed, or raise its error. Saves are
        synchronous in this version, so there is never anything pending."""
        self._check_open()

    def close(self) -> None:
        """Wait for pending work and release resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.storage.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Steps of committed checkpoints, ascending (validity not checked)."""
        return list_committed(self.storage)

    def restore(self, step: int | None = None, *, map_location: Any = None) -> int:
        """Load the newest valid checkpoint (or ``step``) into ``state``.

        Returns the restored step, or 0 when there is no checkpoint at all. Corrupt
        checkpoints are skipped with a WARNING; if checkpoints exist and none is valid,
        raises `CorruptCheckpointError` rather than starting over.
        """
        self._check_open()
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise NoCheckpointError(
                    f"no committed checkpoint for step {step} in {self.url}; "
                    f"committed steps: {steps[-10:] or 'none'}"
                )
            candidates = [step]
        else:
            candidates = list(reversed(steps))
        if not candidates:
            self.audit.record("restore", step=0, fresh=True)
            return 0
        problems = []
        for s in candidates:
            t0 = time.perf_counter()
            try:
                reader = CheckpointReader(self.storage, s)
                reader.check_files()
                tensors = reader.tensors(verify=True)
                values = capture_mod.decode(reader.tree, tensors, map_location or self.map_location)
            except CorruptCheckpointError as exc:
                log.warning("skipping corrupt checkpoint %s: %s", step_dir(s), exc)
                self.audit.record("skip", step=s, reason=str(exc)[:500])
                problems.append(f"{step_dir(s)}: {exc}")
                if step is not None:
                    raise
                continue
            capture_mod.restore(self.state, values)
            nbytes = sum(f["size"] for f in reader.manifest["files"].values())
            self.audit.record(
                "restore", step=s, bytes=nbytes, duration_s=round(time.perf_counter() - t0, 6)
            )
            self._last_step = s
            self._last_time = time.monotonic()
            return s
        raise CorruptCheckpointError(
            f"{len(candidates)} checkpoint(s) in {self.url} and none is valid; refusing to "
            "start over silently. Inspect them with `resumable verify`, or move the "
            "directory away to start fresh. Problems: " + "; ".join(problems)
        )

    # ------------------------------------------------------------------ pinning

    def pin(self, step: int) -> None:
        """Exempt a committed checkpoint from retention."""
        if step not in self.steps():
            raise NoCheckpointError(f"no committed checkpoint for step {step} in {self.url}")
        self.storage.write(f"{PINS_DIR}/{step_dir(step)}", [b""])
        self.audit.record("pin", step=step)

    def unpin(self, step: int) -> None:
        self.storage.delete(f"{PINS_DIR}/{step_dir(step)}")
        self.audit.record("unpin", step=step)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer for {self.url} is closed")

    def _remove_stale(self) -> None:
        for name in self._committer.stale():
            try:
                self.storage.delete(name)
            except CheckpointError as exc:
                log.warning("could not remove stale %s: %s", name, exc)
                continue
            log.info("removed stale staging directory %s", name)
            self.audit.record("stale_removed", name=name)

    def _apply_retention(self, *, just_written: int) -> None:
        if self.keep is None or self.keep.keeps_all:
            return
        apply_retention(
            self.storage,
            self.keep,
            self.audit,
            just_written=just_written,
            cache=self._metrics_cache,
        )


def pinned_steps(storage: Storage) -> set[int]:
    return {s for s in (parse_step_dir(n) for n in storage.list_dir(PINS_DIR)) if s is not None}


def apply_retention(
    storage: Storage,
    keep: Keep,
    audit: AuditLog,
    *,
    just_written: int | None = None,
    cache: dict[int, Mapping[str, Any]] | None = None,
    dry_run: bool = False,
) -> list[int]:
    """Delete committed checkpoints that ``keep`` does not retain; returns their steps.

    Only ``step-N`` directories whose manifest parses as a resumable manifest are
    candidates (anything else was not written by resumable, or is damaged and left for
    an operator). The checkpoint just written and pinned ones are never deleted, so at
    least one committed checkpoint always remains.
    """
    cache = cache if cache is not None else {}
    entries = []
    for s in list_committed(storage):
        if s not in cache:
            try:
                cache[s] = CheckpointReader(storage, s).manifest["metrics"]
            except CheckpointError as exc:
                log.warning("retention ignores %s: %s", step_dir(s), exc)
                continue
        entries.append(Entry(s, cache[s]))
    pinned = pinned_steps(storage)
    if just_written is not None:
        pinned.add(just_written)
    doomed = keep.to_delete(entries, pinned)
    if dry_run:
        return doomed
    committer = RenameCommit(storage)
    for s in doomed:
        committer.delete(s)
        cache.pop(s, None)
        audit.record("delete", step=s, reason="retention")
        log.info("retention deleted %s", step_dir(s))
    return doomed
