"""Campaign 4b, corruption of two-rank checkpoints: campaign 4 (`stress.corruption`)
for checkpoints written by a job of two ranks, with the damage a checkpoint of several
ranks can take besides that of one.

Two ranks forked from this process (`stress.ioranks.Pair`: a real gloo group, the
coordinated commit of ``persist="sync"``) commit steps 1 to 4 of a job whose model is
replicated (its weight lands in rank 0's data file, its bias in rank 1's) and whose
``mine`` tensor is per rank. Each checkpoint holds ``rank-00000.safetensors``,
``rank-00001.safetensors``, each rank's part of the manifest and the top rank 0
wrote (format version 7: parts gzip'd; a part edited and re-signed is gzip'd again and
signed in the top too).
The files are read into memory once; each trial copies the newest two checkpoints
(steps 3 and 4) into a `MemoryStorage`, damages step 4 with one mutation drawn by seed, and runs
`CheckpointReader.verify` (what a restore runs first). The kinds, in turn:

- those of campaign 4, on any of the three files: ``flip`` (one bit), ``truncate``,
  ``extend``, ``zero-page`` (a 4 KiB page that was not all zeros), ``missing``,
  ``swap`` (the same file of step 1, 2 or 3), ``edit`` (one value of the manifest, the
  digest left alone) and ``edit-resigned`` (one value of its tensor index or file
  table, the digest recomputed, as a forger would);
- and those of several ranks: ``rank-missing`` (one rank's data file deleted),
  ``rank-swap`` (rank 1's file in rank 0's place, rank 0's in rank 1's, or the two
  exchanged), ``rank-step-swap`` (one rank's file replaced by the same rank's file of
  step 1, 2 or 3), ``world-size`` (the manifest lists another world size, 0 to 8, the
  digest recomputed or not), ``offsets`` (one tensor's byte range shifted, grown,
  shrunk or pointed at the other rank's file, the digest recomputed or not) and
  ``rank-table`` (the file table's ranks exchanged, or a rank's entry or file dropped,
  the digest recomputed or not; or the ranks' trees exchanged, the digest left alone:
  recomputed, that would be a forger's consistent manifest, in which rank 0 restores
  rank 1's per-rank state, and which campaign 4 also leaves out by re-signing only the
  tensor index and the file table).

Verdicts as in campaign 4: detected (a `CheckpointError`, or step 4 no longer listed),
harmless (it verifies and loads every tensor and tree exactly as saved), or a failure
(an undetected change, or any other exception). Every harmless mutation, and in every
``restore_every`` trials the first of each kind (14 in a row), has its damaged root
written to disk, where both ranks restore with a fresh `Checkpointer`; both must come
back at step 3 (step 4 for a harmless mutation) with
exactly the values saved at that step.

Broken path: the reader with its checksum comparison switched off, which must let
flips in the tensor data go undetected.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import shutil
import tempfile
import time
from typing import Any

import torch

from resumable.commit import step_dir
from resumable.format import CHECKSUM, checksum, manifest_digest
from resumable.parts import part_file
from resumable.reader import CheckpointReader
from stress.corruption import _edit, _loaded, _storage, judge
from stress.ioranks import TRIAL_TIMEOUT_S, WORLD, Pair

SIZES = {
    "small": {"mutations": 1_400, "restore_every": 700},
    "full": {"mutations": 100_000, "restore_every": 5_000},
}
SEED = 14
STEPS = (1, 2, 3, 4)
NEWEST = STEPS[-1]
KEPT = STEPS[-2:]  # the checkpoints each trial's root holds: the damaged one, the fallback
MANIFEST = "manifest.json"
RANK_FILES = tuple(f"rank-{r:05d}.safetensors" for r in range(WORLD))
PART_FILES = tuple(part_file(r) for r in range(WORLD))
FILES = (MANIFEST, *RANK_FILES, *PART_FILES)
KINDS = (
    "flip",
    "truncate",
    "extend",
    "zero-page",
    "missing",
    "swap",
    "edit",
    "edit-resigned",
    "rank-missing",
    "rank-swap",
    "rank-step-swap",
    "world-size",
    "offsets",
    "rank-table",
)


def saved_files(pair: Pair, tmp: str) -> dict[str, bytes]:
    """The files of steps 1..4 committed by the two ranks of ``pair``, by path."""
    root = os.path.join(tmp, "saved")
    got = pair.ask([{"op": "base", "root": root, "steps": list(STEPS)}] * WORLD, TRIAL_TIMEOUT_S)
    if got is None or any("failed" in a for a in got):
        raise RuntimeError(f"the two-rank job could not save steps {STEPS}: {got}")
    files = {}
    for step in STEPS:
        for name in FILES:
            path = f"{step_dir(step)}/{name}"
            with open(os.path.join(root, path), "rb") as f:
                files[path] = f.read()
    shutil.rmtree(root)
    return files


class _Docs:
    """Step 4's manifest as documents to edit (format version 7): the top and each
    rank's part, written back with `store` (a part gzip'd as the writer does), the
    edited parts signed again in the top and the top's digest recomputed where asked
    (as a forger would)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        d = step_dir(NEWEST)
        self.top: dict[str, Any] = json.loads(files[f"{d}/{MANIFEST}"])
        self.parts = [json.loads(gzip.decompress(files[f"{d}/{name}"])) for name in PART_FILES]
        self.edited: set[int] = set()

    def part(self, rng: random.Random) -> dict[str, Any]:
        r = rng.randrange(WORLD)
        self.edited.add(r)
        return self.parts[r]

    def store(self, out: dict[str, bytes], resign: bool) -> None:
        d = step_dir(NEWEST)
        for r in sorted(self.edited):
            text = json.dumps(self.parts[r], indent=1).encode()
            blob = gzip.compress(text, mtime=0)
            out[f"{d}/{PART_FILES[r]}"] = blob
            if resign:
                for entry in self.top["parts"]:
                    if entry.get("file") == PART_FILES[r]:
                        entry.update(
                            size=len(blob), json_size=len(text), **{CHECKSUM: checksum(blob)}
                        )
        if resign:
            self.top["digest"] = manifest_digest(self.top)
        out[f"{d}/{MANIFEST}"] = json.dumps(self.top, indent=1).encode()


