"""The mirror: each checkpoint committed on a fast local root, copied to a remote one.

``Checkpointer("runs/exp1", mirror="s3://bucket/exp1", keep=Keep(last=2),
mirror_keep=Keep(last=10, every_steps=10_000))``:

- every persist commits locally first (fast); the persist worker then hands the step to
  a `Mirror` thread, which uploads the committed files (straight from the local files,
  mapped) under the remote root's own commit protocol, checks the remote copy (sizes
  and safetensors headers against the manifest; every part's CRC32 was checked by the
  server on upload), and applies ``mirror_keep`` there;
- local retention never deletes a checkpoint that is not mirrored yet, unless a newer
  one is (when uploads fall behind, the queue keeps only the newest step: older ones
  are superseded, and logged as such);
- restore takes the newest valid checkpoint across both roots, so a job resumes from the
  remote alone on a node with an empty disk.

The remote is not trusted to say what is mirrored: a remote checkpoint counts as a copy
of a local one only if its manifest describes the same content (same tensors by
checksum, same trees) and its files are there with the declared sizes and headers
(`remote_copy_problem`). A step committed remotely by an earlier launch is checked so
before local retention may rely on it, and one that fails (damaged, truncated, or
another checkpoint under the same step) is uploaded again when it is the newest; a
remote step with no local counterpart never licenses a local delete.

A failed upload is retried; if it still fails it is reported (log WARNING, audit, the
``mirror_failed`` alert) and the local copy is kept; `Checkpointer.wait` and ``close``
raise `PersistError` if the newest local checkpoint is not mirrored by then.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from resumable.audit import AuditLog
from resumable.commit import abort_quietly, committer_for, list_committed, step_dir
from resumable.errors import CheckpointError, StorageError
from resumable.format import encode_manifest, manifest_digest, tensor_ranges
from resumable.parts import flatten
from resumable.pipeline.messages import Mirrored, MirrorFailed, MirrorFlushed, Report
from resumable.policy import Keep
from resumable.reader import CheckpointReader
from resumable.retention import apply_retention
from resumable.retrying import retrying
from resumable.storage.base import Storage

log = logging.getLogger(__name__)

Notify = Callable[[Report], None]


def upload_checkpoint(src: Storage, dst: Storage, step: int) -> int:
    """Copy the committed checkpoint ``step`` of ``src`` to ``dst`` and commit it there
    with ``dst``'s own strategy; returns bytes uploaded. The source is fully verified
    first, the copy checked after (sizes and headers). An identical checkpoint already
    committed in ``dst`` counts as done (0 bytes). An incremental checkpoint's own
    files are all it uploads: the checkpoints it refers to are uploaded first where
    ``dst`` lacks them (they are committed there before it, so it is never a
    committed checkpoint whose data is missing)."""
    source = CheckpointReader(src, step)
    source.verify()
    manifest = source.manifest
    committed = list_committed(dst)
    if step in committed:
        problem = remote_copy_problem(dst, step, manifest)
        if problem is None:
            return 0
        log.warning("%s; uploading step %d again", problem, step)
    total = 0
    for k in manifest.get("refs", ()):
        # A copy of k with the same content but another layout (k written again, whole,
        # after resuming from an older step) does not hold the byte ranges referred to.
        if k not in committed or remote_copy_problem(dst, k, CheckpointReader(src, k).manifest):
            total += upload_checkpoint(src, dst, k)
    committer = committer_for(dst)
    attempt = committer.begin(step)
    renamed = {name: attempt.key(name.rsplit("/", 1)[-1]) for name in manifest["files"]}
    relocated = flatten(copy.deepcopy(manifest))  # a split manifest as one (format 4)
    relocated["files"] = {renamed[k]: v for k, v in manifest["files"].items()}
    for info in relocated["tensors"].values():
        if "file" in info:
            info["file"] = renamed[info["file"]]
        for c in [*info.get("chunks", ()), *info.get("sources", ())]:
            if "step" not in c:  # a chunk of another checkpoint is named by basename
                c["file"] = renamed[c["file"]]
    relocated["digest"] = manifest_digest(relocated)
    read = source.storage  # a version 6 checkpoint's files: ranges of its node objects
    try:
        for name, new in renamed.items():
            path = f"{step_dir(step)}/{name}"
            mm = read.map_file(path) if manifest["files"][name]["size"] > 0 else None
            if mm is not None:
                try:
                    total += dst.write(attempt.path(new.rsplit("/", 1)[-1]), [mm])
                finally:
                    mm.close()
            else:
                total += dst.write(attempt.path(new.rsplit("/", 1)[-1]), [read.read(path)])
        blob = encode_manifest(relocated)
        committer.commit(attempt, blob)
    except BaseException:
        abort_quietly(committer, attempt)
        raise
    CheckpointReader(dst, step).check_files()
    return total + len(blob)


def remote_copy_problem(dst: Storage, step: int, manifest: dict[str, Any]) -> str | None:
    """Why the committed checkpoint ``step`` of ``dst`` is not a good copy of the one
    ``manifest`` describes, or None if it is: same content (`_same_content`) and every
    file present with its declared size and a matching safetensors header. Checksums are
    not recomputed (that would download it all); restore verifies them before use."""
    where = f"the copy of step {step} in {dst.url}"
    try:
        reader = CheckpointReader(dst, step)
        if not _same_content(reader.manifest, manifest):
            return f"{where} is another checkpoint than the local one (different content or layout)"
        reader.check_files()
    except (CheckpointError, OSError, ValueError) as exc:
        return f"{where} does not check out: {exc}"
    return None


def _same_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same tensors (by checksum) and trees, laid out alike in data files of the same
    names and sizes: one checkpoint, wherever its files lie. (The layout counts: a later
    incremental checkpoint refers to byte ranges of this one's files.)"""

    def sig(m: dict[str, Any]) -> Any:
        return (
            m["step"],
            json.dumps(m["ranks"], sort_keys=True),
            sorted(
                (
                    k,
                    v.get("xxh3_64"),
                    v["dtype"],
                    tuple(v["shape"]),
                    tuple((s, f.rsplit("/", 1)[-1], b, e) for s, f, b, e in tensor_ranges(v)),
                )
                for k, v in m["tensors"].items()
            ),
            sorted((f.rsplit("/", 1)[-1], i["size"]) for f, i in m["files"].items()),
        )

    return bool(sig(a) == sig(b))


