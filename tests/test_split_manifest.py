"""The split manifest of several ranks (format version 4, its parts gzip'd from version 7:
`resumable.parts`).

Ranks are threads of this process here, each with its own capture of a module (its
tensors replicated, so each is written by one rank) and a per-rank tensor, written by
the real `write_distributed`. What is checked: the top manifest names the parts and
no tensor; a reader verifies every part against the top before parsing it, and refuses
a damaged, missing, cut or grown part, a hostile name, and a part that claims another
rank's file; a rank restoring at the same world size reads only its own part and its
holders'; the old layout of several ranks (one manifest naming every tensor) still
reads; retention's size check, ``resumable verify``, ``show`` and ``export`` work, and
a restore falls back to the older checkpoint when a part is damaged.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable
from resumable.cli import main
from resumable.commit import step_dir
from resumable.errors import CorruptCheckpointError
from resumable.format import (
    CHECKSUM,
    MANIFEST,
    build_manifest,
    checksum,
    decode_manifest,
    encode_manifest,
    manifest_digest,
)
from resumable.parts import MAX_PART_BYTES
from resumable.reader import CheckpointReader
from resumable.reshard import GlobalLoader
from resumable.storage import open_storage
from state_checks import save_thread_ranks


def _model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(3, 2))


def _save(root: Path, step: int, world: int) -> None:
    """Step ``step`` of ``world`` thread ranks: the same module on each (replicated),
    and a tensor of each rank's own."""
    models = [_model(step) for _ in range(world)]  # seeded here: threads share the seed
    states = [
        {"model": m, "extra": {"mine": torch.full((5,), float(r))}} for r, m in enumerate(models)
    ]
    save_thread_ranks(open_storage(str(root)), step, states)


