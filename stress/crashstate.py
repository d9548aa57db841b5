"""What a power loss can leave on disk, given the operations a process made.

`FsModel` replays an op log (`stress.fsops.Op`) over an in-memory file system that
remembers, for every directory, the entries made durable by its last ``fsync`` and the
changes since (each an atomic change: a rename inside one directory is one change), and
for every file, its bytes as of its last ``fsync`` and now. `crash_state` then builds one
state a power loss at that point could leave, from a `Choice`:

- each directory keeps its durable entries plus a *prefix* of its pending changes (the
  POSIX model: a directory's entries are durable only after that directory is synced;
  changes to one directory are not reordered, changes to different ones are
  independent);
- each file is, independently: as of its last fsync (unsynced writes dropped), as now
  (all kept), torn at a 4 KiB page boundary (pages before it new, after it old), or
  its new size with the unsynced bytes read as zeros (size persisted without data).

This is stricter than ext4's ordered mode (which journals metadata in order) and
weaker than nothing: a save path that is correct here is correct on any file system
that honours ``fsync`` of files and directories.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

from stress.fsops import Op

PAGE = 4096
FILE_MODES = ("synced", "all", "torn", "zeros")


@dataclass
class Inode:
    ino: int
    is_dir: bool
    entries: dict[str, int] = field(default_factory=dict)  # live (directories)
    durable: dict[str, int] = field(default_factory=dict)
    pending: list[dict[str, int | None]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)  # live (files)
    synced: bytes = b""


@dataclass(frozen=True)
class Choice:
    """One crash state's choices: how many pending changes each directory keeps and
    what becomes of each file's unsynced bytes (mode, and the tear's page)."""

    dirs: tuple[tuple[int, int], ...]  # (inode, changes kept)
    files: tuple[tuple[int, str, int], ...]  # (inode, mode, page of the tear)


class FsModel:
    """The durable and live state of the root after a prefix of an op log."""

    def __init__(self, initial: dict[str, bytes | None]) -> None:
        """``initial``: the root's content when recording started, all of it durable
        (``path -> bytes`` for files, ``None`` for directories; parents first)."""
        self.inodes: dict[int, Inode] = {0: Inode(0, True)}
        for path, data in initial.items():
            parent, name = self._parent(path)
            node = self._new(data is None)
            if data is not None:
                node.data = bytearray(data)
                node.synced = data
            parent.entries[name] = node.ino
            parent.durable[name] = node.ino

    def _new(self, is_dir: bool) -> Inode:
        node = Inode(len(self.inodes), is_dir)
        self.inodes[node.ino] = node
        return node

    def _lookup(self, path: str) -> Inode:
        node = self.inodes[0]
        for part in [p for p in path.split("/") if p]:
            node = self.inodes[node.entries[part]]
        return node

    def _parent(self, path: str) -> tuple[Inode, str]:
        head, _, name = path.rpartition("/")
        return self._lookup(head), name

    def apply(self, op: Op) -> None:
        kind = op[0]
        if kind == "mark":
            return
        if kind in ("mkdir", "create"):
            parent, name = self._parent(op[1])
            node = self._new(kind == "mkdir")
            parent.entries[name] = node.ino
            parent.pending.append({name: node.ino})
        elif kind == "truncate":
            self._lookup(op[1]).data = bytearray()
        elif kind == "write":
            node = self._lookup(op[1])
            offset, data = op[2], op[3]
            if len(node.data) < offset:
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset : offset + len(data)] = data
        elif kind == "fsync":
            node = self._lookup(op[1])
            if node.is_dir:
                node.durable = dict(node.entries)
                node.pending.clear()
            else:
                node.synced = bytes(node.data)
        elif kind in ("unlink", "rmdir"):
            parent, name = self._parent(op[1])
            del parent.entries[name]
            parent.pending.append({name: None})
        elif kind in ("rename", "link"):
            sp, sn = self._parent(op[1])
            dp, dn = self._parent(op[2])
            ino = sp.entries[sn]
            if kind == "rename":
                del sp.entries[sn]
            dp.entries[dn] = ino
            if sp is dp:
                change: dict[str, int | None] = {dn: ino}
                if kind == "rename":
                    change = {sn: None, dn: ino}
                dp.pending.append(change)
            else:
                if kind == "rename":
                    sp.pending.append({sn: None})
                dp.pending.append({dn: ino})
        else:
            raise ValueError(f"unknown op {kind!r}")

    # ------------------------------------------------------------------ crash states

    def volatile(self) -> tuple[list[Inode], list[Inode]]:
        """Directories with pending changes and files with unsynced bytes."""
        dirs = [n for n in self.inodes.values() if n.is_dir and n.pending]
        files = [n for n in self.inodes.values() if not n.is_dir and bytes(n.data) != n.synced]
        return dirs, files

    def choices(self, rng: random.Random, variants: int) -> Iterator[Choice]:
        """Everything lost, everything kept, then ``variants`` random mixes."""
        dirs, files = self.volatile()
        yield Choice(tuple((d.ino, 0) for d in dirs), tuple((f.ino, "synced", 0) for f in files))
        yield Choice(
            tuple((d.ino, len(d.pending)) for d in dirs), tuple((f.ino, "all", 0) for f in files)
        )
        if not dirs and not files:
            return
        for _ in range(variants):
            yield Choice(
                tuple((d.ino, rng.randint(0, len(d.pending))) for d in dirs),
                tuple(
                    (f.ino, rng.choice(FILE_MODES), rng.randint(0, len(f.data) // PAGE))
                    for f in files
                ),
            )

    def crash_state(self, choice: Choice) -> dict[str, bytes | None]:
        """The root's content after a crash with ``choice``: ``path -> bytes`` (files)
        or ``None`` (directories), parents before children."""
        kept = dict(choice.dirs)
        fate = {ino: (mode, page) for ino, mode, page in choice.files}
        out: dict[str, bytes | None] = {}

        def entries(node: Inode) -> dict[str, int]:
            e = dict(node.durable)
            for change in node.pending[: kept.get(node.ino, 0)]:
                for name, ino in change.items():
                    if ino is None:
                        e.pop(name, None)
                    else:
                        e[name] = ino
            return e

        def content(node: Inode) -> bytes:
            if node.ino not in fate:
                return node.synced
            mode, page = fate[node.ino]
            new, old = bytes(node.data), node.synced
            if mode == "synced":
                return old
            if mode == "all":
                return new
            base = old[: len(new)].ljust(len(new), b"\0")
            if mode == "zeros":
                return base
            cut = min(page * PAGE, len(new))
            return new[:cut] + base[cut:]

        def walk(node: Inode, prefix: str, depth: int) -> None:
            if depth > 32:
                return
            for name, ino in sorted(entries(node).items()):
                child = self.inodes[ino]
                path = f"{prefix}{name}"
                if child.is_dir:
                    out[path] = None
                    walk(child, path + "/", depth + 1)
                else:
                    out[path] = content(child)

        walk(self.inodes[0], "", 0)
        return out


def fingerprint(state: dict[str, bytes | None]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path, data in state.items():
        h.update(path.encode() + b"\0")
        h.update(b"D" if data is None else hashlib.blake2b(data, digest_size=16).digest())
    return h.hexdigest()


def materialise(state: dict[str, bytes | None], root: str) -> None:
    """Make directory ``root`` hold exactly ``state``."""
    shutil.rmtree(root, ignore_errors=True)
    os.mkdir(root)
    for path, data in state.items():
        full = os.path.join(root, path)
        if data is None:
            os.mkdir(full)
        else:
            with open(full, "wb") as f:
                f.write(data)


def snapshot_tree(root: str) -> dict[str, bytes | None]:
    """The content of directory ``root`` as `FsModel` takes it (parents first)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel + "/"
        for d in dirnames:
            out[prefix + d] = None
        for f in sorted(filenames):
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[prefix + f] = fh.read()
    return out
