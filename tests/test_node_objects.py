"""One object per node (format version 6, `resumable.nodes`).

Ranks are threads of this process here, grouped into simulated nodes, written by the
real `write_distributed` with a `NodeObjects` each (the exchanges of a real
coordination store are checked by `tests/test_scale_harness.py`, real launches under
torchrun by `test_a_torchrun_job_on_two_nodes_writes_one_object_per_node`). What is
checked: a checkpoint holds its manifest and one object per node, nothing else, and
nothing stays staged; every reader (verify, restore into one process, export, the
retention size check, the mirror's copy) reads it; a flipped, cut or grown node object
and hostile segment tables are refused; a rank whose staged write fails, a leader whose
upload fails and a rank numbered into another node's range each commit nothing; on a
real S3 server a checkpoint of 8 ranks on 2 nodes is 3 objects, and retention deletes
them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable
from resumable.cli import main
from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError, PersistError
from resumable.format import MANIFEST, encode_manifest, manifest_digest
from resumable.nodes import NodeObjects, node_file
from resumable.reader import CheckpointReader
from resumable.storage import open_storage
from resumable.storage.base import ForwardingStorage, Storage
from state_checks import save_thread_ranks


def _model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(3, 2))


def _nodes(rank: int, world: int, per_node: int, staging: Path) -> NodeObjects:
    leader = rank - rank % per_node
    return NodeObjects(leader, min(per_node, world - leader), f"group-{leader}", str(staging))


def _save(
    storage: Storage,
    step: int,
    world: int,
    per_node: int,
    staging: Path,
    *,
    nodes: Callable[[int], NodeObjects] | None = None,
    storage_of: Callable[[int], Storage] | None = None,
) -> None:
    """Step ``step`` of ``world`` thread ranks, ``per_node`` to a node: the same module
    on each (replicated) and a tensor of each rank's own. Raises the first rank's error."""
    models = [_model(step) for _ in range(world)]
    states = [
        {"model": m, "extra": {"mine": torch.full((5,), float(r))}} for r, m in enumerate(models)
    ]
    save_thread_ranks(
        storage,
        step,
        states,
        nodes=nodes or (lambda r: _nodes(r, world, per_node, staging)),
        storage_of=storage_of,
    )


def _restored(root: Path) -> int:
    """The step a process restores from ``root``, its module checked against that step's."""
    state = {"model": _model(0)}
    with resumable.Checkpointer(root, state, keep=None) as ckpt:
        step = ckpt.restore(reset_per_rank_state=True)
    for k, v in _model(step).state_dict().items():
        assert torch.equal(state["model"].state_dict()[k], v)
    return step


def _top(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / MANIFEST).read_text())


def _write_top(root: Path, step: int, m: dict[str, Any]) -> None:
    m.pop("digest", None)
    m["digest"] = manifest_digest(m)
    (root / step_dir(step) / MANIFEST).write_bytes(encode_manifest(m))


def _staged(staging: Path) -> list[Path]:
    return [p for p in staging.rglob("*") if p.is_file()] if staging.exists() else []


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (3, 2), (2, 1)])
def test_the_ranks_of_a_node_share_one_object(tmp_path: Path, world: int, per_node: int) -> None:
    root, staging = tmp_path / "root", tmp_path / "staging"
    storage = open_storage(str(root))
    _save(storage, 1, world, per_node, staging)
    leaders = list(range(0, world, per_node))
    names = sorted(p.name for p in (root / step_dir(1)).iterdir())
    assert names == sorted([MANIFEST, *(node_file(n) for n in leaders)])
    assert not _staged(staging)
    top = _top(root, 1)
    assert top["format_version"] == 7 and len(top["objects"]) == len(leaders)
    assert set(top["segments"]) == set(top["files"]) | {p["file"] for p in top["parts"]}
    reader = CheckpointReader(storage, 1)
    assert reader.verify() > 0
    reader.check_sizes()
    for r in range(world):
        one = CheckpointReader(storage, 1)
        one.only_rank(r)
        name = f"rank{r}/extra/mine"
        assert torch.equal(one.tensors([name])[name], torch.full((5,), float(r)))