class _Counted:
    """A storage whose reads are noted by path."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.read_paths: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name == "read":

            def read(path: str, *args: Any, **kwargs: Any) -> Any:
                self.read_paths.append(path)
                return attr(path, *args, **kwargs)

            return read
        return attr


def _top(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / step_dir(step) / MANIFEST).read_text())


def _write_top(root: Path, step: int, m: dict[str, Any]) -> None:
    m.pop("digest", None)
    m["digest"] = manifest_digest(m)
    (root / step_dir(step) / MANIFEST).write_bytes(encode_manifest(m))


def _part_path(root: Path, step: int, rank: int) -> Path:
    return root / step_dir(step) / _top(root, step)["parts"][rank]["file"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_round_trip_reads_only_the_parts_a_rank_needs(tmp_path: Path, world: int) -> None:
    _save(tmp_path, 1, world)
    top = _top(tmp_path, 1)
    assert top["format_version"] == 7 and top["world_size"] == world
    assert "tensors" not in top and "ranks" not in top
    assert [p["rank"] for p in top["parts"]] == list(range(world))
    storage = open_storage(str(tmp_path))
    whole = CheckpointReader(storage, 1)
    assert whole.verify() > 0 and not whole.partial
    assert len(whole.manifest["ranks"]) == world
    expected = dict(_model(1).state_dict())
    for r in range(world):
        counted = _Counted(storage)
        reader = CheckpointReader(counted, 1)  # type: ignore[arg-type]
        reader.only_rank(r)
        tree = reader.manifest["ranks"][r]["tree"]
        part = _read_part(_part_path(tmp_path, 1, r))
        needed = {r, *part["holders"].values()}
        parts_read = {p for p in counted.read_paths if "part-" in p}
        assert parts_read == {f"{step_dir(1)}/{top['parts'][k]['file']}" for k in needed}
        assert reader.partial == (len(needed) < world)
        loader = GlobalLoader(reader, {})
        for fqn in expected:
            assert torch.equal(loader.value(f"model/{fqn}"), expected[fqn])
        mine = [n for n in reader.manifest["tensors"] if n.startswith(f"rank{r}/")]
        assert mine and torch.equal(reader.tensors(mine)[mine[0]], torch.full((5,), float(r)))
        assert tree is not None


def test_a_checkpoint_restores_into_one_process(tmp_path: Path) -> None:
    _save(tmp_path, 1, 3)
    state = {
        "model": torch.nn.Sequential(
            torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(3, 2)
        )
    }
    with resumable.Checkpointer(tmp_path, state, keep=None) as ckpt:
        assert ckpt.restore(reset_per_rank_state=True) == 1
    for k, v in _model(1).state_dict().items():
        assert torch.equal(state["model"].state_dict()[k], v)


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


DAMAGES = {
    "flipped byte": (_flip, "checksum mismatch"),
    "missing": (lambda p: p.unlink(), "is missing"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-3]), "declares"),
    "grown": (lambda p: p.write_bytes(p.read_bytes() + b" " * 4096), "exceeds"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("partial", [False, True])
def test_a_damaged_part_is_refused(tmp_path: Path, damage: str, partial: bool) -> None:
    _save(tmp_path, 1, 2)
    fn, message = DAMAGES[damage]
    fn(_part_path(tmp_path, 1, 1))
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    if partial:
        reader.only_rank(1)
    with pytest.raises(CorruptCheckpointError, match=message):
        reader.manifest  # noqa: B018
    assert reader.top["step"] == 1  # the top alone is sound


@pytest.mark.parametrize(
    "name",
    ["../evil.json", "/etc/passwd", "a/../../b.json", "x\\y.json", "rank-00000.safetensors"],
)
def test_hostile_part_names_are_refused(tmp_path: Path, name: str) -> None:
    _save(tmp_path, 1, 2)
    m = _top(tmp_path, 1)
    files = list(m["files"])
    m["parts"][0]["file"] = files[0] if name == "rank-00000.safetensors" else name
    _write_top(tmp_path, 1, m)
    with pytest.raises(CorruptCheckpointError, match=r"refusing path|named twice|invalid path"):
        CheckpointReader(open_storage(str(tmp_path)), 1).top  # noqa: B018


@pytest.mark.parametrize(
    "edit",
    [
        "no parts",
        "part of another rank",
        "size past the cap",
        "bad checksum",
        "tensors in top",
        "no json_size",
        "json_size past the cap",
        "json_size zero",
        "json_size a string",
        "json_size in version 4",
    ],
)
def test_malformed_top_manifests_are_refused(tmp_path: Path, edit: str) -> None:
    _save(tmp_path, 1, 2)
    m = _top(tmp_path, 1)
    if edit == "no json_size":
        del m["parts"][1]["json_size"]
    elif edit == "json_size past the cap":
        m["parts"][1]["json_size"] = MAX_PART_BYTES + 1
    elif edit == "json_size zero":
        m["parts"][1]["json_size"] = 0
    elif edit == "json_size a string":
        m["parts"][1]["json_size"] = "100"
    elif edit == "json_size in version 4":  # a version 4 part is JSON as stored
        m["format_version"] = 4
    elif edit == "no parts":
        m["parts"] = m["parts"][:1]
    elif edit == "part of another rank":
        m["parts"][1]["rank"] = 0
    elif edit == "size past the cap":
        m["parts"][1]["size"] = 1 << 40
    elif edit == "bad checksum":
        m["parts"][1][CHECKSUM] = "not-a-checksum"
    else:
        m["tensors"] = {}
    _write_top(tmp_path, 1, m)
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(open_storage(str(tmp_path)), 1).top  # noqa: B018


def _bomb(part: bytes) -> tuple[bytes, int]:
    """gzip'd bytes that grow to 64 MiB, declared as the part's own length."""
    return gzip.compress(part + b" " * (64 << 20)), len(part)


GZIP_DAMAGES = {
    # each signed in the top manifest as a buggy or hostile writer would: only what
    # gzip and the declared length say can refuse it
    "not gzip": (lambda part: (part, len(part)), "not gzip data"),
    "longer than declared": (_bomb, "does not decompress"),
    "shorter than declared": (lambda part: (gzip.compress(part), len(part) + 1), "decompress"),
    "a second member": (
        lambda part: (gzip.compress(part) + gzip.compress(b"{}"), len(part)),
        "does not decompress",
    ),
    "trailing bytes": (lambda part: (gzip.compress(part) + b"junk", len(part)), "decompress"),
    "cut short": (lambda part: (gzip.compress(part)[:-12], len(part)), "decompress"),
}


@pytest.mark.parametrize("damage", list(GZIP_DAMAGES))
def test_a_part_whose_gzip_data_disagrees_with_the_top_is_refused(
    tmp_path: Path, damage: str
) -> None:
    """A part that decompresses to other than the one member of the declared length is
    refused before a byte of it is parsed, and decompression stops one byte past that
    length: 64 MiB of spaces behind a sound part cost no 64 MiB."""
    _save(tmp_path, 1, 2)
    text = json.dumps(_read_part(_part_path(tmp_path, 1, 1))).encode()
    make, message = GZIP_DAMAGES[damage]
    blob, size = make(text)
    _store_part(tmp_path, 1, 1, blob, json_size=size)
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    with pytest.raises(CorruptCheckpointError, match=message):
        reader.manifest  # noqa: B018


def test_the_part_written_is_deterministic_gzip_of_sorted_json(tmp_path: Path) -> None:
    """What section 16 of docs/format.md says a part is: one gzip member with no name and
    no time in its header (two saves of one state give the same bytes), of the JSON the
    top declares the length of, in the digest's form (keys sorted, no whitespace)."""
    _save(tmp_path, 1, 2)
    _save(tmp_path / "again", 1, 2)
    for r in range(2):
        path = _part_path(tmp_path, 1, r)
        blob = path.read_bytes()
        assert blob[:4] == b"\x1f\x8b\x08\x00" and blob[4:8] == b"\0\0\0\0"  # no name, time
        text = gzip.decompress(blob)
        assert len(text) == _top(tmp_path, 1)["parts"][r]["json_size"]
        part = json.loads(text)
        assert text == json.dumps(part, sort_keys=True, separators=(",", ":")).encode()
        assert path.name == f"part-{r:05d}.json.gz"
        assert blob == _part_path(tmp_path / "again", 1, r).read_bytes()


