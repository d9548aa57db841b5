"""The contract of `resumable.storage.base.Storage`, run against every backend.

Tests taking ``storage`` run once per backend listed in ``conftest.BACKENDS``; tests
taking ``local_storage`` cover what only a filesystem has (symlinks, fsync, a full
disk).
"""

from __future__ import annotations

import array
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from resumable.storage import LocalStorage, Storage


def _chunks(*parts: Any) -> Iterator[Any]:
    """A one-shot iterator, as a persist worker hands chunks over."""
    yield from parts


def _needs_rename(storage: Storage) -> None:
    if not storage.supports_rename:
        pytest.skip(f"{type(storage).__name__} has no atomic rename")


# --------------------------------------------------------------------------- write / read


def test_write_read_round_trip_of_mixed_chunks(storage: Storage) -> None:
    floats = array.array("d", [1.5, -2.25, 3.0])
    parts = [b"head", bytearray(b"-mid-"), memoryview(b"xxtailxx")[2:6], memoryview(floats)]
    expected = b"head-mid-tail" + floats.tobytes()

    n = storage.write("ckpt/data.bin", _chunks(*parts))

    assert n == len(expected)
    assert storage.read("ckpt/data.bin") == expected
    assert storage.size("ckpt/data.bin") == len(expected)


def test_multi_chunk_write_of_megabytes(storage: Storage) -> None:
    chunks = [bytes([i]) * ((1 << 20) + 7 * i) for i in range(1, 4)]
    expected = b"".join(chunks)

    n = storage.write("big.bin", [memoryview(c) for c in chunks])

    assert n == len(expected)
    assert storage.size("big.bin") == len(expected)
    assert bytes(storage.read("big.bin")) == expected
    start = len(chunks[0]) - 3
    assert bytes(storage.read_range("big.bin", start, 10)) == expected[start : start + 10]


@pytest.mark.parametrize("chunks", [[], [b""], [b"", bytearray(), memoryview(b"")]])
def test_empty_file(storage: Storage, chunks: list[Any]) -> None:
    assert storage.write("empty.bin", chunks) == 0

    assert storage.exists("empty.bin")
    assert storage.size("empty.bin") == 0
    assert storage.read("empty.bin") == b""
    assert storage.read_range("empty.bin", 0, 0) == b""
    assert storage.list_dir("") == ["empty.bin"]


def test_write_replaces_longer_content(storage: Storage) -> None:
    storage.write("f.bin", [b"0123456789"])
    storage.write("f.bin", [b"abc"])

    assert storage.read("f.bin") == b"abc"
    assert storage.size("f.bin") == 3


def test_read_range_returns_exactly_the_range(storage: Storage) -> None:
    data = bytes(range(256))
    storage.write("d/r.bin", [data])

    for offset, length in [(0, 256), (0, 1), (255, 1), (10, 0), (17, 100), (256, 0)]:
        assert (
            bytes(storage.read_range("d/r.bin", offset, length)) == data[offset : offset + length]
        ), (offset, length)


@pytest.mark.parametrize(("offset", "length"), [(0, 11), (5, 6), (10, 1), (11, 1), (100, 4)])
def test_read_range_past_the_end_is_corruption(storage: Storage, offset: int, length: int) -> None:
    storage.write("short.bin", [b"0123456789"])

    with pytest.raises(CorruptCheckpointError, match=r"short\.bin"):
        storage.read_range("short.bin", offset, length)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.read("missing.bin"),
        lambda s: s.read("no/such/dir/file.bin"),
        lambda s: s.read_range("missing.bin", 0, 1),
        lambda s: s.read_range("missing.bin", 0, 0),
        lambda s: s.size("missing.bin"),
    ],
    ids=["read", "read-nested", "read_range", "read_range-empty", "size"],
)
def test_missing_file_raises_no_checkpoint_error(
    storage: Storage, call: Callable[[Storage], Any]
) -> None:
    storage.write("other.bin", [b"x"])

    with pytest.raises(NoCheckpointError) as info:
        call(storage)
    assert isinstance(info.value, FileNotFoundError)


def test_size_of_files(storage: Storage) -> None:
    storage.write("a.bin", [b"x" * 1234])
    storage.write("dir/b.bin", [b"y", b"z" * 99])

    assert storage.size("a.bin") == 1234
    assert storage.size("dir/b.bin") == 100


# --------------------------------------------------------------------------- listing