def test_a_checkpoint_restores_into_one_process_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, tmp_path / "staging")
    _save(storage, 2, 4, 2, tmp_path / "staging")
    assert _restored(root) == 2
    assert main(["verify", str(root), "--all"]) == 0
    assert main(["show", str(root)]) == 0
    out = tmp_path / "model.safetensors"
    assert main(["export", str(root), "--key", "model", "--out", str(out)]) == 0
    from safetensors.torch import load_file

    got = load_file(str(out))
    for k, v in _model(2).state_dict().items():
        assert torch.equal(got[k], v)


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_node_object_is_refused_and_the_restore_falls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, tmp_path / "staging")
    _save(storage, 2, 4, 2, tmp_path / "staging")
    _flip(root / step_dir(2) / node_file(2))
    capsys.readouterr()
    assert main(["verify", str(root), "--all"]) == 1
    assert f"CORRUPT  {step_dir(2)}" in capsys.readouterr().out
    assert _restored(root) == 1


@pytest.mark.parametrize("change", ["cut", "grown", "missing"])
def test_the_retention_size_check_covers_the_node_objects(tmp_path: Path, change: str) -> None:
    root = tmp_path / "root"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, tmp_path / "staging")
    path = root / step_dir(1) / node_file(2)
    if change == "missing":
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes(data[:-1] if change == "cut" else data + b"\0")
    with pytest.raises(CorruptCheckpointError, match=r"node-00002\.bin"):
        CheckpointReader(storage, 1).check_sizes()
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(storage, 1).verify()


def _edit_overlap(m: dict[str, Any]) -> None:
    segs = [s for s in m["segments"].values() if s["offset"] > 0]
    segs[0]["offset"] -= 1


def _edit_past_end(m: dict[str, Any]) -> None:
    obj = next(iter(m["objects"]))
    m["objects"][obj]["size"] -= 1


def _edit_missing(m: dict[str, Any]) -> None:
    m["segments"].pop(next(iter(m["segments"])))


def _edit_unknown_object(m: dict[str, Any]) -> None:
    next(iter(m["segments"].values()))["object"] = "elsewhere.bin"


def _edit_object_not_a_name(m: dict[str, Any]) -> None:
    next(iter(m["segments"].values()))["object"] = ["a"]


def _edit_object_outside(m: dict[str, Any]) -> None:
    m["objects"]["../../etc/passwd"] = {"size": 1}


def _edit_object_named_as_a_file(m: dict[str, Any]) -> None:
    m["objects"][next(iter(m["files"]))] = {"size": 1}


def _edit_negative_offset(m: dict[str, Any]) -> None:
    next(iter(m["segments"].values()))["offset"] = -1


def _edit_no_table(m: dict[str, Any]) -> None:
    del m["segments"]


def _edit_no_parts(m: dict[str, Any]) -> None:
    del m["parts"]


EDITS = {
    f.__name__.removeprefix("_edit_"): f
    for f in (
        _edit_overlap,
        _edit_past_end,
        _edit_missing,
        _edit_unknown_object,
        _edit_object_not_a_name,
        _edit_object_outside,
        _edit_object_named_as_a_file,
        _edit_negative_offset,
        _edit_no_table,
        _edit_no_parts,
    )
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_hostile_segment_tables_are_refused(tmp_path: Path, edit: str) -> None:
    root = tmp_path / "root"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, tmp_path / "staging")
    m = _top(root, 1)
    EDITS[edit](m)
    _write_top(root, 1, m)
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(storage, 1).verify()


def test_a_mirror_copy_is_one_object_per_file(tmp_path: Path) -> None:
    from resumable.pipeline.mirror import upload_checkpoint

    local, remote = tmp_path / "local", tmp_path / "remote"
    src, dst = open_storage(str(local)), open_storage(str(remote))
    _save(src, 1, 4, 2, tmp_path / "staging")
    assert upload_checkpoint(src, dst, 1) > 0
    copy = CheckpointReader(dst, 1)
    assert copy.top["format_version"] == 1 and "segments" not in copy.top  # no tie
    assert copy.verify() == CheckpointReader(src, 1).verify()
    assert not list((remote / step_dir(1)).glob("node-*"))


class _Refusing(ForwardingStorage):
    """Refuses to write paths whose name contains ``word``."""

    def __init__(self, inner: Storage, word: str) -> None:
        super().__init__(inner)
        self.word = word

    def write(self, path: str, chunks: Any) -> int:
        if self.word in path:
            raise OSError(28, f"No space left on device: {path}")
        return super().write(path, chunks)


