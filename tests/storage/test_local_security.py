"""The local backend against a hostile or concurrent writer of its checkpoint root.

- Races: a directory on the way to a file is swapped for a symbolic link to a directory
  outside the root at every point of a call (before each filesystem call it makes);
  nothing outside is ever read or touched, and the call either completes inside the
  root or fails with a project error that names the link.
- Links planted at every component (a directory on the way, the final name) for every
  verb.
- FIFOs (and other non-regular files) where a file is expected: refused at once,
  never waited on.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.errors import CheckpointError, CorruptCheckpointError, StorageError
from resumable.storage import LocalStorage

INSIDE, OUTSIDE = b"inside bytes", b"OUTSIDE SECRET, longer"


def tree(base: Path) -> dict[str, Any]:
    """Every entry under ``base``: file bytes, link targets, None for directories."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = None
            else:
                out[str(p)] = p.read_bytes()
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the root that looks like the one a link replaces."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "f.bin").write_bytes(OUTSIDE)
    (d / "only-outside.bin").write_bytes(OUTSIDE)
    (d / "sub" / "g.bin").write_bytes(OUTSIDE)
    return d


# --------------------------------------------------------------------------- races

# Each verb on a path through directory ``stage``; reads say what they returned.
VERBS: dict[str, Callable[[LocalStorage], Any]] = {
    "write": lambda s: s.write("stage/f.bin", [b"new"]),
    "write-new-subdir": lambda s: s.write("stage/new/f.bin", [b"new"]),
    "append": lambda s: s.append("stage/f.bin", b"new"),
    "put_if_absent": lambda s: s.put_if_absent("stage/fresh.bin", b"new"),
    "delete-file": lambda s: s.delete("stage/f.bin"),
    "delete-tree": lambda s: s.delete("stage/sub"),
    "rename_dir": lambda s: s.rename_dir("stage/sub", "stage/renamed"),
    "sync_dir": lambda s: s.sync_dir("stage/sub"),
    "read": lambda s: s.read("stage/f.bin"),
    "read_range": lambda s: s.read_range("stage/f.bin", 0, 5),
    "map_file": lambda s: bytes(s.map_file("stage/f.bin")),
    "size": lambda s: s.size("stage/f.bin"),
    "exists": lambda s: s.exists("stage/only-outside.bin"),
    "list_dir": lambda s: s.list_dir("stage"),
}
READS = {"read", "read_range", "map_file", "size", "exists", "list_dir"}
# What a read may return: the inside file's bytes, size, names (never the outside's).
INSIDE_RESULTS = [INSIDE, INSIDE[:5], len(INSIDE), False, ["f.bin", "sub"]]
HOOKED = ("open", "stat", "listdir", "scandir", "mkdir", "rename", "link", "unlink", "rmdir")


class Swapper:
    """Replaces directory ``root/stage`` by a link to ``outside`` just before the
    ``n``-th filesystem call of the verb under test: after whatever the verb checked
    before that call, as an attacker racing it would."""

    def __init__(self, root: Path, outside: Path, n: int) -> None:
        self.root, self.outside, self.n = root, outside, n
        self.calls = 0
        self.swapped = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in HOOKED:
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.n and not self.swapped:
                self.swapped = True
                Path(self.root / "stage").rename(self.root / "moved")
                Path(self.root / "stage").symlink_to(self.outside, target_is_directory=True)
            return real(*args, **kwargs)

        return hooked


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_directory_swapped_for_a_link_mid_call_is_never_followed(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, verb: str, n: int
) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.write("stage/f.bin", [INSIDE])
    storage.write("stage/sub/g.bin", [INSIDE])
    before = tree(outside)
    swapper = Swapper(storage.root, outside, n)
    swapper.install(monkeypatch)

    try:
        result = VERBS[verb](storage)
    except CheckpointError as exc:
        result = exc
    except OSError as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"bare {type(exc).__name__} instead of a project error: {exc!r}")
    monkeypatch.undo()

    assert tree(outside) == before
    if isinstance(result, CheckpointError):
        assert swapper.swapped, result
        assert "symbolic link" in str(result)
        if verb in READS:
            assert isinstance(result, CorruptCheckpointError)
        else:
            assert isinstance(result, StorageError)
            assert result.errno == errno.ELOOP
    elif verb in READS:
        assert result in INSIDE_RESULTS
    if swapper.swapped and n == 1:  # swapped before the call began: always refused
        assert isinstance(result, CheckpointError)


