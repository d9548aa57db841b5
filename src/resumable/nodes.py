"""One object per node: the ranks of a node write their data files and parts into one
object of the checkpoint instead of two each (format version 6; 7 since the parts are
gzip'd).

What it is for: an object store's cost per checkpoint grows with its objects, not its
bytes. Retention deletes every object of a checkpoint, and at 4,096 ranks the server's
deletes of 8,196 objects alone took longer than the goal of a second (docs/scale.md).
With the ranks of each node sharing an object, a checkpoint has one object per node.

How, on each rank of a coordinated persist (`resumable.pipeline.write.write_distributed`
with a `NodeObjects`):

1. it writes its data file and its part, as ever, but into a staging directory on its
   node (`NodeObjects.staging`, local disk: no fsync, nobody reads it after a crash),
   and tells its node's leader (the lowest rank of the node) their sizes;
2. the leader uploads the node's files one after the other as one object
   (``node-<leader>.bin`` in the attempt), mapped from the staging files, and reports
   where each lies (its *segments*) to rank 0 with its own report;
3. rank 0 commits a top manifest (version 7, as 6 was) that maps every data file and part to its
   ``{object, offset}`` (`resumable.format.check_segments` validates it); every rank
   removes its staged files once the outcome is known, committed or not.

A reader wraps its storage in a `SegmentView` (`resumable.reader.CheckpointReader`
does it once it has read such a manifest): the data file and part paths read as ranges
of their node's object, so every reader (restore, `verify`, `export`, the reshard, the
mirror's upload) reads version 6 unchanged. A failed rank or leader still fails the
whole commit, as with a file per rank.

Trade-offs: the node's bytes go through local storage once more (in the background, so
the training stall is unchanged) and one process uploads them. An S3 multipart upload
with each rank sending its own parts would avoid the copy but fails wherever a rank's
last part is under 5 MiB and not the object's last (``EntityTooSmall`` on AWS and MinIO).
Incremental checkpoints are written whole in this mode: their chunks refer to byte
ranges of earlier files, which would then lie in earlier segments (not built).
The ranks of a node must be numbered contiguously (torchrun's numbering): a leader
refuses, naming the rank, a member that reports another node.
Why: docs/decisions.md, "One object per node".
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from resumable import settings
from resumable.errors import CorruptCheckpointError
from resumable.format import checksum
from resumable.storage.base import Buffer, ForwardingStorage, Storage


def node_file(leader: int) -> str:
    """Name of the object of the node whose lowest rank is ``leader``."""
    return f"node-{leader:05d}.bin"


@dataclass(frozen=True)
class NodeObjects:
    """Where this rank stands in its node, for one object per node: ``leader`` is the
    node's lowest rank, ``size`` its number of ranks (ranks ``leader .. leader+size-1``),
    ``node`` its identity (`resumable.replicas.domains.RankPlace.node`) and ``staging``
    a directory on this node's local storage that its ranks share."""

    leader: int
    size: int
    node: str
    staging: str

    @property
    def members(self) -> list[int]:
        return list(range(self.leader, self.leader + self.size))

    def job(self) -> dict[str, Any]:
        """As the fields of a persist job (`from_job` reads them back)."""
        return {"leader": self.leader, "size": self.size, "node": self.node, "dir": self.staging}

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> NodeObjects:
        return cls(int(job["leader"]), int(job["size"]), str(job["node"]), str(job["dir"]))

    @classmethod
    def from_env(cls, staging: str | None = None) -> NodeObjects:
        """This rank's node from torchrun's variables (`place_from_env`): its ranks are
        ``RANK - LOCAL_RANK`` on, ``LOCAL_WORLD_SIZE`` of them. ``staging``: the
        directory (default ``$RESUMABLE_NODE_STAGING``, else the temporary directory's
        ``resumable-nodes``)."""
        from resumable.replicas.domains import place_from_env

        place = place_from_env()
        where = staging or settings.NODE_STAGING.read() or ""
        if not where:
            where = os.path.join(tempfile.gettempdir(), "resumable-nodes")
        return cls(place.rank - place.local_rank, place.local_world_size, place.node, where)


STALE_STAGING_S = 6 * 3600.0
"""How long a staged persist's directory may stay untouched before `Staging.sweep` takes
it for the leftover of a killed rank (a leader waits `dist_timeout_s` for its node, 600 s
by default, and uploads in minutes)."""
_STAGED_DIR = re.compile(r"[0-9a-f]{16}")