def _nothing_committed(root: Path, staging: Path) -> None:
    storage = open_storage(str(root))
    assert not (root / step_dir(2)).exists()
    assert CheckpointReader(storage, 1).verify() > 0  # the previous one stays
    assert not _staged(staging)
    leftovers = [p for p in root.rglob("*") if p.is_file() and step_dir(1) not in str(p)]
    assert not [p for p in leftovers if "node-" in p.name or "rank-" in p.name]


def test_a_leader_whose_upload_fails_commits_nothing_anywhere(tmp_path: Path) -> None:
    root, staging = tmp_path / "root", tmp_path / "staging"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, staging)
    refusing = _Refusing(storage, node_file(2))
    with pytest.raises(PersistError, match=r"rank 2: the object of its node: .*No space left"):
        _save(storage, 2, 4, 2, staging, storage_of=lambda r: refusing)
    _nothing_committed(root, staging)


def test_a_rank_whose_staged_write_fails_commits_nothing_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resumable import nodes as nodes_mod

    root, staging = tmp_path / "root", tmp_path / "staging"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, staging)
    real = nodes_mod.Staging.write

    def failing(self: Any, path: str, chunks: Any) -> int:
        if path.endswith("rank-00003.safetensors"):
            raise OSError(28, "No space left on device (staging)")
        return real(self, path, chunks)

    monkeypatch.setattr(nodes_mod.Staging, "write", failing)
    with pytest.raises(PersistError, match=r"rank 3: OSError.*staging"):
        _save(storage, 2, 4, 2, staging)
    _nothing_committed(root, staging)


def test_a_rank_numbered_into_another_nodes_range_commits_nothing(tmp_path: Path) -> None:
    root, staging = tmp_path / "root", tmp_path / "staging"
    storage = open_storage(str(root))
    _save(storage, 1, 4, 2, staging)

    def nodes(r: int) -> NodeObjects:
        n = _nodes(r, 4, 2, staging)
        return NodeObjects(n.leader, n.size, "group-9" if r == 3 else n.node, n.staging)

    with pytest.raises(PersistError, match=r"rank\(s\) \[3\] run on another node"):
        _save(storage, 2, 4, 2, staging, nodes=nodes)
    _nothing_committed(root, staging)


def test_on_s3_a_checkpoint_is_one_object_per_node_and_retention_deletes_them(
    tmp_path: Path, seaweedfs: Any
) -> None:
    from resumable.audit import AuditLog
    from resumable.policy import Keep
    from resumable.retention import apply_retention
    from resumable.storage.s3 import S3Storage

    bucket = seaweedfs.new_bucket()
    storage = S3Storage(
        f"s3://{bucket}/r",
        endpoint_url=seaweedfs.endpoint,
        aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key,
        region_name=seaweedfs.region,
        max_attempts=3,
    )
    try:
        _save(storage, 1, 8, 4, tmp_path / "staging")
        _save(storage, 2, 8, 4, tmp_path / "staging")
        listed = storage.list_files(step_dir(1))
        assert len(listed) == 3 and MANIFEST in listed  # the manifest, two node objects
        reader = CheckpointReader(storage, 2)
        assert reader.verify() > 0
        reader.check_sizes()
        apply_retention(storage, Keep(last=1), AuditLog(storage, rank=0, enabled=False))
        assert storage.list_files(step_dir(1)) == {}
        assert len(storage.list_files(step_dir(2))) == 3
    finally:
        storage.close()


def test_a_sweep_removes_only_stale_staged_persists(tmp_path: Path) -> None:
    """What a rank killed while it staged leaves is removed at the next start by its
    node's leader (`Staging.sweep`): only directories named as a persist's, untouched
    for the given time."""
    import os

    from resumable.nodes import Staging

    stale, fresh, other = (
        tmp_path / "0123456789abcdef",
        tmp_path / "fedcba9876543210",
        tmp_path / "mine",
    )
    for d in (stale, fresh, other):
        d.mkdir()
        (d / "rank-00001.safetensors").write_bytes(b"x")
    old = 1_000_000_000
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    assert Staging.sweep(str(tmp_path), 3600) == [stale.name]
    assert not stale.exists() and fresh.exists() and other.exists()
    assert Staging.sweep(str(tmp_path / "missing"), 3600) == []


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_node_objects_takes_true_or_false_only(bad: Any) -> None:
    from resumable.errors import OptionError
    from resumable.options import CheckpointOptions

    with pytest.raises(OptionError, match="node_objects"):
        CheckpointOptions.from_kwargs(node_objects=bad)
    assert CheckpointOptions.from_kwargs(node_objects=True).distributed.node_objects