def test_list_dir_gives_sorted_direct_children(storage: Storage) -> None:
    for path in ["b.txt", "a/x.bin", "a/y/z.bin", "c/deep/er/f.bin", "A.txt", "ab.txt"]:
        storage.write(path, [b"."])

    assert storage.list_dir("") == sorted(["A.txt", "a", "ab.txt", "b.txt", "c"])
    assert storage.list_dir() == storage.list_dir("")
    assert storage.list_dir("a") == ["x.bin", "y"]
    assert storage.list_dir("a/y") == ["z.bin"]
    assert storage.list_dir("c") == ["deep"]


def test_list_dir_of_missing_directory_is_empty(storage: Storage) -> None:
    assert storage.list_dir("") == []
    assert storage.list_dir("nothing") == []
    storage.write("present/f.bin", [b"1"])
    assert storage.list_dir("nothing/here") == []
    assert storage.list_dir("presen") == []


def test_list_files_gives_every_file_below_with_its_size(storage: Storage) -> None:
    storage.write("step/a.bin", [b"x" * 1234])
    storage.write("step/sub/deeper/b.bin", [b"y", b"z" * 99])
    storage.write("step/empty.bin", [b""])
    storage.write("step-2/c.bin", [b"not under step/"])
    storage.write("stepx.bin", [b"nor this"])

    assert storage.list_files("step") == {
        "a.bin": 1234,
        "empty.bin": 0,
        "sub/deeper/b.bin": 100,
    }
    assert storage.list_files("step/sub") == {"deeper/b.bin": 100}
    assert (
        set(storage.list_files())
        == set(storage.list_files(""))
        == {
            "step/a.bin",
            "step/empty.bin",
            "step/sub/deeper/b.bin",
            "step-2/c.bin",
            "stepx.bin",
        }
    )


def test_list_files_of_a_missing_directory_or_a_file_is_empty(storage: Storage) -> None:
    assert storage.list_files("") == {}
    assert storage.list_files("nothing") == {}
    storage.write("present/f.bin", [b"1"])
    assert storage.list_files("nothing/here") == {}
    assert storage.list_files("presen") == {}
    assert storage.list_files("present/f.bin") == {}


def test_list_files_sees_a_file_cut_short(storage: Storage) -> None:
    """What retention checks a just-written checkpoint by: the listed size is the size
    the object has now, not the size it was once written with."""
    storage.write("step/rank-00000.safetensors", [b"x" * 4096])
    storage.write("step/rank-00000.safetensors", [b"x" * 4000])
    assert storage.list_files("step") == {"rank-00000.safetensors": 4000}
    storage.delete("step/rank-00000.safetensors")
    assert storage.list_files("step") == {}


def _plant_raw(storage: Storage, name: str, data: bytes) -> None:
    """An object or file named ``name`` under the root, put there around the storage's
    own checks (another program wrote it)."""
    from resumable.storage import MemoryStorage
    from resumable.storage.s3 import S3Storage

    if isinstance(storage, MemoryStorage):
        storage.files[name] = data
    elif isinstance(storage, LocalStorage):
        (storage.root / name).parent.mkdir(parents=True, exist_ok=True)
        (storage.root / name).write_bytes(data)
    elif isinstance(storage, S3Storage):
        storage.client.put_object(Bucket=storage.bucket, Key=f"{storage.prefix}/{name}", Body=data)
    else:
        pytest.skip(f"no raw write into {type(storage).__name__} here")


def test_list_files_refuses_a_name_no_checkpoint_path_may_have(storage: Storage) -> None:
    """Names from a listing are checked like any other (`check_relpath`): one that
    could not have been written through the storage is refused, not handed on."""
    storage.write("step/ok.bin", [b"ok"])
    _plant_raw(storage, "step/name with space.bin", b"planted")

    with pytest.raises(CorruptCheckpointError, match="name with space"):
        storage.list_files("step")
    assert storage.read("step/ok.bin") == b"ok"


def test_exists_for_files_and_directories(storage: Storage) -> None:
    storage.write("dir/sub/file.bin", [b"1"])

    assert storage.exists("dir/sub/file.bin")
    assert storage.exists("dir/sub")
    assert storage.exists("dir")
    assert not storage.exists("dir/sub/file")
    assert not storage.exists("di")
    assert not storage.exists("dir/other")
    assert not storage.exists("missing.bin")


# --------------------------------------------------------------------------- delete


def test_delete_a_file(storage: Storage) -> None:
    storage.write("d/keep.bin", [b"k"])
    storage.write("d/gone.bin", [b"g"])

    storage.delete("d/gone.bin")

    assert not storage.exists("d/gone.bin")
    assert storage.list_dir("d") == ["keep.bin"]
    with pytest.raises(NoCheckpointError):
        storage.read("d/gone.bin")


