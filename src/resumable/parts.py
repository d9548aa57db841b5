"""The split manifest of several ranks (format versions 4 to 7): one part per rank, one top.

Each rank writes its part (its state tree, its tensor index, where the replicated
tensors its tree names lie) beside its data file, and reports only the part's name,
size and checksum. Rank 0 commits a top manifest that lists the N parts, so its work
and the bytes it reads grow by a small entry per rank, not by every tensor. A reader
checks a part against the top's size and checksum before it parses a byte of it.
Trade-off: a reader of the whole checkpoint reads N + 1 objects instead of one; a
rank restoring at the same world size reads the top, its own part and those holding
the replicated tensors it needs (`read_merged`). ``docs/format.md`` section 13.

From version 7 a part is stored gzip'd (`encode_part`): a part repeats its tree's names
and paths, which compress several times over, so the metadata a checkpoint of many
ranks writes, and a restoring rank reads, shrinks as much. ``docs/format.md`` section 16.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from resumable._lazy import numpy_module
from resumable.errors import CorruptCheckpointError
from resumable.format import (
    ALIAS_VERSION,
    CHECKSUM,
    GZIP_PARTS_VERSION,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    SEGMENT_VERSION,
    SPLIT_VERSION,
    check_body,
    check_relpath,
    checksum,
    manifest_header,
    no_gc,
)
from resumable.tree import has_repeats

if TYPE_CHECKING:
    import numpy as np
else:
    np = numpy_module()  # loaded at its first use: a persist worker may need none

PART_FORMAT = "resumable-checkpoint-part"
MAX_PART_BYTES = MAX_MANIFEST_BYTES
_HASH64 = re.compile(r"^[0-9a-f]{16}$")


GZIP_LEVEL = 6
"""zlib's default. A part is written once per checkpoint, beside a data file of
megabytes, so its size counts for more than the milliseconds of compressing it."""


def part_file(rank: int) -> str:
    """The name of ``rank``'s part inside an attempt (version 7: gzip'd JSON)."""
    return f"part-{rank:05d}.json.gz"


def encode_part(
    *,
    step: int,
    rank: int,
    file: str,
    tree: Any,
    tensors: Mapping[str, Mapping[str, Any]],
    holders: Mapping[str, int],
) -> tuple[bytes, int]:
    """One rank's part: its tree, the entries of its data file ``file`` and, for each
    replicated tensor its tree names but another rank writes, that rank (``holders``);
    as stored (gzip, no file name or time in its header, so the same part gives the same
    bytes) and its JSON's length."""
    part = {
        "format": PART_FORMAT,
        "step": int(step),
        "rank": int(rank),
        "file": file,
        "tree": tree,
        "tensors": {k: dict(v) for k, v in tensors.items()},
        "holders": {k: int(v) for k, v in holders.items()},
    }
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return gzip.compress(text, compresslevel=GZIP_LEVEL, mtime=0), len(text)


def part_entry(rank: int, key: str, blob: bytes, json_size: int) -> dict[str, Any]:
    """The top manifest's entry for a part written as ``key`` with bytes ``blob``, whose
    JSON, gzip'd into ``blob``, has ``json_size`` bytes."""
    return {
        "rank": rank,
        "file": key,
        "size": len(blob),
        CHECKSUM: checksum(blob),
        "json_size": json_size,
    }


