"""Format version 3's compact piece table (``sources`` and ``extents``, docs/format.md
section 12): what the decoder accepts and refuses, with short lists (checked in Python)
and long ones (checked in NumPy) alike, and the overlap check against a brute-force
reference."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable.format as fmt
from resumable.errors import CorruptCheckpointError
from resumable.format import (
    build_manifest,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    tensor_ranges,
)

OWN = "rank-00000.safetensors"
OWN_SIZE = 1 << 20
REF = 3  # the earlier step referred to


def v3_manifest(n_extents: int) -> dict[str, Any]:
    """Step 5 with one F32 tensor of ``n_extents`` extents of 64 bytes, alternating
    between step 3's file and this checkpoint's own, and a whole tensor after them."""
    extents: list[int] = []
    for i in range(n_extents):
        src = i % 2
        extents += (src, 1024 + 64 * i, 1024 + 64 * (i + 1))
    tensors = {
        "t": {
            "dtype": "F32",
            "shape": [16 * n_extents],
            "xxh3_64": "0123456789abcdef",
            "sources": [{"step": REF, "file": OWN}, {"file": OWN}],
            "extents": extents,
        },
        "w": {
            "file": OWN,
            "dtype": "F32",
            "shape": [4],
            "offsets": [OWN_SIZE - 16, OWN_SIZE],
            "xxh3_64": "0123456789abcdef",
        },
    }
    return build_manifest(
        step=5,
        metrics={},
        trees=[{"dict": [["t", {"tensor": "t", "device": "cpu"}]]}],
        files={OWN: {"size": OWN_SIZE, "rank": 0}},
        tensors=tensors,
    )


def decode(m: dict[str, Any]) -> dict[str, Any]:
    m = dict(m)
    m.pop("digest", None)
    m["digest"] = manifest_digest(m)
    return decode_manifest(encode_manifest(m), where="t")


SHORT, LONG = 4, 200  # 12 integers: checked in Python; 600: in NumPy


@pytest.fixture(params=[SHORT, LONG], ids=["python", "numpy"])
def n(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def test_a_version_3_manifest_is_written_and_read(n: int) -> None:
    m = v3_manifest(n)
    assert m["format_version"] == 3 and m["refs"] == [REF]
    got = decode(m)
    ranges = tensor_ranges(got["tensors"]["t"])
    assert len(ranges) == n
    assert ranges[0] == (REF, OWN, 1024, 1088) and ranges[1] == (None, OWN, 1088, 1152)


def _ext(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"]["t"]["extents"][i] = value

    return edit


def _t(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"]["t"][key] = value

    return edit


def _src(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"]["t"]["sources"][i] = value

    return edit


def _shorten(m: dict[str, Any]) -> None:
    m["tensors"]["t"]["extents"][-1] -= 4


def _drop_triple(m: dict[str, Any]) -> None:
    del m["tensors"]["t"]["extents"][-3:]


def _one_more(m: dict[str, Any]) -> None:
    m["tensors"]["t"]["extents"].append(0)


def _overlap_inside(m: dict[str, Any]) -> None:
    ext = m["tensors"]["t"]["extents"]
    ext[7], ext[8] = ext[1], ext[2]  # the third extent repeats the first's bytes in step 3


def _overlap_whole(m: dict[str, Any]) -> None:
    ext = m["tensors"]["t"]["extents"]
    w = m["tensors"]["w"]
    w["offsets"] = [ext[4], ext[4] + 16]  # the whole tensor on the second extent's bytes


def _as_version(v: int) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = v

    return edit


def _chunks_too(m: dict[str, Any]) -> None:
    m["tensors"]["t"]["chunks"] = [{"file": OWN, "offsets": [0, 4], "xxh3_128": "0" * 32}]


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "bool-in-extents": (_ext(0, True), "flat list of integer triples"),
    "float-in-extents": (_ext(1, 1024.0), "flat list of integer triples"),
    "string-in-extents": (_ext(2, "1088"), "flat list of integer triples"),
    "negative-begin": (_ext(1, -1), "is not [source below"),
    "source-out-of-range": (_ext(0, 2), "is not [source below"),
    "negative-source": (_ext(3, -1), "is not [source below"),
    "reversed": (_ext(5, 1000), "is not [source below"),
    "past-own-file": (_ext(5, OWN_SIZE + 64), "is not [source below"),
    "huge-integer": (_ext(5, 2**64), "2**63"),
    "total-short": (_shorten, "its extents hold"),
    "triple-missing": (_drop_triple, "its extents hold"),
    "not-triples": (_one_more, "flat list of integer triples"),
    "extents-not-a-list": (_t("extents", {"0": 1}), "flat list of integer triples"),
    "extents-empty": (_t("extents", []), "flat list of integer triples"),
    "sources-empty": (_t("sources", []), "sources must be a non-empty list"),
    "sources-missing": (_t("sources", None), "sources must be a non-empty list"),
    "source-unknown-key": (_src(1, {"file": OWN, "x": 1}), "malformed source"),
    "source-not-a-dict": (_src(1, OWN), "malformed source"),
    "source-step-not-in-refs": (_src(0, {"step": 4, "file": OWN}), "refers to step 4"),
    "source-step-bool": (_src(0, {"step": True, "file": OWN}), "refers to step True"),
    "source-file-with-path": (_src(0, {"step": REF, "file": f"x/{OWN}"}), "by basename"),
    "source-file-escapes": (_src(0, {"step": REF, "file": ".."}), "refusing path"),
    "own-file-not-listed": (_src(1, {"file": "rank-00001.safetensors"}), "is not listed"),
    "overlap-inside": (_overlap_inside, "overlap in rank-00000.safetensors of step 3"),
    "overlap-with-whole": (_overlap_whole, "overlap in rank-00000.safetensors at byte"),
    "extents-in-version-2": (_as_version(2), "extents are a format version 3 feature"),
    "chunks-in-version-3": (_chunks_too, "chunks are a format version 2 feature"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_damaged_piece_table_is_refused_with_its_reason(n: int, mutation: str) -> None:
    edit, reason = MUTATIONS[mutation]
    m = copy.deepcopy(v3_manifest(n))
    edit(m)
    with pytest.raises(CorruptCheckpointError, match=re.escape(reason)):
        decode(m)


def test_version_1_has_neither_refs_nor_extents() -> None:
    m = v3_manifest(SHORT)
    m["format_version"] = 1
    with pytest.raises(CorruptCheckpointError, match="refs are a format version 2 and 3"):
        decode(m)
    del m["refs"]
    with pytest.raises(CorruptCheckpointError, match="extents are a format version 3 feature"):
        decode(m)


def _verdict(sources: list[Any], extents: list[Any], nbytes: int) -> str:
    try:
        fmt._check_extents(sources, extents, nbytes, {OWN: {"size": 4096}}, {REF}, "bad")
    except CorruptCheckpointError as exc:
        return str(exc).split(":")[1].split(" ")[1]  # the kind of refusal, not its numbers
    return "ok"


_INTS = st.one_of(
    st.integers(min_value=-3, max_value=4200),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), 4096, 4097]),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    triples=st.lists(st.tuples(st.integers(-1, 2), _INTS, _INTS), min_size=1, max_size=40),
    nbytes=st.integers(0, 9000),
)
def test_python_and_numpy_checks_agree(triples: list[tuple[Any, Any, Any]], nbytes: int) -> None:
    """The same extents list gets the same verdict below and above ``_NUMPY_FROM``."""
    sources = [{"step": REF, "file": OWN}, {"file": OWN}]
    extents = [x for t in triples for x in t]
    saved = fmt._NUMPY_FROM
    try:
        fmt._NUMPY_FROM = 1 << 62
        by_python = _verdict(sources, extents, nbytes)
        fmt._NUMPY_FROM = 0
        by_numpy = _verdict(sources, extents, nbytes)
    finally:
        fmt._NUMPY_FROM = saved
    assert by_python == by_numpy


@settings(max_examples=300, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.sampled_from([None, REF]), st.integers(0, 60), st.integers(0, 12)),
        min_size=1,
        max_size=60,
    ),
    split=st.integers(1, 4),
)
def test_the_overlap_check_matches_a_brute_force_one(
    spans: list[tuple[int | None, int, int]], split: int
) -> None:
    """Ranges spread over up to four tensors, long ones (NumPy) and short ones: refused
    exactly when two of them share a byte."""
    tensors: dict[str, dict[str, Any]] = {}
    for k in range(split):
        mine = spans[k::split]
        if not mine:
            continue
        steps = sorted({s for s, _, _ in mine}, key=lambda s: -1 if s is None else s)
        index = {s: i for i, s in enumerate(steps)}
        extents = [x for s, b, ln in mine for x in (index[s], b, b + ln)]
        tensors[f"t{k}"] = {
            "sources": [{"file": OWN} if s is None else {"step": s, "file": OWN} for s in steps],
            "extents": extents,
        }
    ranges = [(s, b, e, name) for name, t in tensors.items() for s, _f, b, e in tensor_ranges(t)]
    # sharing a byte; an empty range strictly inside another counts, as it always has
    clash = any(
        r[0] == q[0] and r[1] < q[2] and q[1] < r[2]
        for i, r in enumerate(ranges)
        for q in ranges[i + 1 :]
    )
    for numpy_from in (0, 1 << 62):
        saved = fmt._NUMPY_FROM
        fmt._NUMPY_FROM = numpy_from
        try:
            if clash:
                with pytest.raises(CorruptCheckpointError, match="overlap"):
                    fmt._check_disjoint(tensors, "t")
            else:
                fmt._check_disjoint(tensors, "t")
        finally:
            fmt._NUMPY_FROM = saved


# --- the digest checked on the bytes read (`format._digest_ok`) ----------------------


def _no_full_check(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the full digest checks (parse, encode again, hash) that decoding makes."""
    calls: list[int] = []
    real = fmt.manifest_digest

    def counted(m: Any) -> str:
        calls.append(1)
        return real(m)

    monkeypatch.setattr(fmt, "manifest_digest", counted)
    return calls


