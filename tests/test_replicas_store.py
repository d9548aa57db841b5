"""The per-rank replica store (resumable.replicas.store): complete or invisible, newer
replaces older only once complete, damage at rest detected at read, one owner."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumable.errors import ReplicaError
from resumable.replicas.store import (
    PARTIAL,
    ReplicaInfo,
    ReplicaStore,
    check_room,
    plan_pieces,
    replica_memory,
)

RUN = "ab" * 16


def _put(
    store: ReplicaStore, rank: int, step: int, data: bytes, meta: bytes = b'{"tree": 1}'
) -> ReplicaInfo:
    pieces = plan_pieces(meta, data, chunk=1000)
    partial = store.begin(rank, step, len(meta), len(data), pieces)
    payload = meta + data
    for i, p in enumerate(pieces):
        partial.write_piece(i, payload[p.offset : p.offset + p.length])
    return partial.commit()


def test_partial_is_invisible_until_commit_and_newer_replaces_older(tmp_path: Path) -> None:
    with ReplicaStore(tmp_path, RUN) as store:
        first = _put(store, 0, 1, b"a" * 2500)
        meta, data = b'{"tree": 2}', b"b" * 3000
        pieces = plan_pieces(meta, data, chunk=1000)
        partial = store.begin(0, 2, len(meta), len(data), pieces)
        for i, p in enumerate(pieces[:-1]):
            partial.write_piece(i, (meta + data)[p.offset : p.offset + p.length])
        # half received: the older replica is the one held and read
        assert [i.step for i in store.held()] == [1]
        assert store.read(0).data == b"a" * 2500
        with pytest.raises(ReplicaError) as missing:
            partial.commit()
        assert missing.value.reason == "truncated"
        assert [p for p in tmp_path.iterdir() if p.name.startswith(PARTIAL)] == []
        assert store.read(0).info == first
        second = _put(store, 0, 2, data, meta)
        assert [i.step for i in store.held()] == [2]
        assert store.read(0).data == data and store.read(0, 2).meta == meta
        assert second.nbytes == len(meta) + len(data)
        assert second.digest != first.digest


def test_a_piece_that_fails_its_digest_is_never_committed(tmp_path: Path) -> None:
    with ReplicaStore(tmp_path, RUN) as store:
        _put(store, 3, 1, b"x" * 100)
        meta, data = b"{}", b"y" * 2000
        pieces = plan_pieces(meta, data, chunk=1000)
        partial = store.begin(3, 2, len(meta), len(data), pieces)
        partial.write_piece(0, meta)
        partial.write_piece(1, data[:1000])
        with pytest.raises(ReplicaError) as corrupt:
            partial.write_piece(2, b"z" + data[1001:])
        assert corrupt.value.reason == "corrupt"
        with pytest.raises(ReplicaError):
            partial.commit()
        assert [i.step for i in store.held()] == [1]


@pytest.mark.parametrize("where", ["meta", "data", "trailer"])
def test_a_replica_damaged_at_rest_is_detected(tmp_path: Path, where: str) -> None:
    with ReplicaStore(tmp_path, RUN) as store:
        info = _put(store, 1, 4, bytes(range(256)) * 20, meta=b'{"tree": "abc"}')
        raw = bytearray(info.path.read_bytes())
        at = {"meta": 3, "data": info.meta_len + 3000, "trailer": info.nbytes + 10}[where]
        raw[at] ^= 0x01
        info.path.write_bytes(bytes(raw))
        if where == "trailer":  # the file no longer names a replica: not listed
            assert store.held() == []
            with pytest.raises(ReplicaError) as absent:
                store.read(1)
            assert absent.value.reason == "absent"
        else:
            with pytest.raises(ReplicaError) as corrupt:
                store.read(1)
            assert corrupt.value.reason == "corrupt" and "damaged at rest" in str(corrupt.value)


def test_a_truncated_file_is_not_listed(tmp_path: Path) -> None:
    with ReplicaStore(tmp_path, RUN) as store:
        info = _put(store, 0, 1, b"q" * 5000)
        info.path.write_bytes(info.path.read_bytes()[:-1])
        assert store.held() == []


def test_other_runs_are_not_listed_and_stale_steps_refused(tmp_path: Path) -> None:
    with ReplicaStore(tmp_path / "a", "other-run") as other:
        _put(other, 0, 9, b"o")
    # another run's replica file copied in is ignored by this run's store
    (tmp_path / "b").mkdir(mode=0o700)
    for p in (tmp_path / "a").glob("*.replica"):
        (tmp_path / "b" / p.name).write_bytes(p.read_bytes())
    with ReplicaStore(tmp_path / "b", RUN) as store:
        assert store.held() == []
        _put(store, 0, 5, b"m")
        with pytest.raises(ReplicaError) as stale:
            _put(store, 0, 4, b"n")
        assert stale.value.reason == "stale"
        _put(store, 1, 2, b"p")
        assert [(i.source_rank, i.step) for i in store.held()] == [(0, 5), (1, 2)]


def test_one_owner_and_partials_of_a_killed_owner_removed(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, RUN)
    partial = store.begin(0, 1, 2, 0, plan_pieces(b"{}", b""))
    with pytest.raises(ReplicaError, match="another process holds"):
        ReplicaStore(tmp_path, RUN)
    reader = ReplicaStore(tmp_path, RUN, owner=False)
    assert reader.held() == []
    with pytest.raises(ReplicaError, match="owner"):
        reader.begin(0, 1, 2, 0, plan_pieces(b"{}", b""))
    store.close()  # as a kill would: the partial stays behind
    assert partial.path.exists()
    with ReplicaStore(tmp_path, RUN):
        assert not partial.path.exists()


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ReplicaError, match="nobody else may write"):
        ReplicaStore(shared, RUN)


def test_memory_cost_and_room_check(tmp_path: Path) -> None:
    assert replica_memory(10 << 30, 1) == 0
    assert replica_memory(10 << 30, 3) == 20 << 30
    check_room(tmp_path, 1)
    with pytest.raises(ReplicaError, match="lower replicas") as full:
        check_room(tmp_path, 1 << 60)
    assert full.value.reason == "space"