def build_top(
    *,
    step: int,
    metrics: Mapping[str, Any] | None,
    files: Mapping[str, Mapping[str, Any]],
    parts: list[Mapping[str, Any]],
    refs: list[int],
    world_size: int,
    objects: Mapping[str, Mapping[str, Any]] | None = None,
    segments: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """The top manifest of a split checkpoint and its bytes, version 7 (gzip'd parts,
    whose trees may reference a stored tensor from several places, as version 5's): the
    header fields of a version 1 manifest, the data ``files``, the ``parts``
    (`part_entry`, in rank order) and the steps any part refers to. Encoded once, in
    the digest's form (keys sorted, no whitespace), the digest appended as the last
    member: the bytes without it are those the digest covers (`format.manifest_digest`),
    which a reader checks by hashing them. Rank 0 builds it while every rank waits: one
    JSON encoding, not two. With ``objects`` and ``segments`` (`resumable.nodes`: the
    files and parts lie in objects shared by the ranks of a node), as version 6's."""
    m: dict[str, Any] = {
        **manifest_header(
            step=step, version=GZIP_PARTS_VERSION, metrics=metrics, world_size=world_size
        ),
        "files": {k: dict(v) for k, v in files.items()},
        "parts": [dict(p) for p in parts],
        "refs": sorted(set(refs)),
    }
    if segments is not None:
        m["objects"] = {k: dict(v) for k, v in (objects or {}).items()}
        m["segments"] = {k: dict(v) for k, v in segments.items()}
    body = json.dumps(m, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    m["digest"] = checksum(body)
    return m, body[:-1] + b',"digest":' + json.dumps(m["digest"]).encode() + b"}"


def check_parts(m: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """The ``parts`` of a split top manifest: one per rank, in rank order, each a safe
    name not among the data files, a size within `MAX_PART_BYTES` and a checksum; from
    version 7 the length of its JSON (gzip'd), within `MAX_PART_BYTES` too, before it.
    Raises `CorruptCheckpointError`."""
    parts = m.get("parts")
    world = m["world_size"]
    gz = m["format_version"] >= GZIP_PARTS_VERSION
    if type(parts) is not list or len(parts) != world:
        raise CorruptCheckpointError(
            f"{where}: a split manifest lists one part per rank ({world}); found {str(parts)[:100]}"
        )
    names: set[str] = set()
    json_size = f", json_size <= {MAX_PART_BYTES}" if gz else ""
    for i, p in enumerate(parts):
        size = p.get("size") if isinstance(p, dict) else None
        if (
            not isinstance(p, dict)
            or p.get("rank") != i
            or type(size) is not int
            or not 0 <= size <= MAX_PART_BYTES
            or type(p.get(CHECKSUM)) is not str
            or not _HASH64.fullmatch(p[CHECKSUM])
            or (gz and not _json_size_ok(p.get("json_size")))
            or (not gz and "json_size" in p)
        ):
            raise CorruptCheckpointError(
                f"{where}: part {i} must be {{rank, file, size <= {MAX_PART_BYTES}, "
                f"{CHECKSUM}{json_size}}} in a manifest of version {m['format_version']}, "
                f"found {str(p)[:200]}"
            )
        name = check_relpath(p.get("file"))
        if name in m["files"] or name in names:
            raise CorruptCheckpointError(f"{where}: part {i}'s file {name!r} is named twice")
        names.add(name)
    return list(parts)


def _json_size_ok(n: Any) -> bool:
    return type(n) is int and 0 < n <= MAX_PART_BYTES


def decode_part(data: bytes, entry: Mapping[str, Any], step: int, where: str) -> dict[str, Any]:
    """A part's bytes, checked against its top entry (size, checksum) before they are
    decompressed (version 7: no more than the JSON's declared length) and parsed, then
    its fields. Raises `CorruptCheckpointError`."""
    rank = entry["rank"]
    what = f"{where}: part {rank} ({entry['file']})"
    if len(data) != entry["size"]:
        raise CorruptCheckpointError(
            f"{what} has {len(data)} bytes, the manifest declares {entry['size']} "
            "(truncated or overwritten)"
        )
    if checksum(data) != entry[CHECKSUM]:
        raise CorruptCheckpointError(f"{what}: checksum mismatch (edited or corrupt)")
    if "json_size" in entry:
        data = _gunzip(data, entry["json_size"], what)
    try:
        with no_gc():
            part = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject)
    except RecursionError:
        raise CorruptCheckpointError(f"{what} is nested too deeply") from None
    except ValueError as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON ({exc})") from None
    if (
        not isinstance(part, dict)
        or part.get("format") != PART_FORMAT
        or part.get("rank") != rank
        or part.get("step") != step
        or not isinstance(part.get("tensors"), dict)
        or not isinstance(part.get("holders"), dict)
        or "tree" not in part
    ):
        raise CorruptCheckpointError(f"{what} is not rank {rank}'s part of step {step}")
    if not _depth_within(part, MAX_JSON_DEPTH):
        raise CorruptCheckpointError(f"{what} is nested more than {MAX_JSON_DEPTH} levels")
    return part


def _gunzip(data: bytes, size: int, what: str) -> bytes:
    """The one gzip member ``data`` holds, which must decompress to exactly ``size``
    bytes: decompression stops one byte past ``size``, so a part that would grow beyond
    its declared length (a decompression bomb) costs no more memory than that length."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # a gzip header and trailer
    try:
        out = d.decompress(data, size + 1)
    except zlib.error as exc:
        raise CorruptCheckpointError(f"{what} is not gzip data ({exc})") from None
    if len(out) != size or not d.eof or d.unused_data or d.unconsumed_tail:
        raise CorruptCheckpointError(
            f"{what}: its gzip data does not decompress to one member of the "
            f"{size} bytes the manifest declares"
        )
    return out


def _reject(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _depth_within(doc: Any, limit: int) -> bool:
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return False
        children = value.values() if type(value) is dict else value
        for child in children:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return True


def merge(
    top: Mapping[str, Any],
    parts: Mapping[int, Mapping[str, Any]],
    where: str,
    arrays: dict[str, np.ndarray] | None = None,
    *,
    tree_of: int | None = None,
) -> dict[str, Any]:
    """The manifest of a version 4 checkpoint as versions 1 to 3 lay it out (``ranks``,
    ``tensors``), from its top and the decoded ``parts``, validated as a whole manifest
    is (`format.check_body`). With some ranks' parts only, ``partial`` is True and
    ``ranks`` holds the tree of ``tree_of`` alone (the rank restoring; the others
    None). A part's entries may name its own data file only (and files of the steps
    the top refers to). Raises `CorruptCheckpointError`."""
    world = top["world_size"]
    own = {info["rank"]: name for name, info in top["files"].items() if "rank" in info}
    tensors: dict[str, Any] = {}
    ranks: list[dict[str, Any]] = [{"rank": i, "tree": None} for i in range(world)]
    for r in sorted(parts):
        part = parts[r]
        fname = own.get(r)
        if part.get("file") != fname:
            raise CorruptCheckpointError(
                f"{where}: part {r} names data file {str(part.get('file'))[:100]!r}, the "
                f"manifest lists {fname!r} for rank {r}"
            )
        for name, info in part["tensors"].items():
            if name in tensors:
                if _same_piece(tensors[name], info):
                    continue  # a shard that data-parallel replicas each wrote: read once
                raise CorruptCheckpointError(f"{where}: tensor {name[:100]!r} is in two parts")
            for _step, f in _own_files(info):
                if f != fname:
                    raise CorruptCheckpointError(
                        f"{where}: part {r}'s tensor {name[:100]!r} lies in {str(f)[:100]!r}, "
                        "not in its rank's data file"
                    )
            tensors[name] = info
    complete = len(parts) == world
    for r in parts:
        if complete or r == tree_of:
            ranks[r] = {"rank": r, "tree": parts[r]["tree"]}
    m = {k: v for k, v in top.items() if k != "parts"}
    m["ranks"], m["tensors"] = ranks, tensors
    m["partial"] = not complete
    check_body(m, top["format_version"], where, arrays, complete=complete)
    return m


def read_merged(
    top: Mapping[str, Any],
    read: Callable[[Mapping[str, Any]], bytes],
    *,
    step: int,
    where: str,
    rank: int | None = None,
    arrays: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The manifest of a version 4 checkpoint from its validated ``top`` (`check_parts`),
    merged (`merge`) from the parts it reads. ``read`` returns the bytes of one entry
    of ``top["parts"]``, refusing more than its declared size; each part is then
    checked by `decode_part` before it is parsed. With ``rank`` (a rank restoring at
    the world size saved with), it reads that rank's part and the parts holding the
    replicated tensors its tree names (`holders_of`); every part where those do not
    hold every global tensor it names (`held`), or where ``rank`` is None or out of
    range. ``arrays`` as `merge`'s. Raises `CorruptCheckpointError`."""
    entries = top["parts"]

    def part(entry: Mapping[str, Any]) -> dict[str, Any]:
        return decode_part(read(entry), entry, step, where)

    parts: dict[int, dict[str, Any]] = {}
    if rank is not None and 0 <= rank < len(entries):
        own = part(entries[rank])
        parts[rank] = own
        for r in sorted(holders_of(own, len(entries), where) - {rank}):
            parts[r] = part(entries[r])
        if not held(own["tree"], parts):
            rank = None  # its part does not say where all it names lies
    if rank is None:
        for e in entries:
            if e["rank"] not in parts:
                parts[e["rank"]] = part(e)
    return merge(top, parts, where, arrays, tree_of=rank)


def top_sizes(top: Mapping[str, Any]) -> dict[str, int]:
    """Every object a validated top manifest names, its data files and its parts, with
    the size it declares: what a listing of the checkpoint must show. Of version 6, the
    objects its files and parts lie in (`format.check_segments` checked they fit)."""
    if "objects" in top:
        return {k: info["size"] for k, info in top["objects"].items()}
    sizes = {f: info["size"] for f, info in top["files"].items()}
    sizes.update({p["file"]: p["size"] for p in top["parts"]})
    return sizes


def flatten(m: Mapping[str, Any]) -> dict[str, Any]:
    """A merged manifest of every part (`merge`) as one manifest of version 1, or 3
    where an entry has extents, or 5 where a tree references a stored tensor from
    several places (as version 5 may, and 6 and 7 may): what a copy elsewhere commits
    (`pipeline.mirror`), without its digest (the caller signs what it changed), in the
    lowest version that holds it, which the most readers read."""
    out = {
        k: v for k, v in m.items() if k not in ("parts", "partial", "digest", "objects", "segments")
    }
    if out.get("format_version") in (SEGMENT_VERSION, GZIP_PARTS_VERSION):
        tied = any(has_repeats(r["tree"]) for r in out["ranks"])
        out["format_version"] = ALIAS_VERSION if tied else SPLIT_VERSION
    if out.get("format_version") != SPLIT_VERSION:
        return out  # version 5 keeps its refs (a list from version 2 on)
    extents = any("extents" in t for t in out["tensors"].values())
    out["format_version"] = 3 if extents else 1
    if not extents:
        out.pop("refs", None)
    return out


def _same_piece(a: Any, b: Any) -> bool:
    """Whether two parts' entries of one name hold the same bytes: a shard of a global
    tensor (``fqn``) that ranks holding it alike each wrote (a tensor-parallel shard on
    every data-parallel replica), of the same dtype, shape, place and checksum. The
    first part's entry is kept; the other is a copy (each was checked as its part was)."""
    keys = ("fqn", "global_shape", "global_offset", "dtype", "shape", CHECKSUM)
    return (
        isinstance(a, dict)
        and isinstance(b, dict)
        and ("global_offset" in a or "fqn" in a)
        and all(a.get(k) == b.get(k) for k in keys)
    )


def _own_files(info: Any) -> Iterator[tuple[None, Any]]:
    """The files of this checkpoint an entry (not yet validated) names."""
    if not isinstance(info, dict):
        return
    if "file" in info:
        yield None, info["file"]
    sources = info.get("sources")
    if isinstance(sources, list):
        for s in sources:
            if isinstance(s, dict) and "step" not in s:
                yield None, s.get("file")


def holders_of(part: Mapping[str, Any], world: int, where: str) -> set[int]:
    """The ranks whose parts hold the replicated tensors ``part``'s tree names."""
    out: set[int] = set()
    for name, r in part["holders"].items():
        if type(r) is not int or not 0 <= r < world or not isinstance(name, str):
            raise CorruptCheckpointError(
                f"{where}: part {part['rank']} says {str(name)[:100]!r} is held by rank "
                f"{str(r)[:20]}, not a rank below {world}"
            )
        out.add(r)
    return out


def global_names(tree: Any) -> set[str]:
    """The fqn of every ``global`` node of a (depth-checked) tree, walked iteratively."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            g = node.get("global")
            if type(g) is str:
                out.add(g)
            stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
    return out


def held(tree: Any, parts: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether every global tensor ``tree`` names has pieces in one of ``parts``."""
    have: set[str] = set()
    for part in parts.values():
        for name, info in part["tensors"].items():
            have.add(info.get("fqn", name) if isinstance(info, dict) else name)
    return global_names(tree) <= have
