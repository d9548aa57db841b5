"""The on-storage format: plain safetensors data files, aligned layout, path rules,
manifest versioning and validation, dtype names. ``docs/format.md`` is the spec these
tests hold the code to."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable
from resumable._dtypes import check_dtype_name, dtype_from_name, dtype_name, itemsize
from resumable._shm import layout_meta, slot_layout
from resumable.errors import CorruptCheckpointError, NewerFormatError, UnsupportedStateError
from resumable.format import (
    FORMAT_VERSION,
    LINE_BYTES,
    MANIFEST,
    TensorSlot,
    build_manifest,
    check_relpath,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    parse_safetensors_header,
    plan_layout,
)
from resumable.pipeline.write import share_prefix
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DATA_FILE = "rank-00000.safetensors"


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, plus 0-dim, empty and non-contiguous ones."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype, name in DTYPES.items():
        if dtype.is_floating_point:
            t = torch.randn(3, 2, generator=gen).to(dtype)
        else:
            t = torch.randint(0, 100, (3, 2), generator=gen).to(dtype)
        out[name] = t
    out["zero_dim"] = torch.tensor(2.5, dtype=torch.float64)
    out["empty"] = torch.empty(0, 4, dtype=torch.int16)
    out["transposed"] = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    out["odd_bytes"] = torch.arange(5, dtype=torch.uint8)  # 5 bytes: later slots stay aligned
    return out


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = sample_tensors()
    with resumable.Checkpointer(tmp_path, {"t": tensors}, keep=None, capture_rng=False) as ck:
        ck.save(12)
    return tmp_path / "step-000000000012", {f"t/{k}": v for k, v in tensors.items()}


# --------------------------------------------------------------------------- safetensors


def test_rank_file_loads_with_safetensors_load_file(saved: tuple[Path, Any]) -> None:
    ckpt_dir, tensors = saved
    loaded = safetensors.torch.load_file(ckpt_dir / DATA_FILE)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert loaded[name].shape == t.shape, name
        assert raw(loaded[name]) == raw(t), name


def test_rank_file_opens_with_safe_open(saved: tuple[Path, Any]) -> None:
    ckpt_dir, tensors = saved
    with safetensors.safe_open(ckpt_dir / DATA_FILE, framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata() == {"format": "pt", "producer": "resumable", "step": "12"}
        for name, t in tensors.items():
            assert raw(f.get_tensor(name)) == raw(t), name
        part = f.get_slice("t/F32")[1:3]
        assert torch.equal(part, tensors["t/F32"][1:3])


def test_file_layout_matches_manifest_and_is_aligned(saved: tuple[Path, Any]) -> None:
    ckpt_dir, tensors = saved
    data = (ckpt_dir / DATA_FILE).read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert data[8 + n - 1 : 8 + n] in (b"}", b" ")
    manifest = json.loads((ckpt_dir / MANIFEST).read_bytes())
    assert manifest["files"] == {DATA_FILE: {"size": len(data), "rank": 0}}
    index = manifest["tensors"]
    assert sorted(index) == sorted(tensors) == sorted(k for k in header if k != "__metadata__")
    spans = sorted(tuple(h["data_offsets"]) for k, h in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(data) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "data region is packed"
    sizes = []
    for name, info in index.items():
        t = tensors[name]
        begin, end = info["offsets"]
        assert [begin - 8 - n, end - 8 - n] == header[name]["data_offsets"]
        assert info["dtype"] == header[name]["dtype"] == DTYPES[t.dtype]
        assert info["shape"] == header[name]["shape"] == list(t.shape)
        assert info["file"] == DATA_FILE
        assert begin % t.element_size() == 0, f"{name} at {begin} is misaligned"
        assert data[begin:end] == raw(t)
        assert info["xxh3_64"] == xxhash.xxh3_64_hexdigest(data[begin:end])
        sizes.append((begin, end, t.element_size()))
        if (end - begin) % LINE_BYTES == 0:  # on a cache line (the data starts on one)
            assert (begin - 8 - n) % LINE_BYTES == 0, name
    # whole cache lines first, then the others by element size, largest first
    kinds = [((e - b) % LINE_BYTES != 0, -size) for b, e, size in sorted(sizes)]
    assert kinds == sorted(kinds), "lines first, then by element size, largest first"


def test_reader_returns_every_dtype_bit_exact(saved: tuple[Path, Any]) -> None:
    ckpt_dir, tensors = saved
    got = CheckpointReader(open_storage(ckpt_dir.parent), 12).tensors()
    for name, t in tensors.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert raw(got[name]) == raw(t), name


# --------------------------------------------------------------------------- layout

_dtypes = st.sampled_from(list(DTYPES))
_shapes = st.lists(st.integers(0, 4), max_size=3)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_dtypes, _shapes), max_size=10))
def test_plan_layout_packs_and_aligns(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    tensors = {f"t{i}": torch.zeros(shape, dtype=dt) for i, (dt, shape) in enumerate(specs)}
    slots = plan_layout(tensors)
    assert sorted(s.name for s in slots) == sorted(tensors)
    offset = 0
    for s in slots:
        t = tensors[s.name]
        assert s.begin == offset
        assert s.begin % t.element_size() == 0
        assert s.nbytes == t.numel() * t.element_size()
        assert (dtype_from_name(s.dtype), s.shape) == (t.dtype, tuple(t.shape))
        offset = s.end

    # whole cache lines first (each then starts on one), each kind by element size,
    # largest first, and in the state's order within that
    def kind(name: str) -> tuple[bool, int]:
        t = tensors[name]
        return (t.numel() * t.element_size() % LINE_BYTES != 0, -t.element_size())

    assert [kind(s.name) for s in slots] == sorted(kind(s.name) for s in slots)
    assert [s.name for s in slots] == sorted(tensors, key=kind), "stable order"
    assert all(s.begin % LINE_BYTES == 0 for s in slots if s.nbytes % LINE_BYTES == 0)


def test_plan_layout_puts_moments_on_cache_lines_past_an_optimizers_step() -> None:
    """AdamW's state in the state's order: a 4-byte ``step`` before each parameter's
    moments. Packed in that order, every moment after the first step would start 4, 8,
    ... bytes off a cache line (a copy into it took 1.19x as long)."""
    tensors: dict[str, torch.Tensor] = {}
    for i in range(3):
        tensors[f"p{i}"] = torch.zeros(1184 * 8)
    for i in range(3):
        tensors[f"step{i}"] = torch.zeros(())
        tensors[f"m{i}"] = torch.zeros(1184 * 8)
        tensors[f"v{i}"] = torch.zeros(1184 * 8)
    slots = {s.name: s for s in plan_layout(tensors)}
    for name, t in tensors.items():
        if t.numel() > 1:
            assert slots[name].begin % LINE_BYTES == 0, name
    assert [n for n, s in sorted(slots.items(), key=lambda kv: kv[1].begin)][-3:] == [
        "step0",
        "step1",
        "step2",
    ]


def test_plan_layout_refuses_unsupported_dtype() -> None:
    with pytest.raises(UnsupportedStateError, match="complex64"):
        plan_layout({"c": torch.zeros(2, dtype=torch.complex64)})


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "path",
    [
        "rank-00000.safetensors",
        "step-000000001200/manifest.json",
        "step-000000001200/rank-00003.safetensors",
        ".tmp-step-000000001200.4242.9f3c0a1b/manifest.json",
        "pins/step-000000001200",
        "audit.jsonl",
        "a/b/c/d",
        "_private",
        ".hidden",
        "...",
        "x" * 200,
        "/".join(["d" * 100] * 10),
    ],
)
def test_check_relpath_accepts(path: str) -> None:
    assert check_relpath(path) == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        ".",
        "..",
        "../escape",
        "a/../b",
        "a/..",
        "./a",
        "a/./b",
        "/etc/passwd",
        "a//b",
        "a/",
        "a\\b",
        "..\\..\\x",
        "C:\\x",
        "c:x",
        "-rf",
        "a b",
        "~user",
        "$HOME",
        "naïve",
        "a\x00b",
        "a\n",
        "manifest.json\n",
        "x" * 201,
        "/".join(["d" * 100] * 11),
        None,
        b"bytes",
        5,
        ["a"],
    ],
    ids=repr,
)
def test_check_relpath_refuses(path: Any) -> None:
    with pytest.raises(CorruptCheckpointError):
        check_relpath(path)


# --------------------------------------------------------------------------- manifest


def small_manifest(**changes: Any) -> dict[str, Any]:
    m = build_manifest(
        step=5,
        metrics={"loss": 0.5, "bad": float("nan")},
        trees=[{"dict": [["w", {"tensor": "w", "device": "cpu"}]]}],
        files={DATA_FILE: {"size": 112, "rank": 0}},
        tensors={
            "w": {
                "file": DATA_FILE,
                "dtype": "F32",
                "shape": [2, 2],
                "offsets": [96, 112],
                "xxh3_64": "0123456789abcdef",
            }
        },
    )
    m.update(changes)
    m["digest"] = manifest_digest(m)
    return m


def test_manifest_fields_and_digest_follow_the_spec() -> None:
    m = small_manifest()
    assert set(m) == {
        "format",
        "format_version",
        "step",
        "created",
        "metrics",
        "versions",
        "hostname",
        "world_size",
        "ranks",
        "files",
        "tensors",
        "digest",
    }
    assert (m["format"], m["format_version"], m["world_size"]) == ("resumable-checkpoint", 1, 1)
    assert m["metrics"] == {"loss": 0.5, "bad": "nan"}
    assert set(m["versions"]) >= {"resumable", "torch", "numpy", "python"}
    body = {k: v for k, v in m.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert m["digest"] == xxhash.xxh3_64_hexdigest(canonical)
    assert len(m["digest"]) == 16
    # The digest covers values, not the file's whitespace or key order.
    reordered = json.dumps(dict(reversed(list(m.items()))), indent=4).encode()
    assert decode_manifest(reordered, where="t") == m
    assert decode_manifest(encode_manifest(m), where="t") == m


def test_newer_format_version_is_refused_with_upgrade_advice() -> None:
    blob = encode_manifest(small_manifest(format_version=FORMAT_VERSION + 1))
    with pytest.raises(NewerFormatError) as info:
        decode_manifest(blob, where="step-000000000005")
    msg = str(info.value)
    assert f"format version {FORMAT_VERSION + 1}" in msg
    assert "upgrade resumable" in msg
    assert "step-000000000005" in msg


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None, [1]], ids=repr)
def test_malformed_format_version_is_refused(version: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match="format version"):
        decode_manifest(encode_manifest(small_manifest(format_version=version)), where="t")


def _set(path: list[Any], value: Any) -> Any:
    def change(m: dict[str, Any]) -> None:
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return change


def _drop(key: str) -> Any:
    return lambda m: m.pop(key)


MUTATIONS = {
    "other-format": _set(["format"], "something-else"),
    "step-not-int": _set(["step"], "5"),
    "step-bool": _set(["step"], True),
    "ranks-missing": _drop("ranks"),
    "files-not-dict": _set(["files"], []),
    "file-escapes": lambda m: m.update(files={"../evil": {"size": 112, "rank": 0}}),
    "file-absolute": lambda m: m.update(files={"/etc/passwd": {"size": 112, "rank": 0}}),
    "file-size-negative": _set(["files", DATA_FILE, "size"], -1),
    "tensor-unknown-file": _set(["tensors", "w", "file"], "other.safetensors"),
    "tensor-unknown-dtype": _set(["tensors", "w", "dtype"], "C64"),
    "tensor-offsets-past-file": _set(["tensors", "w", "offsets"], [112, 128]),
    "tensor-offsets-wrong-size": _set(["tensors", "w", "offsets"], [96, 108]),
    "tensor-offsets-reversed": _set(["tensors", "w", "offsets"], [112, 96]),
    "tensor-negative-dim": _set(["tensors", "w", "shape"], [-2, -2]),
    "tensor-no-checksum": lambda m: m["tensors"]["w"].pop("xxh3_64"),
    "tensor-too-many-dims": _set(["tensors", "w", "shape"], [1] * 65),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_invalid_manifests_are_refused_even_with_a_valid_digest(mutation: str) -> None:
    m = copy.deepcopy(small_manifest())
    MUTATIONS[mutation](m)
    m["digest"] = manifest_digest(m)
    with pytest.raises(CorruptCheckpointError):
        decode_manifest(json.dumps(m).encode(), where="t")


def test_edited_manifest_fails_its_digest() -> None:
    m = small_manifest()
    m["step"] = 6
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        decode_manifest(encode_manifest(m), where="t")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_standard_json_constants_are_refused(constant: bytes) -> None:
    m = small_manifest()
    created = b'"created": ' + json.dumps(m["created"]).encode()
    blob = encode_manifest(m)
    assert created in blob
    blob = blob.replace(created, b'"created": ' + constant)
    json.loads(blob)  # Python's json would accept it ...
    with pytest.raises(CorruptCheckpointError, match="non-standard JSON constant"):
        decode_manifest(blob, where="t")  # ... the manifest reader does not


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32"])
def test_manifest_not_in_utf8_is_refused(encoding: str) -> None:
    """The spec says UTF-8; json.loads alone would take UTF-16/32 bytes (and import a
    codec module to read them). Found by stress/hostile.py."""
    blob = encode_manifest(small_manifest()).decode().encode(encoding)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        decode_manifest(blob, where="t")


def _header_blob(header: dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize("dtype", [{"a": 1}, ["F32"], None, 3])
def test_safetensors_header_with_a_dtype_that_is_not_a_string_is_corrupt(dtype: Any) -> None:
    """An unhashable dtype raised TypeError (not a project error: restore did not fall
    back). Found by stress/hostile.py."""
    blob = _header_blob({"t": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}})
    with pytest.raises(CorruptCheckpointError, match="known dtype"):
        parse_safetensors_header(blob, len(blob) + 4)


_ODD = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([True, False, 2.0, None, "4", 2**63, 2**62, -(2**63)]),
)


@settings(max_examples=400, deadline=None)
@given(
    dtype=st.sampled_from(["U8", "F32", "BF16", "F64", "X9", 1]),
    n=_ODD,
    begin=_ODD,
    end=_ODD,
    size=st.integers(0, 48),
)
def test_one_dimensional_entries_are_judged_like_any_other(
    dtype: Any, n: Any, begin: Any, end: Any, size: int
) -> None:
    """A one-dimensional entry (every chunk entry of an incremental file) is checked by
    a shorter path; it accepts and refuses exactly what the general one does for the
    same entry with a trailing dimension of 1."""

    def verdict(shape: Any) -> bool:
        blob = _header_blob({"t": {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}})
        try:
            parse_safetensors_header(blob, len(blob) + size)
        except CorruptCheckpointError:
            return False
        return True

    assert verdict([n]) == verdict([n, 1])


def test_safetensors_header_not_in_utf8_is_corrupt() -> None:
    body = json.dumps({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    raw = body.encode("utf-16-le")
    blob = len(raw).to_bytes(8, "little") + raw
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        parse_safetensors_header(blob, len(blob) + 4)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_dtype_names_round_trip_and_match_safetensors(dtype: torch.dtype, tmp_path: Path) -> None:
    name = dtype_name(dtype)
    assert name == DTYPES[dtype]
    assert dtype_from_name(name) is dtype
    path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(2, dtype=dtype)}, path)
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert header["x"]["dtype"] == name, "our dtype name is safetensors' name"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.quint8])
def test_unsupported_dtype_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedStateError, match="cannot be stored") as info:
        dtype_name(dtype)
    assert isinstance(info.value, TypeError)


def test_saving_a_complex_tensor_fails_before_anything_is_written(tmp_path: Path) -> None:
    state = {"extra": {"z": torch.ones(2, dtype=torch.complex64)}}
    with resumable.Checkpointer(tmp_path, state, keep=None) as ck:
        with pytest.raises(UnsupportedStateError, match=r"state\['extra'\]\['z'\]"):
            ck.save(1)
        assert ck.steps() == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("step-", ".tmp-"))]


@pytest.mark.parametrize("name", ["C64", "f32", "", None, 5, "__class__"], ids=repr)
def test_unknown_dtype_names_are_corrupt(name: Any) -> None:
    with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
        dtype_from_name(name)


def test_numpy_dtypes_saved_as_ndarray_use_the_same_names(tmp_path: Path) -> None:
    arrays = {"u16": np.arange(3, dtype=np.uint16), "f16": np.ones(2, dtype=np.float16)}
    with resumable.Checkpointer(tmp_path, {"a": arrays}, keep=None, capture_rng=False) as ck:
        ck.save(1)
    index = CheckpointReader(open_storage(tmp_path), 1).manifest["tensors"]
    assert index["a/u16"]["dtype"] == "U16" and index["a/f16"]["dtype"] == "F16"


def test_spec_test_vectors() -> None:
    """The worked examples of docs/format.md."""
    body = {"step": 7, "created": 1e-05, "name": "é", "digest": "ignored"}
    canonical = json.dumps(
        {k: v for k, v in body.items() if k != "digest"}, sort_keys=True, separators=(",", ":")
    )
    assert canonical == '{"created":1e-05,"name":"\\u00e9","step":7}'
    assert manifest_digest(body) == "af355e439251c8e8"
    assert xxhash.xxh3_64_hexdigest(b"") == "2d06800538d394c2"


def test_unknown_manifest_fields_are_ignored_but_covered_by_the_digest() -> None:
    m = small_manifest(comment="added by a later writer")
    assert decode_manifest(encode_manifest(m), where="t")["comment"] == "added by a later writer"
    m["comment"] = "edited"
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        decode_manifest(encode_manifest(m), where="t")


def test_dtype_tables_agree_with_torch() -> None:
    """The torch-free tables (names and element sizes, what the persist worker uses)
    describe the same dtypes as torch does."""
    for dt in DTYPES:
        name = dtype_name(dt)
        assert dtype_from_name(name) is dt
        assert check_dtype_name(name) == name
        assert itemsize(name) == torch.empty((), dtype=dt).element_size(), name
    for bad in ("F128", "f32", None, 4):
        with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
            check_dtype_name(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_dtypes, _shapes), min_size=1, max_size=10), st.data())
def test_plan_layout_puts_what_other_ranks_write_last_from_a_cache_line(
    specs: list[tuple[torch.dtype, list[int]]], data: st.DataObject
) -> None:
    """A rank's replicated tensors that another rank writes go after all of its own, the
    first of them on a cache line: its own are the snapshot's first bytes (its persist
    worker writes them from shared memory), and the shared-memory layout check takes
    the gap before them and no other."""
    tensors = {f"t{i}": torch.zeros(shape, dtype=dt) for i, (dt, shape) in enumerate(specs)}
    last = set(data.draw(st.sets(st.sampled_from(sorted(tensors)))))
    slots = plan_layout(tensors, last)
    names = [s.name for s in slots]
    mine = len(tensors) - len(last)
    assert set(names[:mine]) == set(tensors) - last and set(names[mine:]) == last
    assert [s.name for s in slots[:mine]] == [
        s.name for s in plan_layout({n: t for n, t in tensors.items() if n not in last})
    ]
    for s in slots:
        assert s.begin % tensors[s.name].element_size() == 0
    if last and mine:
        assert slots[mine].begin == slots[mine - 1].end + -slots[mine - 1].end % LINE_BYTES
    cap = slots[-1].end
    assert slot_layout(layout_meta(slots), cap) == slots
    assert share_prefix(slots, last) == (slots[:mine] if mine else None)


def test_the_shared_memory_layout_check_takes_no_gap_but_the_one_to_a_cache_line() -> None:
    """A layout whose tensor starts past the previous one's end anywhere but at the next
    cache line is not one `plan_layout` makes: refused, as any malformed layout is."""
    a = TensorSlot("a", "F32", (3,), 0, 12)
    at_line = TensorSlot("b", "F32", (1,), 64, 68)
    assert slot_layout(layout_meta([a, at_line]), 68) == [a, at_line]
    for begin in (16, 128):
        off = TensorSlot("b", "F32", (1,), begin, begin + 4)
        assert slot_layout(layout_meta([a, off]), begin + 4) is None


def test_a_share_laid_out_otherwise_is_copied_out() -> None:
    """`share_prefix` gives the first slots only where they are exactly this rank's."""
    slots = [TensorSlot(n, "F32", (1,), 4 * i, 4 * i + 4) for i, n in enumerate("abcd")]
    assert share_prefix(slots, set()) == slots
    assert share_prefix(slots, {"c", "d"}) == slots[:2]
    assert share_prefix(slots, {"a", "d"}) is None  # another rank's tensor comes first
    assert share_prefix(slots, set("abcd")) is None  # nothing of its own