class Staging:
    """One persist's staged files on this node: a directory named after the attempt,
    written without fsync (nobody reads them after a crash), removed by each rank for
    its own files once the outcome is known."""

    def __init__(self, nodes: NodeObjects, attempt_path: str) -> None:
        self.dir = os.path.join(nodes.staging, checksum(attempt_path.encode()))

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write ``chunks`` as the staged file ``path`` (a name in this directory)."""
        os.makedirs(self.dir, exist_ok=True)
        n = 0
        with open(self.path(path.rsplit("/", 1)[-1]), "wb") as f:
            for c in chunks:
                n += f.write(c)
        return n

    def mapped(self, name: str, size: int) -> Buffer:
        """The staged file ``name``, mapped (its bytes for an upload), checked to hold
        ``size`` bytes."""
        with open(self.path(name), "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise OSError(f"staged {self.path(name)} has {actual} bytes, expected {size}")
            if size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def remove(self, names: Iterable[str]) -> None:
        """Remove this rank's staged files, and the directory once empty."""
        for name in names:
            try:
                os.unlink(self.path(name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass  # another rank's files are still there, or it is gone already

    @staticmethod
    def sweep(staging: str, older_than_s: float = STALE_STAGING_S) -> list[str]:
        """Remove the persists' directories in ``staging`` untouched for ``older_than_s``
        (left by ranks killed while they staged: a live persist's leader gives up long
        before); returns their names. Only names a `Staging` makes are touched."""
        try:
            names = os.listdir(staging)
        except OSError:
            return []
        now, gone = time.time(), []
        for name in names:
            path = os.path.join(staging, name)
            try:
                if not _STAGED_DIR.fullmatch(name) or now - os.stat(path).st_mtime < older_than_s:
                    continue
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
        return gone


class SegmentView(ForwardingStorage):
    """``inner``, with each data file and part of a version 6 checkpoint in directory
    ``dirname`` read as its range of its node's object (`format.check_segments` checked
    every range lies inside its object). The size of a file is its segment's, once its
    object is found at the size the manifest declares (a grown or cut object is
    refused as a grown or cut file is). Everything else passes through."""

    def __init__(self, inner: Storage, dirname: str, top: Mapping[str, Any]) -> None:
        super().__init__(inner)
        sizes = {f: int(info["size"]) for f, info in top["files"].items()}
        sizes.update({p["file"]: int(p["size"]) for p in top["parts"]})
        self._segments: dict[str, tuple[str, int, int]] = {
            f"{dirname}/{name}": (f"{dirname}/{seg['object']}", int(seg["offset"]), sizes[name])
            for name, seg in top["segments"].items()
        }
        self._objects = {f"{dirname}/{k}": int(v["size"]) for k, v in top["objects"].items()}

    def _at(self, path: str, offset: int, length: int) -> tuple[str, int]:
        obj, base, size = self._segments[path]
        if offset < 0 or offset + length > size:
            raise CorruptCheckpointError(
                f"{self.join(self.url, path)}: bytes [{offset}, {offset + length}) are past "
                f"its {size} bytes in {obj}"
            )
        return obj, base + offset

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if path not in self._segments:
            return self.inner.read_range(path, offset, length)
        obj, at = self._at(path, offset, length)
        return self.inner.read_range(obj, at, length) if length else b""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if path not in self._segments:
            self.inner.read_into(path, offset, out)
            return
        obj, at = self._at(path, offset, out.nbytes)
        self.inner.read_into(obj, at, out)

    def size(self, path: str) -> int:
        if path not in self._segments:
            return self.inner.size(path)
        obj, _, size = self._segments[path]
        actual = self.inner.size(obj)  # missing: FileNotFoundError, as for a file
        if actual != self._objects[obj]:
            raise CorruptCheckpointError(
                f"{self.join(self.url, obj)} has {actual} bytes, its manifest declares "
                f"{self._objects[obj]} (truncated or overwritten)"
            )
        return size

    def exists(self, path: str) -> bool:
        if path not in self._segments:
            return self.inner.exists(path)
        return self.inner.exists(self._segments[path][0])

    def map_file(
        self, path: str, span: tuple[int, int] | list[tuple[int, int]] | None = None
    ) -> mmap.mmap | None:
        if path in self._segments:
            return None  # readers then read the range (`read_into`)
        return self.inner.map_file(path, span)

    def read(self, path: str) -> bytes:
        if path not in self._segments:
            return self.inner.read(path)
        return self.read_range(path, 0, self.size(path))