def test_a_manifest_with_extents_is_written_in_the_digests_own_form(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's bytes, less the digest member, are what the digest hashes: the
    reader checks them as read, without encoding the manifest again."""
    m = v3_manifest(n)
    data = encode_manifest(m)
    member = b',"digest":"' + m["digest"].encode() + b'"'
    assert data.count(member) == 1
    assert fmt.checksum(data.replace(member, b"")) == m["digest"] == manifest_digest(m)
    calls = _no_full_check(monkeypatch)
    assert (
        decode_manifest(data, where="t")["tensors"]["t"]["extents"] == m["tensors"]["t"]["extents"]
    )
    assert calls == []


def test_a_manifest_in_another_form_gets_the_full_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Manifests written before (keys in insertion order) or indented are read as
    before: parsed, encoded again and hashed."""
    m = v3_manifest(LONG)
    calls = _no_full_check(monkeypatch)
    forms = [
        json.dumps(m, separators=(",", ":")).encode(),  # as version 3 was first written
        json.dumps(m, indent=1).encode(),
    ]
    for i, data in enumerate(forms):
        got = decode_manifest(data, where="t")
        assert got["step"] == 5 and len(calls) == i + 1, i


@pytest.mark.parametrize("where", ["extents", "metrics", "digest"])
def test_a_changed_byte_of_a_manifest_in_the_digests_form_is_caught(n: int, where: str) -> None:
    """One digit changed anywhere (an extent, a metric, the digest itself) fails both
    the check on the bytes and the full one."""
    m = v3_manifest(n)
    m["metrics"] = {"loss": 12345}
    m.pop("digest")
    m["digest"] = manifest_digest(m)
    data = encode_manifest(m)
    needle = {
        "extents": b"1088,",
        "metrics": b"12345",
        "digest": m["digest"].encode(),
    }[where]
    at = data.index(needle)
    swap = b"2" if data[at : at + 1] != b"2" else b"3"
    bad = data[:at] + swap + data[at + 1 :]
    with pytest.raises(CorruptCheckpointError, match="digest mismatch"):
        decode_manifest(bad, where="t")


@settings(max_examples=300, deadline=None)
@given(bit=st.integers(min_value=0), n_extents=st.sampled_from([SHORT, LONG]))
def test_any_flipped_bit_of_a_manifest_in_the_digests_form_is_caught_or_harmless(
    bit: int, n_extents: int
) -> None:
    """One bit flipped anywhere in the bytes the writer wrote: the manifest is refused,
    or it parses to the very same document (a hex digit's case in an escape, say)."""
    written = encode_manifest(v3_manifest(n_extents))
    data = bytearray(written)
    bit %= len(data) * 8
    data[bit // 8] ^= 1 << (bit % 8)
    try:
        got = decode_manifest(bytes(data), where="t")
    except CorruptCheckpointError:
        return
    want = decode_manifest(written, where="t")
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