def test_delete_a_tree_leaves_prefix_siblings(storage: Storage) -> None:
    for path in ["step/a.bin", "step/sub/b.bin", "step-2/c.bin", "stepx.bin"]:
        storage.write(path, [b"data"])

    storage.delete("step")

    assert not storage.exists("step")
    assert not storage.exists("step/sub/b.bin")
    assert storage.list_dir("step") == []
    assert storage.list_dir("") == ["step-2", "stepx.bin"]
    assert storage.read("step-2/c.bin") == b"data"


def test_delete_missing_is_not_an_error(storage: Storage) -> None:
    storage.delete("missing.bin")
    storage.delete("missing/dir")
    storage.write("x.bin", [b"x"])
    storage.delete("x.bin")
    storage.delete("x.bin")
    assert storage.list_dir("") == []


# --------------------------------------------------------------------------- append


def _needs_append(storage: Storage) -> None:
    if not storage.supports_append:
        pytest.skip(f"{type(storage).__name__} has no atomic append")


def test_append_is_offered_only_where_it_is_atomic(storage: Storage) -> None:
    """Object stores cannot grow an object: a read-modify-write "append" would lose the
    bytes of a concurrent appender, so they refuse instead of pretending."""
    if storage.supports_append:
        pytest.skip(f"{type(storage).__name__} appends atomically")
    with pytest.raises(NotImplementedError, match="no atomic append"):
        storage.append("logs/audit.jsonl", b"x\n")
    assert not storage.exists("logs/audit.jsonl")


def test_append_creates_then_extends(storage: Storage) -> None:
    _needs_append(storage)
    storage.append("logs/audit.jsonl", b'{"a": 1}\n')
    storage.append("logs/audit.jsonl", b'{"b": 2}\n')
    storage.append("logs/audit.jsonl", b"")

    assert storage.read("logs/audit.jsonl") == b'{"a": 1}\n{"b": 2}\n'
    assert storage.size("logs/audit.jsonl") == 18


def test_append_after_write(storage: Storage) -> None:
    _needs_append(storage)
    storage.write("f.txt", [b"abc"])
    storage.append("f.txt", b"def")
    assert storage.read("f.txt") == b"abcdef"


# --------------------------------------------------------------------------- rename_dir


def test_rename_dir_moves_the_whole_tree(storage: Storage) -> None:
    _needs_rename(storage)
    storage.write(".tmp-x/a.bin", [b"A"])
    storage.write(".tmp-x/sub/b.bin", [b"BB"])
    storage.write(".tmp-xy/other.bin", [b"O"])

    storage.rename_dir(".tmp-x", "final")
    storage.sync_dir("")

    assert not storage.exists(".tmp-x")
    assert storage.list_dir(".tmp-x") == []
    assert storage.read("final/a.bin") == b"A"
    assert storage.read("final/sub/b.bin") == b"BB"
    assert storage.list_dir("final") == ["a.bin", "sub"]
    assert storage.read(".tmp-xy/other.bin") == b"O"
    assert storage.list_dir("") == [".tmp-xy", "final"]


def test_rename_dir_onto_existing_directory_fails_and_changes_nothing(storage: Storage) -> None:
    _needs_rename(storage)
    storage.write("src/new.bin", [b"new"])
    storage.write("dst/old.bin", [b"old"])

    with pytest.raises(OSError) as info:
        storage.rename_dir("src", "dst")
    assert isinstance(info.value, StorageError)

    assert storage.read("src/new.bin") == b"new"
    assert storage.read("dst/old.bin") == b"old"
    assert storage.list_dir("dst") == ["old.bin"]


def test_rename_dir_of_missing_source_fails(storage: Storage) -> None:
    _needs_rename(storage)
    storage.write("other/f.bin", [b"1"])

    with pytest.raises(StorageError):
        storage.rename_dir("missing", "dst")

    assert not storage.exists("dst")
    assert storage.list_dir("") == ["other"]


def test_sync_dir_accepts_root_and_subdirectories(storage: Storage) -> None:
    storage.write("d/f.bin", [b"1"])
    storage.sync_dir("")
    storage.sync_dir("d")
    assert storage.read("d/f.bin") == b"1"


# --------------------------------------------------------------------------- hostile paths

BAD_PATHS = [
    "..",
    "../escape.bin",
    "a/../../escape.bin",
    "a/../b.bin",
    ".",
    "./a.bin",
    "/etc/passwd",
    "/abs.bin",
    "a\\..\\escape.bin",
    "a\\b.bin",
    "a//b.bin",
    "a/",
    "a/b/",
    "a\x00b",
    "name with space",
    "-leading-dash",
]