def _manifest_edit(docs: _Docs, kind: str, rng: random.Random) -> str:
    """Change step 4's manifest (``docs``) in place for a several-rank ``kind``."""
    top = docs.top
    if kind == "world-size":
        was = top["world_size"]
        top["world_size"] = rng.choice([w for w in range(9) if w != was])
        return f"world_size {was} -> {top['world_size']}"
    if kind == "offsets":
        part = docs.part(rng)
        name = rng.choice(sorted(part["tensors"]))
        entry = part["tensors"][name]
        b, e = entry["offsets"]
        how = rng.choice(("shift", "grow", "shrink", "file"))
        if how == "file":
            others = [f for f in RANK_FILES if f != entry["file"]]
            entry["file"] = others[0]
            return f"{name} pointed at {others[0]}"
        d = rng.choice((1, 2, 4, 8, 64, 4096))
        sign = rng.choice((-1, 1))
        if how == "shift":
            entry["offsets"] = [b + sign * d, e + sign * d]
        elif how == "grow":
            entry["offsets"] = [b, e + d] if sign > 0 else [b - d, e]
        else:
            entry["offsets"] = [b, e - d] if sign > 0 else [b + d, e]
        return f"{name} offsets [{b}, {e}] -> {entry['offsets']}"
    # rank-table
    how = rng.choice(("file-ranks", "trees", "drop-rank", "drop-file"))
    if how == "file-ranks":
        a, b = (top["files"][f] for f in RANK_FILES)
        a["rank"], b["rank"] = b["rank"], a["rank"]
    elif how == "trees":
        p0, p1 = docs.parts
        p0["tree"], p1["tree"] = p1["tree"], p0["tree"]
        docs.edited.update(range(WORLD))
        return how  # never re-signed: that is a forger's new manifest, not damage
    elif how == "drop-rank":
        top["parts"].pop(rng.randrange(len(top["parts"])))
    else:
        top["files"].pop(rng.choice(RANK_FILES))
    return how


def mutate(files: dict[str, bytes], kind: str, rng: random.Random) -> tuple[dict[str, bytes], str]:
    """The checkpoints of `KEPT` with step 4 damaged by ``kind``; and what was done."""
    out = {p: files[p] for s in KEPT for p in (f"{step_dir(s)}/{n}" for n in FILES)}
    d = step_dir(NEWEST)
    older = rng.choice(STEPS[:-1])
    if kind in ("rank-missing", "rank-swap", "rank-step-swap"):
        r = rng.randrange(WORLD)
        mine, other = f"{d}/{RANK_FILES[r]}", f"{d}/{RANK_FILES[1 - r]}"
        if kind == "rank-missing":
            del out[mine]
            return out, f"{RANK_FILES[r]} deleted"
        if kind == "rank-step-swap":
            out[mine] = files[f"{step_dir(older)}/{RANK_FILES[r]}"]
            return out, f"{RANK_FILES[r]} of step {older}"
        if rng.random() < 1 / 3:
            out[mine], out[other] = files[other], files[mine]
            return out, "the two ranks' files exchanged"
        out[mine] = files[other]
        return out, f"{RANK_FILES[1 - r]} in the place of {RANK_FILES[r]}"
    if kind in ("world-size", "offsets", "rank-table"):
        docs = _Docs(files)
        what = _manifest_edit(docs, kind, rng)
        resign = what != "trees" and rng.random() < 0.5
        docs.store(out, resign)
        return out, what + (", re-signed" if resign else "")
    name = rng.choice(FILES)
    path = f"{d}/{name}"
    data = bytearray(out[path])
    if kind == "flip":
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        what = f"bit {bit} of {name}"
    elif kind == "truncate":
        cut = rng.randrange(len(data))
        del data[cut:]
        what = f"{name} cut at {cut}"
    elif kind == "extend":
        n = rng.randint(1, 4096)
        data += rng.randbytes(n)
        what = f"{n} bytes appended to {name}"
    elif kind == "zero-page":
        pages = [p for p in range(0, len(data), 4096) if any(data[p : p + 4096])]
        p = rng.choice(pages)
        data[p : p + 4096] = bytes(len(data[p : p + 4096]))
        what = f"page at {p} of {name} zeroed"
    elif kind == "missing":
        del out[path]
        return out, f"{name} deleted"
    elif kind == "swap":
        data = bytearray(files[f"{step_dir(older)}/{name}"])
        what = f"{name} of step {older}"
    else:  # an edit of the top or of a part; re-signed, of the tables a forger would
        docs = _Docs(files)
        under: tuple[str, ...]
        if rng.random() < 0.5:
            doc, under, where = docs.top, ("files", "parts"), MANIFEST
        else:
            doc, under, where = docs.part(rng), ("tensors",), "a part"
        resign = kind == "edit-resigned"
        what = ("edited and re-signed " if resign else "edited ") + where + " "
        what += _edit(doc, rng, under if resign else None)
        docs.store(out, resign)
        return out, what
    out[path] = bytes(data)
    return out, what