def test_a_part_naming_another_ranks_file_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    m = _top(tmp_path, 1)
    other = next(f for f, info in m["files"].items() if info["rank"] == 0)

    def claim(part: dict[str, Any]) -> None:
        for info in part["tensors"].values():
            info["file"] = other

    _rewrite_part(tmp_path, 1, 1, claim)
    with pytest.raises(CorruptCheckpointError, match="not in its rank's data file"):
        CheckpointReader(open_storage(str(tmp_path)), 1).manifest  # noqa: B018


def _as_one_manifest(root: Path, step: int) -> None:
    """Rewrite a split checkpoint as the writer of several ranks wrote it before
    format version 4: one manifest naming every rank's tree and tensors
    (`build_manifest` with what each rank reported then), no parts."""
    storage = open_storage(str(root))
    m = CheckpointReader(storage, step).manifest
    old = build_manifest(
        step=step,
        metrics=m["metrics"],
        trees=[r["tree"] for r in m["ranks"]],
        files=m["files"],
        tensors=m["tensors"],
        world_size=m["world_size"],
    )
    for p in _top(root, step)["parts"]:
        (root / step_dir(step) / p["file"]).unlink()
    (root / step_dir(step) / MANIFEST).write_bytes(encode_manifest(old))


def test_the_old_layout_of_several_ranks_still_reads(tmp_path: Path) -> None:
    _save(tmp_path, 1, 3)
    _as_one_manifest(tmp_path, 1)
    raw = (tmp_path / step_dir(1) / MANIFEST).read_bytes()
    assert decode_manifest(raw, where="t")["format_version"] == 1
    storage = open_storage(str(tmp_path))
    reader = CheckpointReader(storage, 1)
    reader.only_rank(2)  # no effect on an old manifest
    assert len(reader.manifest["ranks"]) == 3 and not reader.partial
    assert reader.verify() > 0
    reader.check_sizes()
    loader = GlobalLoader(reader, {})
    for fqn, v in _model(1).state_dict().items():
        assert torch.equal(loader.value(f"model/{fqn}"), v)


def test_retention_size_check_covers_the_parts(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    storage = open_storage(str(tmp_path))
    CheckpointReader(storage, 1).check_sizes()
    path = _part_path(tmp_path, 1, 0)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError, match=r"part-00000\.json\.gz has"):
        CheckpointReader(storage, 1).check_sizes()


