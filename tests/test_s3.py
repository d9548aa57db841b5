"""Object storage against a real S3 server (SeaweedFS on loopback): the Checkpointer on
``s3://`` roots, the marker commit, tiering with a mirror, the CLI, and the demo killed
with SIGKILL. Fault injection (errors, resets, lost responses, killed writers, racing
committers) is in ``test_s3_faults.py``.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import TrainingState, tensor_bytes_equal
from resumable import Checkpointer, Keep
from resumable.audit import read_audit
from resumable.capture import capture
from resumable.cli import main as cli
from resumable.commit import MarkerCommit, committer_for, list_committed, step_dir
from resumable.errors import CheckpointError, PersistError, StorageError
from resumable.format import MANIFEST
from resumable.pipeline.mirror import upload_checkpoint
from resumable.pipeline.write import WriteRequest, write_checkpoint
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage import LocalStorage, MemoryStorage, Storage, open_storage
from resumable.storage.base import ForwardingStorage
from resumable.storage.s3 import S3Storage


def options(server: Any, **extra: Any) -> dict[str, Any]:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "max_attempts": 3,
        **extra,
    }


def train_and_save(ck: Checkpointer, ts: TrainingState, steps: range) -> dict[int, Any]:
    """Train one step per save, each persist committed before the next; returns the
    tensors as of each saved step."""
    out = {}
    for step in steps:
        ts.train()
        ck.save(step)
        ck.wait()
        out[step] = ts.tensors()
    return out


# --------------------------------------------------------------------------- Checkpointer on s3://


@pytest.mark.parametrize("persist", ["process", "thread", "sync"])
def test_round_trip_on_s3_with_the_standard_aws_configuration(
    s3_env: Any, small_training_state: Any, persist: str
) -> None:
    url = f"s3://{s3_env.new_bucket('rt')}/exp/run1"
    ts = small_training_state()
    with Checkpointer(url, ts.state, keep=Keep(last=2), persist=persist) as ck:
        assert ck.persist_mode == persist
        saved = train_and_save(ck, ts, range(1, 5))
        assert ck.steps() == [3, 4]

    fresh = small_training_state(seed=7)
    with Checkpointer(url, fresh.state) as ck:
        assert ck.restore(tier="storage") == 4
        assert fresh.mismatches(saved[4]) == []
        assert ck.restore(3, tier="storage") == 3
        assert fresh.mismatches(saved[3]) == []


def test_auto_persist_mode_is_a_process_for_s3(s3_env: Any, small_training_state: Any) -> None:
    url = f"s3://{s3_env.new_bucket('auto')}/run"
    with Checkpointer(url, small_training_state().state) as ck:
        assert ck.persist_mode == "process"


def test_storage_options_multipart_and_parallel_ranged_reads(
    seaweedfs: Any, small_training_state: Any
) -> None:
    """Explicit options reach the client (no AWS environment here); a data file larger
    than the part size goes up in parts and comes back through parallel ranged GETs."""
    bucket = seaweedfs.new_bucket("mp")
    ts = small_training_state()
    ts.state["big"] = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: three 5 MiB parts
    opts = options(seaweedfs, part_size=5 << 20, max_concurrency=3)
    with Checkpointer(f"s3://{bucket}/r", ts.state, persist="sync", storage_options=opts) as ck:
        ck.save(1)
    storage = S3Storage(f"s3://{bucket}/r", **opts)
    reader = CheckpointReader(storage, 1)
    (fname,) = reader.manifest["files"]
    key = f"r/{step_dir(1)}/{fname}"
    head = seaweedfs.client().head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ContentLength"] > 10 << 20
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # a three-part upload
    assert reader.verify() > 10 << 20

    ts.state["big"] = torch.zeros(3_000_000)
    with Checkpointer(f"s3://{bucket}/r", ts.state, storage_options=opts) as ck:
        assert ck.restore() == 1
    assert torch.equal(ts.state["big"], torch.arange(3_000_000, dtype=torch.float32))


def test_a_tree_of_thousands_of_objects_is_deleted_in_parallel_batches(seaweedfs: Any) -> None:
    """A checkpoint of many ranks is thousands of objects: `delete` sends its
    DeleteObjects batches several at a time, leaves nothing, and a batch the server
    refuses is raised (the other batches are still sent), never swallowed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    bucket = seaweedfs.new_bucket("del")
    storage = S3Storage(f"s3://{bucket}/r", **options(seaweedfs, max_concurrency=4))
    names = [f"step-1/a/rank-{i:05d}.bin" for i in range(2300)]

    def fill() -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: storage.write(n, [b"x"]), names))
        storage.write("step-2/keep.bin", [b"y"])

    fill()
    lock = threading.Lock()
    flight = {"now": 0, "most": 0, "calls": 0}
    real = storage.client.delete_objects

    def counted(**kw: Any) -> Any:
        with lock:
            flight["now"] += 1
            flight["calls"] += 1
            flight["most"] = max(flight["most"], flight["now"])
        try:
            time.sleep(0.05)  # keeps each call open long enough to overlap the others
            return real(**kw)
        finally:
            with lock:
                flight["now"] -= 1

    storage.client.delete_objects = counted  # type: ignore[method-assign]
    storage.delete("step-1")
    assert storage.list_files("step-1") == {} and not storage.exists("step-1")
    assert storage.list_files("step-2") == {"keep.bin": 1}
    assert flight["calls"] >= 4 and flight["most"] > 1, flight  # 2,300 keys: 4 batches

    fill()
    sent: list[int] = []

    def one_refused(**kw: Any) -> Any:
        keys = [o["Key"] for o in kw["Delete"]["Objects"]]
        with lock:
            sent.append(len(keys))
        if any(k.endswith("rank-00000.bin") for k in keys):
            return {"Errors": [{"Key": keys[0], "Code": "AccessDenied", "Message": "no"}]}
        return real(**kw)

    storage.client.delete_objects = one_refused  # type: ignore[method-assign]
    with pytest.raises(StorageError, match=r"could not delete 1 object.*AccessDenied"):
        storage.delete("step-1")
    assert sum(sent) == len(names) + 1  # every batch was sent: the tree and its own key
    left = storage.list_files("step-1")
    assert "a/rank-00000.bin" in left and len(left) < len(names)