_PERMANENT = (errno.EACCES, errno.ENOTSUP, errno.EEXIST, errno.ENOENT)


class Mirror:
    """The background uploader of one persist worker (see module doc).

    ``on_mirrored(step)`` runs on the mirror thread after each upload (the worker applies
    local retention there); ``notify(message)`` reports to the trainer.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        keep: Keep | None,
        audit: AuditLog,
        notify: Notify,
        on_mirrored: Callable[[int], object] | None = None,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        self.local = local
        self.remote = remote
        self.keep = keep
        self.audit = audit
        self.remote_audit = AuditLog(remote, rank=audit.rank)
        self.notify = notify
        self.on_mirrored = on_mirrored
        self.retries = retries
        self.backoff_s = backoff_s
        self.mirrored: set[int] = set()  # uploaded by this mirror, or checked (see _load_known)
        self._mirrored_lock = threading.Lock()
        self.failed: dict[int, str] = {}
        self._pending: int | None = None
        self._submitted: int | None = None  # newest step handed to this mirror
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._known = False
        self._thread = threading.Thread(target=self._main, name="resumable-mirror", daemon=True)
        self._thread.start()

    def _load_known(self) -> None:
        """A step committed remotely by an earlier launch counts as mirrored only if it
        is a good copy of a local checkpoint (`remote_copy_problem`). Checked newest
        first, up to the first good one (older local steps may go because of it); the
        bad ones are reported and count for nothing."""
        if self._known:
            return
        remote = list_committed(self.remote)
        for step in sorted(set(remote) & set(list_committed(self.local)), reverse=True):
            try:
                local_manifest = CheckpointReader(self.local, step).manifest
            except CheckpointError as exc:
                log.warning("mirror: local %s is unreadable: %s", step_dir(step), exc)
                continue
            problem = remote_copy_problem(self.remote, step, local_manifest)
            if problem is None:
                self._add_mirrored(step)
                break
            log.warning("mirror: %s; it does not count as mirrored", problem)
            self.audit.record("mirror_mismatch", step=step, url=self.remote.url, reason=problem)
        self._known = True

    def _add_mirrored(self, step: int) -> None:
        with self._mirrored_lock:
            self.mirrored.add(step)

    def may_delete_local(self, step: int) -> bool:
        """A local checkpoint may go once it, or a newer one, is mirrored."""
        with self._mirrored_lock:
            return any(m >= step for m in self.mirrored)

    def submit(self, step: int) -> None:
        with self._cond:
            if self._pending is not None and self._pending < step:
                log.info("mirror: step %d superseded by step %d before upload", self._pending, step)
                self.audit.record("mirror_skip", step=self._pending, reason=f"superseded by {step}")
            if self._pending is None or self._pending < step:
                self._pending = step
            self._submitted = max(step, self._submitted if self._submitted is not None else step)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> MirrorFlushed:
        """Wait until nothing is queued or uploading; report the newest step submitted
        and why it is not mirrored, if it is not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
        newest = self._submitted
        error = None
        with self._mirrored_lock:
            done = newest in self.mirrored
        if newest is not None and not done:
            error = self.failed.get(newest, f"step {newest} was not uploaded in time")
        return MirrorFlushed(newest=newest, error=error)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _main(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, self._pending = self._pending, None
                self._busy = True
            try:
                self._mirror(step)
            except Exception as exc:  # pragma: no cover - _mirror reports its own errors
                log.exception("mirror thread error: %s", exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload(self, step: int) -> int:
        def upload() -> int:
            self._load_known()
            return upload_checkpoint(self.local, self.remote, step)

        def on_retry(exc: StorageError, n: int) -> None:
            log.warning(
                "mirror of step %d to %s failed (%s); retry %d", step, self.remote.url, exc, n
            )

        return retrying(
            upload,
            retries=self.retries,
            backoff_s=self.backoff_s,
            permanent=_PERMANENT,
            on_retry=on_retry,
        )

    def _mirror(self, step: int) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._upload(step)
        except Exception as exc:  # reported, never lost; the local copy is kept
            msg = f"mirroring step {step} to {self.remote.url} failed: {type(exc).__name__}: {exc}"
            self.failed[step] = msg
            log.warning("%s; the local copy is kept", msg)
            self.audit.record("failure", step=step, stage="mirror", error=repr(exc)[:500])
            self.notify(MirrorFailed(step=step, error=msg))
            return
        seconds = time.perf_counter() - t0
        self._add_mirrored(step)
        self.failed.pop(step, None)
        self.audit.record(
            "mirror_commit",
            step=step,
            url=self.remote.url,
            bytes=nbytes,
            duration_s=round(seconds, 6),
        )
        self.remote_audit.record("commit", step=step, bytes=nbytes, source=self.local.url)
        self.notify(Mirrored(step=step, bytes=nbytes, seconds=seconds))
        if self.keep is not None and not self.keep.keeps_all:
            try:
                apply_retention(self.remote, self.keep, self.remote_audit, just_written=step)
            except Exception as exc:  # retried after the next upload
                log.warning("retention in %s after step %d failed: %s", self.remote.url, step, exc)
                self.audit.record(
                    "failure", step=step, stage="mirror retention", error=repr(exc)[:500]
                )
        if self.on_mirrored is not None:
            self.on_mirrored(step)