def _exchange(libc: Any, a: Path, b: Path) -> None:
    """Swap two names atomically (``renameat2(RENAME_EXCHANGE)``)."""
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_writes_racing_a_swapping_thread_stay_inside(tmp_path: Path, outside: Path) -> None:
    """The race with real concurrency: a thread atomically swaps ``stage`` with a link
    out and back, again and again, while files are written into ``stage``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("needs renameat2 (Linux, glibc >= 2.28)")
    storage = LocalStorage(tmp_path / "root")
    storage.write("stage/first.bin", [INSIDE])
    stage, link = storage.root / "stage", storage.root / "link"
    link.symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    stop = threading.Event()
    swaps = 0

    def swap_forever() -> None:
        nonlocal swaps
        while not stop.is_set():
            _exchange(libc, stage, link)
            swaps += 1

    swapper = threading.Thread(target=swap_forever)
    swapper.start()
    errors: list[Exception] = []
    try:
        for i in range(500):
            try:
                storage.write(f"stage/f{i}.bin", [b"data"])
            except (CheckpointError, OSError) as exc:
                errors.append(exc)
    finally:
        stop.set()
        swapper.join()
    assert swaps > 0
    assert tree(outside) == before, f"{len(errors)} of 500 writes refused"
    for exc in errors:
        assert isinstance(exc, StorageError) and exc.errno == errno.ELOOP, repr(exc)
        assert "symbolic link" in str(exc)


# --------------------------------------------------------------------------- planted links


@pytest.fixture(params=["d", "a/d"])
def linked_dir(
    request: pytest.FixtureRequest, tmp_path: Path, outside: Path
) -> tuple[LocalStorage, str]:
    """A root where directory ``d`` (at the top, or one level down) is a link out; and
    the link's path."""
    storage = LocalStorage(tmp_path / "root")
    storage.write("keepdir/keep.bin", [INSIDE])
    link = storage.root / request.param
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    return storage, request.param


LINKED_DIR_READS: dict[str, Callable[[LocalStorage, str], Any]] = {
    "read": lambda s, d: s.read(f"{d}/f.bin"),
    "read_range": lambda s, d: s.read_range(f"{d}/f.bin", 0, 1),
    "map_file": lambda s, d: s.map_file(f"{d}/f.bin"),
    "size": lambda s, d: s.size(f"{d}/f.bin"),
    "exists": lambda s, d: s.exists(f"{d}/only-outside.bin"),
    "list_dir": lambda s, d: s.list_dir(d),
    "list_dir-below": lambda s, d: s.list_dir(f"{d}/sub"),
}
LINKED_DIR_WRITES: dict[str, Callable[[LocalStorage, str], Any]] = {
    "write": lambda s, d: s.write(f"{d}/f.bin", [b"x"]),
    "write-new": lambda s, d: s.write(f"{d}/new/f.bin", [b"x"]),
    "append": lambda s, d: s.append(f"{d}/f.bin", b"x"),
    "put_if_absent": lambda s, d: s.put_if_absent(f"{d}/fresh.bin", b"x"),
    "delete-file": lambda s, d: s.delete(f"{d}/f.bin"),
    "delete-tree": lambda s, d: s.delete(f"{d}/sub"),
    "rename_dir-src": lambda s, d: s.rename_dir(f"{d}/sub", "moved"),
    "rename_dir-dst": lambda s, d: s.rename_dir("keepdir", f"{d}/moved"),
    "sync_dir": lambda s, d: s.sync_dir(d),
}


@pytest.mark.parametrize("verb", sorted(LINKED_DIR_READS))
def test_read_through_a_linked_directory_is_corruption(
    linked_dir: tuple[LocalStorage, str], outside: Path, verb: str
) -> None:
    before = tree(outside)
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link inside the checkpoint"):
        LINKED_DIR_READS[verb](*linked_dir)
    assert tree(outside) == before


@pytest.mark.parametrize("verb", sorted(LINKED_DIR_WRITES))
def test_write_through_a_linked_directory_is_a_storage_error(
    linked_dir: tuple[LocalStorage, str], outside: Path, verb: str
) -> None:
    before = tree(outside)
    with pytest.raises(StorageError, match="is a symbolic link inside the checkpoint") as info:
        LINKED_DIR_WRITES[verb](*linked_dir)
    assert info.value.errno == errno.ELOOP
    assert tree(outside) == before