def test_a_tree_is_deleted_page_by_page_while_it_is_listed(seaweedfs: Any) -> None:
    """`delete` sends each page of its listing (1,000 keys) for deletion as it arrives:
    the first DeleteObjects goes out before the last ListObjectsV2 (listing everything
    first made the deletion of a 4,096-rank checkpoint wait for 9 pages), and nothing
    is left."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    bucket = seaweedfs.new_bucket("stream")
    storage = S3Storage(f"s3://{bucket}/r", **options(seaweedfs, max_concurrency=4))
    names = [f"step-1/a/rank-{i:05d}.bin" for i in range(2300)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: storage.write(n, [b"x"]), names))
    events: list[str] = []
    lock = threading.Lock()
    real_list, real_delete = storage.client.list_objects_v2, storage.client.delete_objects

    def listed(**kw: Any) -> Any:
        with lock:
            events.append("list")
        return real_list(**kw)

    def deleted(**kw: Any) -> Any:
        with lock:
            events.append("delete")
        return real_delete(**kw)

    storage.client.list_objects_v2 = listed  # type: ignore[method-assign]
    storage.client.delete_objects = deleted  # type: ignore[method-assign]
    storage.delete("step-1")
    storage.client.list_objects_v2 = real_list  # type: ignore[method-assign]
    assert events.count("list") == 3, events  # 2,300 keys: three pages
    last_list = len(events) - 1 - events[::-1].index("list")
    assert events.index("delete") < last_list, events
    assert storage.list_files("step-1") == {} and not storage.exists("step-1")


def test_a_hostile_name_in_a_listing_stops_a_delete_with_an_error(seaweedfs: Any) -> None:
    """A key under the tree whose name is not one `check_relpath` allows (a space in
    it) is refused while the tree is deleted, as when it is listed."""
    bucket = seaweedfs.new_bucket("hostile")
    storage = S3Storage(f"s3://{bucket}/r", **options(seaweedfs))
    storage.write("step-1/ok.bin", [b"x"])
    storage.client.put_object(Bucket=bucket, Key="r/step-1/a b.bin", Body=b"y")
    with pytest.raises(CheckpointError):
        storage.list_files("step-1")
    with pytest.raises(CheckpointError):
        storage.delete("step-1")


def test_bad_options_and_missing_bucket_are_clear_errors(seaweedfs: Any) -> None:
    with pytest.raises(CheckpointError, match="unknown S3 storage option"):
        open_storage("s3://bucket/x", {"part_sise": 1})
    with pytest.raises(CheckpointError, match="at least 5 MiB"):
        open_storage("s3://bucket/x", {"part_size": 1024})
    with pytest.raises(CheckpointError, match="invalid S3 URL"):
        open_storage("s3://Not_A_Bucket/x")
    with pytest.raises(CheckpointError, match="apply to object storage URLs only"):
        open_storage("/tmp/x", {"part_size": 1 << 23})
    storage = open_storage("s3://no-such-bucket-here/x", options(seaweedfs))
    # AWS answers NoSuchBucket ("does not exist"); SeaweedFS answers AccessDenied.
    with pytest.raises(StorageError, match=r"no-such-bucket-here.*(does not exist|Access)"):
        storage.write("a.bin", [b"x"])


def test_unreachable_endpoint_fails_in_bounded_time(small_training_state: Any) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "aws_access_key_id": "x",
        "aws_secret_access_key": "y",
        "region_name": "us-east-1",
        "max_attempts": 2,
        "connect_timeout": 1,
        "read_timeout": 1,
    }
    t0 = time.monotonic()
    with (
        pytest.raises(StorageError, match="could not"),
        Checkpointer(
            "s3://bucket/run", small_training_state().state, persist="sync", storage_options=opts
        ) as ck,
    ):
        ck.save(1)
    assert time.monotonic() - t0 < 60


# --------------------------------------------------------------------------- marker commit


@pytest.fixture(params=["memory", "local", "s3"])
def marker_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """Every backend, committed with `MarkerCommit` (the object-store strategy)."""
    if request.param == "memory":
        return MemoryStorage()
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    server = request.getfixturevalue("seaweedfs")
    return S3Storage(f"s3://{server.new_bucket('mk')}/root", **options(server))


def _write(storage: Storage, committer: MarkerCommit, step: int, value: float) -> None:
    captured = capture({"w": torch.full((64,), value)}, include_rng=False)
    snapshot = Arena().snapshot(captured.tensors)
    write_checkpoint(storage, committer, WriteRequest(step, snapshot, captured.tree))


def test_marker_commit_layout_replace_and_stale(marker_storage: Storage) -> None:
    storage = marker_storage
    committer = MarkerCommit(storage, gc_grace_s=0)
    _write(storage, committer, 5, 1.0)
    (attempt,) = [n for n in storage.list_dir(step_dir(5)) if n.startswith("att-")]
    manifest = CheckpointReader(storage, 5).manifest
    assert list(manifest["files"]) == [f"{attempt}/rank-00000.safetensors"]

    # An abandoned attempt (a killed writer) is invisible and listed as stale.
    dead = committer.begin(6)
    storage.write(dead.path("rank-00000.safetensors"), [b"partial"])
    orphan = committer.begin(5)
    storage.write(orphan.path("rank-00000.safetensors"), [b"partial"])
    assert list_committed(storage) == [5]
    time.sleep(0.01)
    assert sorted(committer.stale()) == sorted([dead.staging, orphan.staging])
    assert MarkerCommit(storage).stale() == []  # within the default hour of grace

    # Re-saving step 5 replaces it: new data visible, the old attempt's objects gone.
    storage.delete(orphan.staging)
    _write(storage, committer, 5, 2.0)
    reader = CheckpointReader(storage, 5)
    reader.verify()
    (w,) = reader.tensors().values()
    assert torch.equal(w, torch.full((64,), 2.0))
    assert [n for n in storage.list_dir(step_dir(5)) if n.startswith("att-")] != [attempt]
    assert len([n for n in storage.list_dir(step_dir(5)) if n.startswith("att-")]) == 1

    committer.delete(5)
    assert list_committed(storage) == []
    assert not storage.exists(step_dir(5))


def test_committer_for_picks_rename_where_it_can(tmp_path: Path, seaweedfs: Any) -> None:
    assert type(committer_for(LocalStorage(tmp_path))).__name__ == "RenameCommit"
    s3 = S3Storage(f"s3://{seaweedfs.new_bucket('cf')}/r", **options(seaweedfs))
    assert isinstance(committer_for(s3), MarkerCommit)


def test_stale_attempts_are_removed_at_start_and_logged(
    seaweedfs: Any, small_training_state: Any, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = seaweedfs.new_bucket("gc")
    storage = S3Storage(f"s3://{bucket}/r", **options(seaweedfs))
    old = f"{step_dir(9)}/att-{int((time.time() - 7200) * 1000):013d}-1-deadbeef"
    storage.write(f"{old}/rank-00000.safetensors", [b"left by a killed writer"])
    young = MarkerCommit(storage).begin(9)
    storage.write(young.path("rank-00000.safetensors"), [b"another node, still writing"])
    with (
        caplog.at_level(logging.INFO, logger="resumable"),
        Checkpointer(
            f"s3://{bucket}/r", small_training_state().state, storage_options=options(seaweedfs)
        ),
    ):
        pass
    assert not storage.exists(old)
    assert storage.exists(young.staging)
    assert any("removed stale" in r.getMessage() and old in r.getMessage() for r in caplog.records)
    events = [e for e in read_audit(storage) if e["event"] == "stale_removed"]
    assert [e["name"] for e in events] == [old]


# --------------------------------------------------------------------------- tiering


@pytest.mark.parametrize("persist", ["process", "thread", "sync"])
def test_mirror_uploads_and_local_retention_waits_for_it(
    s3_env: Any, tmp_path: Path, small_training_state: Any, persist: str
) -> None:
    remote_url = f"s3://{s3_env.new_bucket('mir')}/exp1"
    ts = small_training_state()
    with Checkpointer(
        tmp_path / "local",
        ts.state,
        keep=Keep(last=1),
        mirror=remote_url,
        mirror_keep=Keep(last=3),
        persist=persist,
    ) as ck:
        saved = train_and_save(ck, ts, range(1, 6))
        assert ck.stats["mirrored"] >= 1
        assert ck.stats["last_mirror_step"] == 5
    local, remote = LocalStorage(tmp_path / "local"), open_storage(remote_url)
    assert list_committed(local) == [5]
    assert list_committed(remote)[-1] == 5
    assert len(list_committed(remote)) <= 3
    for s in list_committed(remote):
        CheckpointReader(remote, s).verify()
    events = [e["event"] for e in read_audit(local)]
    assert "mirror_commit" in events

    # A new node: empty local disk, the mirror alone.
    fresh = small_training_state(seed=3)
    with Checkpointer(tmp_path / "new-node", fresh.state, mirror=remote_url) as ck:
        assert ck.restore() == 5
    assert fresh.mismatches(saved[5]) == []
    restores = [
        e for e in read_audit(LocalStorage(tmp_path / "new-node")) if e["event"] == "restore"
    ]
    assert restores[-1]["tier"] == "mirror"


def test_unmirrored_local_checkpoints_are_kept_and_the_failure_is_raised(
    seaweedfs: Any, tmp_path: Path, small_training_state: Any
) -> None:
    """The mirror cannot be reached: local retention deletes nothing that is not
    mirrored, the alert fires, and close() raises instead of losing the news."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "aws_access_key_id": "x",
        "aws_secret_access_key": "y",
        "region_name": "us-east-1",
        "max_attempts": 1,
        "connect_timeout": 0.5,
    }
    alerts: list[str] = []
    ts = small_training_state()
    ck = Checkpointer(
        tmp_path / "local",
        ts.state,
        keep=Keep(last=1),
        mirror="s3://bucket/exp",
        storage_options=opts,
        persist="thread",
        on_busy="wait",
        alert=lambda kind, msg, details: alerts.append(kind),
    )
    for step in range(1, 4):
        ts.train()
        ck.save(step)  # on_busy="wait": each waits for the previous commit
    with pytest.raises(PersistError, match="mirroring step 3 to s3://bucket/exp failed"):
        ck.close()
    assert list_committed(LocalStorage(tmp_path / "local")) == [1, 2, 3]
    assert "mirror_failed" in alerts