def restores_older(pair: Pair, root: str, files: dict[str, bytes], verdict: str) -> str | None:
    """Both ranks restore from the damaged checkpoints written to ``root``; what went
    wrong, or None."""
    shutil.rmtree(root, ignore_errors=True)
    for path, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "wb") as f:
            f.write(data)
    back = pair.ask([{"op": "restore", "root": root}] * WORLD, TRIAL_TIMEOUT_S)
    if back is None:
        return f"a rank did not answer its restore within {TRIAL_TIMEOUT_S}s"
    want = NEWEST if verdict == "harmless" else NEWEST - 1
    for r, b in enumerate(back):
        if "failed" in b:
            return f"rank {r}'s restore failed: {b['failed']}"
        if b["restored"] != want or not b["same"]:
            return (
                f"rank {r} restored step {b['restored']} (values as saved: {b['same']}), not {want}"
            )
    return None


def run(size: str) -> dict[str, Any]:
    from torch.distributed import TCPStore

    cfg = SIZES[size]
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # nothing of OpenMP's running when this process forks
    verdicts: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    examples: list[dict[str, Any]] = []
    restores = failures = 0
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    pair = Pair(store.port)
    try:
        with tempfile.TemporaryDirectory(prefix="corruptranks-") as tmp:
            files = saved_files(pair, tmp)
            reference = _loaded(_storage(files))
            saving = time.perf_counter() - t0
            rng = random.Random(SEED)
            for i in range(cfg["mutations"]):
                kind = KINDS[i % len(KINDS)]
                damaged, what = mutate(files, kind, rng)
                verdict = judge(damaged, reference)
                bad = verdict not in ("detected", "harmless")
                turn = i % cfg["restore_every"] < len(KINDS)  # each kind in turn
                if not bad and (turn or verdict == "harmless"):
                    restores += 1
                    wrong = restores_older(pair, os.path.join(tmp, "root"), damaged, verdict)
                    if wrong is not None:
                        verdict, bad = wrong, True
                key = verdict.split(":", 1)[0]
                verdicts[kind][key] = verdicts[kind].get(key, 0) + 1
                if bad:
                    failures += 1
                    if len(examples) < 5:
                        examples.append(
                            {"trial": i, "kind": kind, "what": what, "verdict": verdict}
                        )
    finally:
        pair.close(kill=True)
        del store
        logger.setLevel(level)
    return {
        "trials": cfg["mutations"],
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "ranks": WORLD,
            "mutations_by_kind": verdicts,
            "restores_checked": restores,
            "restores_at_two_ranks": True,
            "saving_seconds": round(saving, 1),
            "checkpoint_bytes": {
                k: len(v) for k, v in files.items() if k.startswith(step_dir(NEWEST))
            },
            "examples": examples,
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks with the checksum comparison switched off (a reader that trusts the
    tensor bytes): flips in the ranks' tensor data must then go undetected, and be
    counted."""
    from torch.distributed import TCPStore

    original = CheckpointReader._tensor

    def unchecked(self: CheckpointReader, name: str, buf: Any, b: int, e: int, checks: Any) -> Any:
        return original(self, name, buf, b, e, None)

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    pair = Pair(store.port)
    try:
        with tempfile.TemporaryDirectory(prefix="corruptranks-") as tmp:
            files = saved_files(pair, tmp)
    finally:
        pair.close(kill=True)
        del store
    reference = _loaded(_storage(files))
    CheckpointReader._tensor = unchecked  # type: ignore[method-assign]
    try:
        rng = random.Random(SEED)
        trials = failures = 0
        for _ in range(200):
            damaged, _what = mutate(files, "flip", rng)
            trials += 1
            if judge(damaged, reference) not in ("detected", "harmless"):
                failures += 1
    finally:
        CheckpointReader._tensor = original  # type: ignore[method-assign]
    return {"checksum not checked": {"trials": trials, "failures": failures}}