def test_cli_verify_show_and_export_read_a_split_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1, 2)
    _save(tmp_path, 2, 2)
    assert main(["verify", str(tmp_path), "--all"]) == 0
    assert main(["show", str(tmp_path)]) == 0
    out = tmp_path.parent / f"{tmp_path.name}-model.safetensors"
    assert main(["export", str(tmp_path), "--key", "model", "--out", str(out)]) == 0
    from safetensors.torch import load_file

    got = load_file(str(out))
    for k, v in _model(2).state_dict().items():
        assert torch.equal(got[k], v)
    _flip(_part_path(tmp_path, 2, 1))
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--all"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


def test_a_restore_falls_back_when_a_part_is_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 1, 2)
    _save(tmp_path, 2, 2)
    _flip(_part_path(tmp_path, 2, 0))
    state = {
        "model": torch.nn.Sequential(
            torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(3, 2)
        )
    }
    with (
        caplog.at_level(logging.WARNING),
        resumable.Checkpointer(tmp_path, state, keep=None) as ckpt,
    ):
        assert ckpt.restore(reset_per_rank_state=True) == 2 - 1
    assert "checksum mismatch" in caplog.text
    for k, v in _model(1).state_dict().items():
        assert torch.equal(state["model"].state_dict()[k], v)


def test_a_mirror_copy_of_a_split_checkpoint_is_one_manifest(tmp_path: Path) -> None:
    from resumable.pipeline.mirror import upload_checkpoint

    local, remote = tmp_path / "local", tmp_path / "remote"
    _save(local, 1, 3)
    src, dst = open_storage(str(local)), open_storage(str(remote))
    assert upload_checkpoint(src, dst, 1) > 0
    copy = CheckpointReader(dst, 1)
    assert copy.top["format_version"] == 1 and "parts" not in copy.top
    assert copy.verify() == CheckpointReader(src, 1).verify()
    assert not list((remote / step_dir(1)).glob("part-*"))
    assert upload_checkpoint(src, dst, 1) == 0  # the same content: nothing to do


GOLDEN = Path(__file__).resolve().parent / "golden" / "v4-ranks"


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_the_golden_split_checkpoint_reads(tmp_path: Path, rank: int | None) -> None:
    """``tests/golden/v4-ranks/`` (made once by ``tests/golden/make_split.py``): two
    ranks' checkpoint of format version 4, read whole and as each rank restoring."""
    import shutil

    expected = json.loads((GOLDEN / "expected.json").read_text())
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN, root)
    reader = CheckpointReader(open_storage(str(root)), expected["step"])
    assert reader.top["format_version"] == 4
    if rank is None:
        assert reader.verify() > 0
    else:
        reader.only_rank(rank)
    loader = GlobalLoader(reader, {})
    for k, v in expected["model"].items():
        assert loader.value(f"model/{k}").tolist() == v
    ranks = range(expected["world_size"]) if rank is None else [rank]
    for r in ranks:
        (got,) = reader.tensors([f"rank{r}/extra/mine"]).values()
        assert got.tolist() == expected["mine"][r]


def _rewrite_part(root: Path, step: int, rank: int, edit: Any) -> None:
    """Change rank ``rank``'s part with ``edit`` and sign it again in the top manifest
    (what a buggy writer, not damage, would leave)."""
    m = _top(root, step)
    path = root / step_dir(step) / m["parts"][rank]["file"]
    part = _read_part(path)
    edit(part)
    text = json.dumps(part, sort_keys=True, separators=(",", ":")).encode()
    _store_part(root, step, rank, gzip.compress(text), json_size=len(text))


def _read_part(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))  # type: ignore[no-any-return]


def _store_part(root: Path, step: int, rank: int, blob: bytes, *, json_size: int) -> None:
    """Write ``blob`` as rank ``rank``'s part, signed in the top manifest as holding
    ``json_size`` bytes of JSON."""
    m = _top(root, step)
    (root / step_dir(step) / m["parts"][rank]["file"]).write_bytes(blob)
    m["parts"][rank].update(size=len(blob), json_size=json_size, **{CHECKSUM: checksum(blob)})
    _write_top(root, step, m)


