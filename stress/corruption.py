"""Campaign 4, corruption: mutate valid checkpoints in every way a disk, a copy or a
person might, and check that each damage is detected before use.

Four committed checkpoints of a small training job (a model, AdamW with its moments, a
scheduler, random streams) are read into memory once. Each trial copies them into a
`MemoryStorage`, damages the newest one with one mutation drawn by seed, and runs
`CheckpointReader.verify` (what a restore runs before it touches the live state):

- ``flip``: one bit flipped anywhere in the data file or the manifest;
- ``truncate``: a file cut short at a random length; ``extend``: random bytes appended;
- ``zero-page``: a 4 KiB page of a file zeroed (one that was not all zeros already);
- ``missing``: the data file or the manifest deleted;
- ``swap``: the data file or the manifest of another step put in its place;
- ``edit``: one value of the manifest changed (a number, a string, an item removed),
  the digest left alone; ``edit-resigned``: the same in the tensor index or the file
  table, with the digest recomputed, as a forger would.

Verdicts: detected (`CorruptCheckpointError` or another `CheckpointError`, or the step
no longer listed), harmless (it verifies and every tensor and tree is what was saved:
e.g. a flip in a JSON string that decodes to the same text), or a failure: an
undetected change, or any other exception. Every ``restore_every``-th trial a fresh
`Checkpointer` restores the damaged root and must fall back to the older step (or load
the newest, for a harmless mutation).

Then the checksum's cost: the checksum of ``checksum_mib`` of tensor data, beside the
time of a synchronous save of the same bytes to local disk.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from typing import Any

import torch

from resumable import Checkpointer
from resumable.commit import list_committed, step_dir
from resumable.errors import CheckpointError
from resumable.format import byte_view, checksum, manifest_digest
from resumable.reader import CheckpointReader
from resumable.storage.memory import MemoryStorage
from stress.workload import checkpointer, make_state, set_step

SIZES = {
    "small": {"mutations": 1_200, "restore_every": 200, "checksum_mib": 64},
    "full": {"mutations": 100_000, "restore_every": 1_000, "checksum_mib": 1024},
}
SEED = 4
STEPS = (1, 2, 3, 4)
NEWEST = STEPS[-1]
DATA = "rank-00000.safetensors"
MANIFEST = "manifest.json"
KINDS = (
    "flip",
    "truncate",
    "extend",
    "zero-page",
    "missing",
    "swap",
    "edit",
    "edit-resigned",
)


def _job() -> dict[str, Any]:
    state = make_state(32)
    opt = torch.optim.AdamW(state["model"].parameters(), lr=1e-3)
    state["optim"] = opt
    state["sched"] = torch.optim.lr_scheduler.StepLR(opt, 2)
    return state


def _train(state: dict[str, Any], step: int) -> None:
    set_step(state, step)
    loss = state["model"](torch.ones(3, 32)).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()


def save_root(root: str) -> None:
    """Train the job and commit checkpoints of steps 1..4 into the local root ``root``
    (with its audit log and run id)."""
    state = _job()
    ck = checkpointer(root, state, keep=None, capture_rng=True)
    for step in STEPS:
        _train(state, step)
        ck.save(step)
    ck.close()


def saved_files() -> dict[str, bytes]:
    """The files of the committed checkpoints of steps 1..4, by path."""
    with tempfile.TemporaryDirectory(prefix="corruption-") as tmp:
        save_root(tmp)
        files = {}
        for step in STEPS:
            for name in (DATA, MANIFEST):
                path = f"{step_dir(step)}/{name}"
                with open(os.path.join(tmp, path), "rb") as f:
                    files[path] = f.read()
        return files


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _leaves(v, (*path, i))
    return out


def _edit(doc: Any, rng: random.Random, under: tuple[str, ...] | None) -> str:
    """Change one value of ``doc`` in place (under the top-level keys ``under``)."""
    paths = [p for p in _leaves(doc) if p and (under is None or p[0] in under)]
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    value = parent[key]
    if isinstance(value, bool):
        parent[key] = not value
    elif isinstance(value, int):
        parent[key] = value + rng.choice((-1, 1, 1 << 20))
    elif isinstance(value, float):
        parent[key] = value * 2 + 1
    elif isinstance(value, str):
        parent[key] = value[:-1] + ("0" if not value.endswith("0") else "1") if value else "x"
    elif isinstance(value, (list, dict)) and value and rng.random() < 0.5:
        if isinstance(value, list):
            value.pop(rng.randrange(len(value)))
        else:
            value.pop(rng.choice(list(value)))
    else:
        parent[key] = None
    return "/".join(map(str, path))


def mutate(files: dict[str, bytes], kind: str, rng: random.Random) -> tuple[dict[str, bytes], str]:
    """A copy of ``files`` with the newest checkpoint damaged; and what was done."""
    out = dict(files)
    d = step_dir(NEWEST)
    name = rng.choice((DATA, MANIFEST))
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
        other = rng.choice(STEPS[:-1])
        data = bytearray(files[f"{step_dir(other)}/{name}"])
        what = f"{name} of step {other}"
    else:
        doc = json.loads(files[f"{d}/{MANIFEST}"])
        path = f"{d}/{MANIFEST}"
        if kind == "edit":
            what = "edited " + _edit(doc, rng, None)
        else:
            what = "edited and re-signed " + _edit(doc, rng, ("tensors", "files"))
            doc["digest"] = manifest_digest(doc)
        data = bytearray(json.dumps(doc, indent=1).encode())
    out[path] = bytes(data)
    return out, what


def _storage(files: dict[str, bytes]) -> MemoryStorage:
    storage = MemoryStorage("memory://corruption")
    for path, data in files.items():
        storage.write(path, [data])
    return storage


def _loaded(storage: MemoryStorage) -> tuple[dict[str, bytes], Any]:
    reader = CheckpointReader(storage, NEWEST)
    tensors = {
        k: bytes(v.contiguous().reshape(-1).view(torch.uint8).numpy())
        for k, v in reader.tensors().items()
    }
    return tensors, reader.manifest["ranks"]


def judge(files: dict[str, bytes], reference: tuple[dict[str, bytes], Any]) -> str:
    """``detected``, ``harmless``, or what went wrong."""
    storage = _storage(files)
    try:
        if NEWEST not in list_committed(storage):
            return "detected"
        CheckpointReader(storage, NEWEST).verify()
        if _loaded(storage) == reference:
            return "harmless"
        return "undetected: it verifies but loads other values"
    except CheckpointError:
        return "detected"
    except Exception as exc:  # the point: anything else is a failure
        return f"unclean: {type(exc).__name__}: {exc}"


def restores_older(files: dict[str, bytes], verdict: str) -> str | None:
    storage = _storage(files)
    ck = Checkpointer(storage, _job(), persist="sync", keep=None, save_on_close=False)
    try:
        got = ck.restore()
    finally:
        ck.close()
    want = NEWEST if verdict == "harmless" else NEWEST - 1
    return None if got == want else f"restore came back at step {got}, not {want}"


def checksum_cost(mib: int) -> dict[str, Any]:
    """Seconds to checksum ``mib`` MiB of tensor data, and to persist them."""
    t = torch.randn(mib << 18)  # float32: mib MiB
    view = byte_view(t)
    t0 = time.perf_counter()
    checksum(view)
    hashing = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="checksum-") as tmp:
        ck = checkpointer(tmp, {"w": t}, keep=None)
        t0 = time.perf_counter()
        ck.save(1)
        persist = time.perf_counter() - t0
        ck.close()
    return {
        "mib": mib,
        "checksum_s": round(hashing, 3),
        "checksum_gib_per_s": round(mib / 1024 / hashing, 2),
        "persist_s": round(persist, 3),
        "checksum_share_of_persist": round(hashing / persist, 3),
    }


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    t0 = time.perf_counter()
    files = saved_files()
    reference = _loaded(_storage(files))
    rng = random.Random(SEED)
    verdicts: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    examples: list[dict[str, Any]] = []
    restores = failures = 0
    logger = logging.getLogger("resumable")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        for i in range(cfg["mutations"]):
            kind = KINDS[i % len(KINDS)]
            damaged, what = mutate(files, kind, rng)
            verdict = judge(damaged, reference)
            bad = verdict not in ("detected", "harmless")
            if not bad and i % cfg["restore_every"] == 0:
                restores += 1
                wrong = restores_older(damaged, verdict)
                if wrong is not None:
                    verdict, bad = wrong, True
            key = verdict.split(":", 1)[0]
            verdicts[kind][key] = verdicts[kind].get(key, 0) + 1
            if bad:
                failures += 1
                if len(examples) < 5:
                    examples.append({"trial": i, "kind": kind, "what": what, "verdict": verdict})
    finally:
        logger.setLevel(level)
    mutating = time.perf_counter() - t0
    cost = checksum_cost(cfg["checksum_mib"])
    return {
        "trials": cfg["mutations"],
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "details": {
            "mutations_by_kind": verdicts,
            "restores_checked": restores,
            "mutation_seconds": round(mutating, 1),
            "checkpoint_bytes": {
                k: len(v) for k, v in files.items() if k.startswith(step_dir(NEWEST))
            },
            "checksum_cost": cost,
            "examples": examples,
            "seed": SEED,
        },
    }


def able_to_fail() -> dict[str, dict[str, int]]:
    """The checks with the checksum comparison switched off (a reader that trusts the
    tensor bytes): flips in tensor data must then go undetected, and be counted."""
    original = CheckpointReader._tensor

    def unchecked(self: CheckpointReader, name: str, buf: Any, b: int, e: int, checks: Any) -> Any:
        return original(self, name, buf, b, e, None)

    CheckpointReader._tensor = unchecked  # type: ignore[method-assign]
    try:
        files = saved_files()
        reference = _loaded(_storage(files))
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