@pytest.fixture
def linked_names(tmp_path: Path, outside: Path) -> LocalStorage:
    """A root whose real directory ``d`` holds ``f.bin`` and ``sub``, both links out."""
    storage = LocalStorage(tmp_path / "root")
    storage.write("d/keep.bin", [INSIDE])
    (storage.root / "d" / "f.bin").symlink_to(outside / "f.bin")
    (storage.root / "d" / "sub").symlink_to(outside / "sub", target_is_directory=True)
    return storage


@pytest.mark.parametrize(
    "verb",
    [
        lambda s: s.read("d/f.bin"),
        lambda s: s.read_range("d/f.bin", 0, 1),
        lambda s: s.map_file("d/f.bin"),
        lambda s: s.size("d/f.bin"),
        lambda s: s.exists("d/f.bin"),
        lambda s: s.list_dir("d/sub"),
        lambda s: s.read("d/sub/g.bin"),
    ],
    ids=["read", "read_range", "map_file", "size", "exists", "list_dir", "read-below"],
)
def test_reading_a_linked_name_is_corruption(
    linked_names: LocalStorage, outside: Path, verb: Callable[[LocalStorage], Any]
) -> None:
    before = tree(outside)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        verb(linked_names)
    assert tree(outside) == before


@pytest.mark.parametrize(
    "verb",
    [
        lambda s: s.write("d/f.bin", [b"x"]),
        lambda s: s.append("d/f.bin", b"x"),
        lambda s: s.put_if_absent("d/f.bin", b"x"),
        lambda s: s.write("d/sub/g.bin", [b"x"]),
        lambda s: s.rename_dir("d/sub", "moved"),
        lambda s: s.sync_dir("d/sub"),
    ],
    ids=["write", "append", "put_if_absent", "write-below", "rename_dir", "sync_dir"],
)
def test_writing_a_linked_name_is_a_storage_error(
    linked_names: LocalStorage, outside: Path, verb: Callable[[LocalStorage], Any]
) -> None:
    before = tree(outside)
    with pytest.raises(StorageError, match="symbolic link") as info:
        verb(linked_names)
    assert info.value.errno == errno.ELOOP
    assert tree(outside) == before
    assert linked_names.list_dir("d") == ["f.bin", "keep.bin", "sub"]


def test_deleting_a_link_removes_the_link_not_its_target(
    linked_names: LocalStorage, outside: Path
) -> None:
    before = tree(outside)
    linked_names.delete("d/f.bin")
    linked_names.delete("d/sub")
    assert linked_names.list_dir("d") == ["keep.bin"]
    assert tree(outside) == before