OPERATIONS: dict[str, Callable[[Storage, str], Any]] = {
    "write": lambda s, p: s.write(p, [b"payload"]),
    "read": lambda s, p: s.read(p),
    "read_range": lambda s, p: s.read_range(p, 0, 1),
    "size": lambda s, p: s.size(p),
    "exists": lambda s, p: s.exists(p),
    "list_dir": lambda s, p: s.list_dir(p),
    "list_files": lambda s, p: s.list_files(p),
    "delete": lambda s, p: s.delete(p),
    "append": lambda s, p: s.append(p, b"payload"),
    "rename_dir-src": lambda s, p: s.rename_dir(p, "dst"),
    "rename_dir-dst": lambda s, p: s.rename_dir("src", p),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
@pytest.mark.parametrize("path", BAD_PATHS)
def test_hostile_paths_are_rejected_before_touching_anything(
    storage: Storage, tmp_path: Path, op: str, path: str
) -> None:
    if op.startswith("rename_dir"):
        _needs_rename(storage)
    if op == "append":
        _needs_append(storage)
    storage.write("src/keep.bin", [b"keep"])
    before = _snapshot_tree(tmp_path)

    with pytest.raises(CorruptCheckpointError):
        OPERATIONS[op](storage, path)

    assert storage.list_dir("") == ["src"]
    assert storage.read("src/keep.bin") == b"keep"
    assert _snapshot_tree(tmp_path) == before


@pytest.mark.parametrize("op", ["write", "read", "read_range", "size", "append"])
def test_empty_path_is_not_a_file(storage: Storage, tmp_path: Path, op: str) -> None:
    if op == "append":
        _needs_append(storage)
    storage.write("src/keep.bin", [b"keep"])
    before = _snapshot_tree(tmp_path)

    with pytest.raises(CorruptCheckpointError):
        OPERATIONS[op](storage, "")

    assert storage.read("src/keep.bin") == b"keep"
    assert _snapshot_tree(tmp_path) == before


def _snapshot_tree(base: Path) -> dict[str, bytes | None]:
    """Every path under ``base`` with its content (None for directories)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for d in dirnames:
            out[os.path.join(dirpath, d)] = None
        for f in filenames:
            full = os.path.join(dirpath, f)
            out[full] = Path(full).read_bytes()
    return out


# --------------------------------------------------------------------------- local only


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the checkpoint root, with a file a hostile link aims at."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.bin").write_bytes(b"secret")
    return d


def test_symlinked_directory_pointing_outside_is_refused(
    local_storage: LocalStorage, outside: Path
) -> None:
    """Reading through a link is a damaged checkpoint; writing through one a storage
    failure (``ELOOP``): either way nothing outside the root is read or touched."""
    local_storage.write("ok.bin", [b"ok"])
    (local_storage.root / "evil").symlink_to(outside, target_is_directory=True)

    with pytest.raises(CorruptCheckpointError, match="'evil' in its path is a symbolic link"):
        local_storage.read("evil/secret.bin")
    with pytest.raises(CorruptCheckpointError):
        local_storage.read_range("evil/secret.bin", 0, 1)
    with pytest.raises(CorruptCheckpointError):
        local_storage.size("evil/secret.bin")
    with pytest.raises(CorruptCheckpointError):
        local_storage.list_dir("evil")
    for write in (
        lambda: local_storage.write("evil/planted.bin", [b"planted"]),
        lambda: local_storage.write("evil/secret.bin", [b"overwritten"]),
        lambda: local_storage.append("evil/secret.bin", b"appended"),
        lambda: local_storage.write("evil/new/deeper.bin", [b"planted"]),
        lambda: local_storage.delete("evil/secret.bin"),
    ):
        with pytest.raises(StorageError, match="symbolic link") as info:
            write()
        assert info.value.errno == errno.ELOOP

    assert sorted(p.name for p in outside.iterdir()) == ["secret.bin"]
    assert (outside / "secret.bin").read_bytes() == b"secret"


def test_list_files_never_follows_a_link_nor_lists_a_fifo(
    local_storage: LocalStorage, outside: Path
) -> None:
    """A listing walks directory descriptors opened with ``O_NOFOLLOW``: a link under
    the listed directory (to a directory or a file, outside the root or in it) and a
    FIFO are refused as reading them would be; the listed directory itself may not be
    a link either."""
    local_storage.write("step/ok.bin", [b"ok"])
    (local_storage.root / "step" / "evil").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        local_storage.list_files("step")
    (local_storage.root / "step" / "evil").unlink()
    (local_storage.root / "step" / "f.bin").symlink_to(local_storage.root / "step" / "ok.bin")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        local_storage.list_files("step")
    (local_storage.root / "step" / "f.bin").unlink()
    os.mkfifo(local_storage.root / "step" / "pipe")
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        local_storage.list_files("step")
    (local_storage.root / "step" / "pipe").unlink()
    (local_storage.root / "alias").symlink_to(local_storage.root / "step")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        local_storage.list_files("alias")
    assert local_storage.list_files("step") == {"ok.bin": 2}


def test_symlinked_file_pointing_outside_is_refused(
    local_storage: LocalStorage, outside: Path
) -> None:
    local_storage.write("ok.bin", [b"ok"])
    (local_storage.root / "link.bin").symlink_to(outside / "secret.bin")

    with pytest.raises(CorruptCheckpointError, match="it is a symbolic link"):
        local_storage.read("link.bin")
    with pytest.raises(StorageError, match="symbolic link"):
        local_storage.write("link.bin", [b"overwritten"])
    with pytest.raises(StorageError, match="symbolic link"):
        local_storage.append("link.bin", b"appended")

    assert (outside / "secret.bin").read_bytes() == b"secret"


def test_symlinked_component_pointing_inside_is_refused_too(local_storage: LocalStorage) -> None:
    """No link inside the root is followed, wherever it points: a link that is harmless
    when checked may point elsewhere by the time it is used."""
    local_storage.write("real/f.bin", [b"inside"])
    (local_storage.root / "alias").symlink_to(local_storage.root / "real")

    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        local_storage.read("alias/f.bin")


def test_symlinked_root_is_followed(tmp_path: Path) -> None:
    """The root path is the user's choice: a link there (or above) is followed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    backend = LocalStorage(tmp_path / "alias" / "root")

    backend.write("d/f.bin", [b"x"])

    assert (tmp_path / "real" / "root" / "d" / "f.bin").read_bytes() == b"x"
    assert backend.read("d/f.bin") == b"x"
    assert LocalStorage(tmp_path / "alias").list_dir("root") == ["d"]


def _raise_enospc(fd: int, data: Any) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("op", ["write", "append"])
def test_full_disk_is_a_storage_error_that_says_so(
    local_storage: LocalStorage, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    local_storage.write("earlier.bin", [b"earlier"])
    with monkeypatch.context() as m:
        m.setattr(os, "write", _raise_enospc)
        with pytest.raises(StorageError) as info:
            OPERATIONS[op](local_storage, "new.bin")

    err = info.value
    assert isinstance(err, OSError)
    assert err.errno == errno.ENOSPC
    assert "disk is full" in str(err)
    assert "new.bin" in str(err)
    assert local_storage.read("earlier.bin") == b"earlier"


def test_full_disk_midway_through_a_multi_chunk_write(
    local_storage: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    calls = {"n": 0}

    def write_then_fill(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_then_fill)
    with pytest.raises(StorageError, match="disk is full"):
        # a MiB each: buffers smaller than a thirty-second of a piece are gathered
        local_storage.write("part.bin", [b"1" * (1 << 20), b"2" * (1 << 20)])
    monkeypatch.undo()
    assert calls["n"] == 2


def test_write_and_sync_dir_call_fsync(
    local_storage: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    synced: list[int] = []

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)

    local_storage.write("d/f.bin", [b"a", b"b"])
    assert len(synced) == 1
    local_storage.sync_dir("d")
    assert len(synced) == 2
    local_storage.sync_dir("")
    assert len(synced) == 3


def test_failed_fsync_is_a_storage_error(
    local_storage: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageError) as info:
        local_storage.write("f.bin", [b"data"])
    assert info.value.errno == errno.EIO
    with pytest.raises(StorageError):
        local_storage.sync_dir("")


def test_local_rename_onto_existing_checkpoint_keeps_both(local_storage: LocalStorage) -> None:
    local_storage.write("a/f.bin", [b"a"])
    local_storage.write("b/f.bin", [b"b"])

    with pytest.raises(StorageError, match="rename"):
        local_storage.rename_dir("a", "b")
    assert local_storage.read("a/f.bin") == b"a"
    assert local_storage.read("b/f.bin") == b"b"


def test_local_root_is_created_on_first_write(tmp_path: Path) -> None:
    root = tmp_path / "not" / "yet"
    backend = LocalStorage(root)
    assert backend.list_dir("") == []
    assert not backend.exists("x.bin")
    assert not root.exists()

    backend.write("x.bin", [b"x"])

    assert (root / "x.bin").read_bytes() == b"x"