def test_a_part_without_holders_makes_the_rank_read_every_part(tmp_path: Path) -> None:
    _save(tmp_path, 1, 3)
    _rewrite_part(tmp_path, 1, 2, lambda part: part["holders"].clear())
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    reader.only_rank(2)
    assert not reader.partial  # its tree names tensors no part it knows of holds
    loader = GlobalLoader(reader, {})
    for k, v in _model(1).state_dict().items():
        assert torch.equal(loader.value(f"model/{k}"), v)


def test_wrong_holders_make_the_rank_read_every_part(tmp_path: Path) -> None:
    _save(tmp_path, 1, 3)
    owner = _read_part(_part_path(tmp_path, 1, 1))["holders"]

    def misdirect(part: dict[str, Any]) -> None:  # every holder said to be rank 1
        part["holders"] = {k: 1 for k in part["holders"]} or {k: 1 for k in owner}

    _rewrite_part(tmp_path, 1, 2, misdirect)
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    reader.only_rank(2)
    assert not reader.partial  # a tensor was not where its part said: it read them all
    loader = GlobalLoader(reader, {})
    for k, v in _model(1).state_dict().items():
        assert torch.equal(loader.value(f"model/{k}"), v)


def test_pieces_that_do_not_fill_a_target_make_the_loader_read_every_part(
    tmp_path: Path,
) -> None:
    """Each rank's own tensor made a third of one global tensor ``shared`` (as a
    sharded tensor's pieces; the model left out of the trees): a rank's own part holds
    its piece, which does not fill the whole tensor a plain process asks for, so the
    loader reads every part. The model's entries stay in the index, named by no tree."""
    _save(tmp_path, 1, 3)

    def shard(r: int) -> Any:
        def edit(part: dict[str, Any]) -> None:
            info = part["tensors"][f"rank{r}/extra/mine"]
            info.update(fqn="shared", global_shape=[15], global_offset=[5 * r])
            part["holders"] = {}  # and no model in its tree: its part alone is read
            part["tree"]["dict"] = [p for p in part["tree"]["dict"] if p[0] != "model"]
            part["tree"]["dict"].append(["shared", {"global": "shared", "device": "cpu"}])
            extra = next(v for k, v in part["tree"]["dict"] if k == "extra")
            extra["dict"] = [p for p in extra["dict"] if p[0] != "mine"]

        return edit

    for r in range(3):
        _rewrite_part(tmp_path, 1, r, shard(r))
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    reader.only_rank(1)
    assert reader.partial
    got = GlobalLoader(reader, {}).value("shared")
    assert got.tolist() == [0.0] * 5 + [1.0] * 5 + [2.0] * 5
    assert not reader.partial


def test_a_shard_written_by_two_data_parallel_replicas_is_one_piece() -> None:
    """A tensor-parallel shard that every data-parallel replica holds is in each one's
    part under one name (tests/integrations/test_megatron.py's TP 2 x DP 2 run): the
    same piece (place, dtype, shape, checksum) is read once; anything else differing is
    two tensors under one name, refused."""
    from resumable.parts import _same_piece

    entry = {
        "file": "rank-00000.safetensors",
        "dtype": "F32",
        "shape": [2, 4],
        "offsets": [64, 96],
        "xxh3_64": "0123456789abcdef",
        "fqn": "model/w",
        "global_shape": [4, 4],
        "global_offset": [0, 0],
    }
    copy = {**entry, "file": "rank-00002.safetensors", "offsets": [128, 160]}
    assert _same_piece(entry, copy)
    for key, other in [
        ("xxh3_64", "fedcba9876543210"),
        ("global_offset", [2, 0]),
        ("shape", [1, 4]),
        ("dtype", "BF16"),
        ("fqn", "model/v"),
    ]:
        assert not _same_piece(entry, {**copy, key: other}), key
    whole = {k: v for k, v in entry.items() if k not in ("fqn", "global_shape", "global_offset")}
    assert not _same_piece(whole, dict(whole)), "a rank's own tensor is never another's"