def test_deleting_a_tree_never_follows_links_inside_it(tmp_path: Path, outside: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.write("t/a/b/f.bin", [INSIDE])
    (storage.root / "t" / "a" / "out").symlink_to(outside, target_is_directory=True)
    (storage.root / "t" / "a" / "b" / "f-out.bin").symlink_to(outside / "f.bin")
    before = tree(outside)

    storage.delete("t")

    assert storage.list_dir("") == []
    assert tree(outside) == before


def test_deleting_the_root_empties_it_without_following_links(
    tmp_path: Path, outside: Path
) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.write("t/f.bin", [INSIDE])
    (storage.root / "out").symlink_to(outside, target_is_directory=True)
    before = tree(outside)

    storage.delete("")

    assert not storage.root.exists()
    assert tree(outside) == before


def test_a_root_recreated_between_calls_is_used_afresh(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.write("a.bin", [b"first"])
    os.rename(storage.root, tmp_path / "old-root")

    storage.write("b.bin", [b"second"])

    assert storage.list_dir("") == ["b.bin"]
    assert (tmp_path / "root" / "b.bin").read_bytes() == b"second"


# --------------------------------------------------------------------------- FIFOs


def run_bounded(call: Callable[[], Any], fifo: Path, timeout: float = 10.0) -> Any:
    """``call()``'s result or raised exception; fails (instead of hanging) if it is still
    running after ``timeout`` seconds, then unblocks it by opening the FIFO's both ends."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:
            box["result"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a peer for the stuck open()
        thread.join(1.0)
        os.close(fd)
        thread.join(1.0)
        pytest.fail(f"still blocked on the FIFO {fifo} after {timeout} s")
    return box["result"]


@pytest.fixture
def with_fifo(tmp_path: Path) -> LocalStorage:
    """A root whose ``d/f.bin`` is a FIFO nobody has opened."""
    storage = LocalStorage(tmp_path / "root")
    storage.write("d/keep.bin", [INSIDE])
    os.mkfifo(storage.root / "d" / "f.bin")
    return storage


FIFO_READS: dict[str, Callable[[LocalStorage], Any]] = {
    "read": lambda s: s.read("d/f.bin"),
    "read_range": lambda s: s.read_range("d/f.bin", 0, 0),
    "read_into": lambda s: s.read_into("d/f.bin", 0, memoryview(bytearray(1))),
    "map_file": lambda s: s.map_file("d/f.bin"),
    "size": lambda s: s.size("d/f.bin"),
}
FIFO_WRITES: dict[str, Callable[[LocalStorage], Any]] = {
    "write": lambda s: s.write("d/f.bin", [b"x"]),
    "append": lambda s: s.append("d/f.bin", b"x"),
}


@pytest.mark.parametrize("verb", sorted(FIFO_READS))
def test_reading_a_fifo_is_refused_at_once(with_fifo: LocalStorage, verb: str) -> None:
    result = run_bounded(lambda: FIFO_READS[verb](with_fifo), with_fifo.root / "d" / "f.bin")
    assert isinstance(result, CorruptCheckpointError), result
    assert "FIFO" in str(result) and "f.bin" in str(result)


@pytest.mark.parametrize("reader", [False, True], ids=["no-reader", "reader-attached"])
@pytest.mark.parametrize("verb", sorted(FIFO_WRITES))
def test_writing_a_fifo_is_refused_at_once(
    with_fifo: LocalStorage, verb: str, reader: bool
) -> None:
    fifo = with_fifo.root / "d" / "f.bin"
    peer = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    try:
        result = run_bounded(lambda: FIFO_WRITES[verb](with_fifo), fifo)
        if peer is not None:
            assert os.read(peer, 10) == b""  # nothing was written into the pipe
    finally:
        if peer is not None:
            os.close(peer)
    assert isinstance(result, StorageError), result
    assert "FIFO" in str(result)


def test_a_fifo_is_listed_seen_and_deletable_without_blocking(with_fifo: LocalStorage) -> None:
    fifo = with_fifo.root / "d" / "f.bin"
    assert run_bounded(lambda: with_fifo.exists("d/f.bin"), fifo) is True
    assert run_bounded(lambda: with_fifo.list_dir("d"), fifo) == ["f.bin", "keep.bin"]
    assert run_bounded(lambda: with_fifo.list_dir("d/f.bin"), fifo) == []
    assert run_bounded(lambda: with_fifo.put_if_absent("d/f.bin", b"x"), fifo) is False
    run_bounded(lambda: with_fifo.delete("d/f.bin"), fifo)
    assert with_fifo.list_dir("d") == ["keep.bin"]


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[LocalStorage]:
    """A root whose ``d/f.bin`` is a listening Unix socket."""
    storage = LocalStorage(tmp_path / "root")
    storage.write("d/keep.bin", [INSIDE])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(storage.root / "d" / "f.bin"))
    try:
        yield storage
    finally:
        sock.close()


def test_other_special_files_and_directories_are_refused_too(
    unix_socket: LocalStorage,
) -> None:
    with pytest.raises(CorruptCheckpointError, match="is a socket, not a regular file"):
        unix_socket.read("d/f.bin")
    with pytest.raises(CorruptCheckpointError, match="is a socket, not a regular file"):
        unix_socket.size("d/f.bin")
    with pytest.raises(CorruptCheckpointError, match="is a directory, not a regular file"):
        unix_socket.read("d")
    with pytest.raises(StorageError, match="is a directory, not a regular file"):
        unix_socket.write("d", [b"x"])
    with pytest.raises(
        StorageError, match=r"'d/keep\.bin' in its path is a regular file, not a dir"
    ):
        unix_socket.write("d/keep.bin/x.bin", [b"x"])


def test_deleting_an_absurdly_deep_tree_is_a_storage_error(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.write("/".join(["d"] * 100) + "/f.bin", [INSIDE])

    with pytest.raises(StorageError, match="nested deeper than"):
        storage.delete("d")