def test_newest_valid_across_tiers_wins(
    s3_env: Any, tmp_path: Path, small_training_state: Any
) -> None:
    remote_url = f"s3://{s3_env.new_bucket('nv')}/exp"
    ts = small_training_state()
    with Checkpointer(
        tmp_path / "local", ts.state, keep=None, mirror=remote_url, persist="sync"
    ) as ck:
        saved = train_and_save(ck, ts, range(1, 4))
    local = LocalStorage(tmp_path / "local")
    # The newest local copy is damaged: the remote copy of the same step is used.
    data = tmp_path / "local" / step_dir(3) / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    fresh = small_training_state(seed=5)
    with Checkpointer(tmp_path / "local", fresh.state, mirror=remote_url) as ck:
        assert ck.restore() == 3
    assert fresh.mismatches(saved[3]) == []
    # A remote checkpoint newer than every local one wins.
    committer_for(local).delete(3)
    committer_for(local).delete(2)
    fresh = small_training_state(seed=6)
    with Checkpointer(tmp_path / "local", fresh.state, mirror=remote_url) as ck:
        assert ck.steps() == [1, 2, 3]
        assert ck.restore() == 3
    assert fresh.mismatches(saved[3]) == []


def _damage(remote: Storage, step: int, how: str) -> None:
    """Damage the remote copy of ``step`` behind its (still committed) manifest."""
    (fname,) = CheckpointReader(remote, step).manifest["files"]
    path = f"{step_dir(step)}/{fname}"
    if how == "missing":
        remote.delete(path)
    else:
        remote.write(path, [remote.read(path)[: remote.size(path) // 2]])


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_a_damaged_remote_copy_is_not_trusted_and_is_uploaded_again(
    s3_env: Any, tmp_path: Path, small_training_state: Any, how: str
) -> None:
    """A later launch recognises a good remote copy of its newest step (not sent again;
    local retention may rely on it). Damaged behind its manifest, the copy does not
    count as mirrored, and the next launch sends it again."""
    remote_url = f"s3://{s3_env.new_bucket('dmg')}/exp"
    local = LocalStorage(tmp_path / "local")
    ts = small_training_state()

    def relaunch() -> list[dict[str, Any]]:
        """Open and close: the catch-up of the newest step runs at start, close() waits
        for it. Returns the audit events of that launch."""
        before = len(read_audit(local))
        keep = Keep(last=1)
        with Checkpointer(local.root, ts.state, keep=keep, mirror=remote_url, persist="sync"):
            pass
        return read_audit(local)[before:]

    with Checkpointer(local.root, ts.state, keep=None, mirror=remote_url, persist="sync") as ck:
        train_and_save(ck, ts, range(1, 4))
    events = relaunch()
    assert [(e["step"], e["bytes"]) for e in events if e["event"] == "mirror_commit"] == [(3, 0)]
    assert list_committed(local) == [3]

    remote = open_storage(remote_url)
    _damage(remote, 3, how)
    events = relaunch()
    assert CheckpointReader(remote, 3).verify() > 0
    (upload,) = [e for e in events if e["event"] == "mirror_commit"]
    assert upload["step"] == 3 and upload["bytes"] > 0
    assert [e["step"] for e in events if e["event"] == "mirror_mismatch"] == [3]
    assert list_committed(local) == [3]


class ReadOnly(ForwardingStorage):
    """A remote that can be read but refuses every change (lost write permission)."""

    def _refuse(self, path: str) -> StorageError:
        return StorageError(errno.EACCES, f"could not change {self.url}/{path}: read-only")

    def write(self, path: str, chunks: Any) -> int:
        raise self._refuse(path)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        raise self._refuse(path)

    def delete(self, path: str) -> None:
        raise self._refuse(path)


def test_local_retention_never_relies_on_an_unverified_remote_step(
    s3_env: Any, tmp_path: Path, small_training_state: Any
) -> None:
    """The remote holds a truncated copy of local step 3 and a hostile step 9 that the
    local root never had; uploads fail. Neither counts as mirrored, so local retention
    (keep last 1) deletes nothing, and close() says the newest step is not mirrored."""
    remote_url = f"s3://{s3_env.new_bucket('unv')}/exp"
    ts = small_training_state()
    with Checkpointer(tmp_path / "local", ts.state, keep=None, persist="sync") as ck:
        train_and_save(ck, ts, range(1, 4))
    remote = open_storage(remote_url)
    upload_checkpoint(LocalStorage(tmp_path / "local"), remote, 3)
    _damage(remote, 3, "truncated")
    remote.write(f"{step_dir(9)}/{MANIFEST}", [b'{"format": "not a checkpoint"}'])
    assert list_committed(remote) == [3, 9]

    ck = Checkpointer(
        tmp_path / "local",
        ts.state,
        keep=Keep(last=1),
        mirror=ReadOnly(remote),
        persist="sync",
    )
    ts.train()
    ck.save(4)
    with pytest.raises(PersistError, match="mirroring step 4"):
        ck.close()
    assert list_committed(LocalStorage(tmp_path / "local")) == [1, 2, 3, 4]


def test_mirror_must_be_another_root(tmp_path: Path, small_training_state: Any) -> None:
    with pytest.raises(ValueError, match="another root"):
        Checkpointer(tmp_path, small_training_state().state, mirror=str(tmp_path))


# --------------------------------------------------------------------------- CLI


def test_cli_on_s3_urls(
    s3_env: Any, tmp_path: Path, small_training_state: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3_env.new_bucket('cli')}/run1"
    ts = small_training_state()
    with Checkpointer(url, ts.state, keep=None, persist="sync") as ck:
        saved = train_and_save(ck, ts, range(1, 5))

    assert cli(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows if r["status"] == "committed"] == [1, 2, 3, 4]
    assert cli(["show", url, "--step", "2"]) == 0
    assert "optim" in capsys.readouterr().out
    assert cli(["verify", url]) == 0
    assert "verified" in capsys.readouterr().out

    out = tmp_path / "model.safetensors"
    assert cli(["export", url, "--step", "4", "--key", "model", "--out", str(out)]) == 0
    exported = load_file(str(out))
    model_keys = {k for k in saved[4] if k.startswith("model/")}
    assert len(exported) == len(model_keys)
    for name, value in exported.items():
        assert tensor_bytes_equal(value, saved[4][f"model/{name}"]), name

    assert cli(["prune", url, "--keep-last", "2"]) == 0
    capsys.readouterr()
    assert list_committed(open_storage(url)) == [3, 4]

    # A flipped byte in the remote data is caught by verify (exit 1).
    storage = open_storage(url)
    reader = CheckpointReader(storage, 4)
    (fname,) = reader.manifest["files"]
    path = f"{step_dir(4)}/{fname}"
    raw = bytearray(storage.read(path))
    raw[-3] ^= 0x01
    storage.write(path, [bytes(raw)])
    assert cli(["verify", url]) == 1
    assert "corrupt" in capsys.readouterr().out.lower()


# --------------------------------------------------------------------------- the demo, killed


DEMO_STEPS = 36


def _demo(url: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "resumable.cli",
        "demo",
        "--dir",
        url,
        "--steps",
        str(DEMO_STEPS),
        "--every",
        "2",
        "--workers",
        "0",
        "--log-every",
        "1",
        *extra,
    ]


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final line of an uninterrupted run (local disk)."""
    done = subprocess.run(
        _demo(str(tmp_path_factory.mktemp("reference"))),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("layout", ["s3", "local+mirror"])
def test_demo_on_s3_survives_sigkills_bit_identical(
    s3_env: Any, tmp_path: Path, layout: str, demo_reference: str
) -> None:
    bucket = s3_env.new_bucket("demo")

    if layout == "s3":
        cmd = _demo(f"s3://{bucket}/demo")
    else:
        cmd = _demo(str(tmp_path / "local"), "--mirror", f"s3://{bucket}/mirror")
    rng = random.Random(20261122)
    for _ in range(2):
        target = rng.randint(2, DEMO_STEPS - 2)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= target:
                break
        if layout == "local+mirror":  # let one upload land, so the new node has something
            audit = LocalStorage(tmp_path / "local")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                e["event"] == "mirror_commit" for e in read_audit(audit)
            ):
                time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.stdout.close()
        proc.wait(timeout=60)
    if layout == "local+mirror":
        # A new node: another (empty) local disk and no shared memory of the old one;
        # only the mirror remains.
        cmd = _demo(str(tmp_path / "new-node"), "--mirror", f"s3://{bucket}/mirror")
    final = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert final.returncode == 0, final.stderr[-2000:]
    lines = final.stdout.strip().splitlines()
    assert lines[0].startswith("resumed from step"), lines[0]
    assert lines[-1] == demo_reference
